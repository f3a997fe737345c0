"""DistributedSampler: shards, the global-batch property, errors, resume."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from hpcdl.data import DistributedSampler
from hpcdl.errors import DataError
from hpcdl.rng import generator

N_SAMPLES = 1437  # the digits training set


def samplers(size, batch, n=N_SAMPLES, seed=5, kind="shuffle"):
    return [DistributedSampler(n, batch, r, size, seed=seed, kind=kind) for r in range(size)]


def test_small_literal_table():
    # n=10, 2 ranks x batch 2: 2 steps, the last 2 samples of the permutation dropped
    perm = generator(5, "epoch", 0).permutation(10)
    r0, r1 = samplers(2, 2, n=10)
    assert r0.steps_per_epoch == r1.steps_per_epoch == len(r0) == 2
    assert r0.indices(0, 0).tolist() == [perm[0], perm[2]]
    assert r1.indices(0, 0).tolist() == [perm[1], perm[3]]
    assert r0.indices(0, 1).tolist() == [perm[4], perm[6]]
    assert r1.indices(0, 1).tolist() == [perm[5], perm[7]]


@pytest.mark.parametrize("size", [1, 2, 3, 4, 7])
def test_shards_disjoint_and_cover_the_epoch(size):
    batch = 16
    ranks = samplers(size, batch)
    steps = N_SAMPLES // (size * batch)
    assert all(s.steps_per_epoch == steps for s in ranks)  # equal steps on every rank
    for epoch in (0, 3):
        taken = np.concatenate([np.concatenate(list(s.epoch_batches(epoch))) for s in ranks])
        assert len(taken) == steps * size * batch
        assert len(np.unique(taken)) == len(taken)  # no sample twice in an epoch
        perm = generator(5, "epoch", epoch).permutation(N_SAMPLES)
        assert set(taken.tolist()) == set(perm[: steps * size * batch].tolist())


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_ranks_together_take_the_single_rank_global_batch(size):
    """Step k of N ranks with batch B == step k of 1 rank with batch N*B (as multisets)."""
    batch = 10
    ranks = samplers(size, batch)
    (single,) = samplers(1, size * batch)
    assert single.steps_per_epoch == ranks[0].steps_per_epoch
    perm = generator(5, "epoch", 2).permutation(N_SAMPLES)
    gb = size * batch
    for k in range(single.steps_per_epoch):
        union = Counter(np.concatenate([s.indices(2, k) for s in ranks]).tolist())
        assert union == Counter(single.indices(2, k).tolist())
        assert union == Counter(perm[k * gb : (k + 1) * gb].tolist())


def test_deterministic_and_epochs_differ():
    a = DistributedSampler(N_SAMPLES, 32, 1, 3, seed=9)
    b = DistributedSampler(N_SAMPLES, 32, 1, 3, seed=9)
    assert np.array_equal(a.epoch_table(4), b.epoch_table(4))
    assert np.array_equal(a.epoch_table(4), a.epoch_table(4))
    assert not np.array_equal(a.epoch_table(0), a.epoch_table(1))
    c = DistributedSampler(N_SAMPLES, 32, 1, 3, seed=10)
    assert not np.array_equal(a.epoch_table(0), c.epoch_table(0))


def test_global_batch_larger_than_data_set():
    with pytest.raises(
        DataError, match=r"4 ranks x data.batch_size 400 = global batch 1600 exceeds the 1437"
    ) as e:
        DistributedSampler(N_SAMPLES, 400, 0, 4, seed=0)
    assert "data.batch_size <= 359" in str(e.value) and "sampler = 'random'" in str(e.value)
    with pytest.raises(DataError, match="at most 1437 ranks"):
        DistributedSampler(N_SAMPLES, 1, 0, 2048, seed=0)


def test_random_sampler_many_ranks():
    size, batch = 1024, 32
    ranks = [DistributedSampler(N_SAMPLES, batch, r, size, seed=1, kind="random") for r in (0, 1, 1023)]
    for s in ranks:
        assert s.steps_per_epoch == 1
        idx = s.indices(0, 0)
        assert idx.shape == (32,) and idx.dtype == np.int64 and 0 <= idx.min() and idx.max() < N_SAMPLES
    assert not np.array_equal(ranks[0].indices(0, 0), ranks[1].indices(0, 0))  # per-rank streams
    assert not np.array_equal(ranks[0].indices(0, 0), ranks[0].indices(1, 0))
    again = DistributedSampler(N_SAMPLES, batch, 1023, size, seed=1, kind="random")
    assert np.array_equal(again.indices(5, 0), ranks[2].indices(5, 0))


def test_random_sampler_steps():
    s = DistributedSampler(N_SAMPLES, 32, 0, 2, seed=0, kind="random")
    assert s.steps_per_epoch == N_SAMPLES // 64


@pytest.mark.parametrize("kind", ["shuffle", "random"])
def test_iteration_advances_position(kind):
    s = DistributedSampler(100, 8, 1, 3, seed=0, kind=kind)
    assert s.steps_per_epoch == 4 and (s.epoch, s.step) == (0, 0)
    steps = [step for step, _ in s]
    assert steps == [0, 1, 2, 3] and (s.epoch, s.step) == (1, 0)
    it = iter(s)
    step, idx = next(it)
    assert step == 0 and np.array_equal(idx, s.indices(1, 0)) and (s.epoch, s.step) == (1, 1)


@pytest.mark.parametrize("kind", ["shuffle", "random"])
def test_resume_yields_the_same_batches(kind):
    def run(sampler, n_batches):
        out = []
        while len(out) < n_batches:
            epoch = sampler.epoch
            for step, idx in sampler:
                out.append((epoch, step, idx.tolist()))
                if len(out) == n_batches:
                    break
        return out

    ref = run(DistributedSampler(100, 8, 2, 3, seed=4, kind=kind), 11)
    first = DistributedSampler(100, 8, 2, 3, seed=4, kind=kind)
    head = run(first, 6)  # stops at epoch 1 after step 1
    state = dict(first.state())
    assert (state["epoch"], state["step"]) == (1, 2)
    resumed = DistributedSampler(100, 8, 2, 3, seed=4, kind=kind)
    resumed.load_state(state)
    assert head + run(resumed, 5) == ref


def test_load_state_rejects_other_settings():
    s = DistributedSampler(100, 8, 0, 3, seed=4)
    state = s.state()
    other = DistributedSampler(100, 8, 0, 4, seed=4)
    with pytest.raises(DataError, match="size 3 \\(now 4\\)"):
        other.load_state(state)
    with pytest.raises(DataError, match="out of range"):
        s.load_state({"epoch": 0, "step": 4})
    s.load_state({"epoch": 2, "step": 3})  # settings optional
    assert (s.epoch, s.step) == (2, 3)


def test_bad_arguments():
    with pytest.raises(DataError, match="data.sampler"):
        DistributedSampler(10, 1, 0, 1, seed=0, kind="sequential")
    with pytest.raises(DataError, match="rank 2 out of range"):
        DistributedSampler(10, 1, 2, 2, seed=0)
    with pytest.raises(DataError, match="batch_size"):
        DistributedSampler(10, 0, 0, 1, seed=0)


def test_batches_are_read_only():
    idx = DistributedSampler(10, 2, 0, 1, seed=0).indices(0, 0)
    with pytest.raises(ValueError, match="read-only"):
        idx[0] = 0
