"""Workers and switch end to end over the in-memory network: exact sums under loss, duplicates, reordering."""

from __future__ import annotations

import numpy as np
import pytest

from hpcdl.switch import Counter, pow2_scale_exponent
from hpcdl.switch.protocol import INT32_LIMIT

from .network import Network, make

#: (name, loss, duplicate, jitter, late): the fault mixes every case runs under
FAULTS = [
    ("clean", 0.0, 0.0, 0.0, 0.0),
    ("loss 1 %", 0.01, 0.0, 0.0, 0.0),
    ("loss 10 %", 0.10, 0.0, 0.0, 0.0),
    ("loss 1 %, dup, reorder", 0.01, 0.05, 20.0, 0.0),
    ("loss 10 %, dup, reorder, late", 0.10, 0.10, 20.0, 0.02),
]
#: vector lengths: not multiples of 64 or 256 elements, one shorter than a chunk, one of one element
LENGTHS = (1000, 37, 1, 777)


def _ints(rng: np.random.Generator, workers: int, length: int) -> list[np.ndarray]:
    """Int32 vectors whose W-term sum cannot overflow (the scale rule's promise), extremes included."""
    bound = INT32_LIMIT // workers
    vectors = [rng.integers(-bound, bound + 1, length).astype(np.int32) for _ in range(workers)]
    vectors[0][0] = bound  # the largest magnitude the rule allows, on every worker
    for v in vectors[1:]:
        v[0] = bound
    return vectors


def _net(workers: int, slots: int, payload: int, seed: int, fault: tuple) -> Network:
    _, loss, duplicate, jitter, late = fault
    return make(workers, slots, payload, seed, loss=loss, duplicate=duplicate, jitter=jitter,
                late=late, late_delay=5e-3)  # fmt: skip


def _chunks(length: int, payload: int) -> int:
    return -(-length // (payload // 4))


@pytest.mark.parametrize("fault", FAULTS, ids=[f[0] for f in FAULTS])
@pytest.mark.parametrize("workers", [1, 2, 3, 5, 8])
def test_int32_sum_is_exact(workers: int, fault: tuple) -> None:
    """Several reductions in a row over 4 slots (each reused): every worker gets the exact sum."""
    payload = 256
    net = _net(workers, slots=4, payload=payload, seed=workers, fault=fault)
    rng = np.random.default_rng(100 + workers)
    for length in LENGTHS:
        vectors = _ints(rng, workers, length)
        net.reduce(vectors, quantised=True)
        expected = np.sum(vectors, axis=0, dtype=np.int64)
        for w in net.workers:
            np.testing.assert_array_equal(w.result, expected.astype(np.int32))
    net.drain()  # late copies are answered or dropped, never summed
    chunks = sum(_chunks(n, payload) for n in LENGTHS)
    count = net.switch.count
    assert count[Counter.SUMMED] == workers * chunks  # no chunk summed twice, none left out
    assert count[Counter.COMPLETED] == chunks
    assert count[Counter.OVERFLOW] == count[Counter.MISMATCH] == count[Counter.MALFORMED] == 0
    if fault[0] == "clean":
        assert count[Counter.DUPLICATES] == count[Counter.STALE] == 0
        assert count[Counter.RETRANSMITTED_RESULTS] == 0
        assert sum(w.retransmissions for w in net.workers) == 0
    elif fault[1] >= 0.1:
        assert sum(w.retransmissions for w in net.workers) > 0  # the losses were recovered


@pytest.mark.parametrize("fault", FAULTS, ids=[f[0] for f in FAULTS])
@pytest.mark.parametrize("workers", [1, 3, 8])
def test_float_reduction_with_exponent_round(workers: int, fault: tuple) -> None:
    """The exponent round agrees on max e; the result is the exact sum of rint(g * 2**k)."""
    payload = 1024
    net = _net(workers, slots=2, payload=payload, seed=10 + workers, fault=fault)
    rng = np.random.default_rng(workers)
    for length, scale in ((1000, 1e-3), (300, 1e4), (5, 1e-30)):
        grads = [rng.normal(0, scale, length).astype(np.float32) for _ in range(workers)]
        net.reduce(grads, quantised=False)
        top = max(float(np.max(np.abs(g))) for g in grads)
        k = pow2_scale_exponent(int(np.frexp(top)[1]), workers)
        expected = np.sum([np.rint(np.ldexp(g.astype(np.float64), k)) for g in grads], axis=0)
        for w in net.workers:
            assert w.scale_exponent == k
            np.testing.assert_array_equal(w.result, expected.astype(np.int32))
            np.testing.assert_allclose(np.ldexp(w.result, -k), np.sum(grads, axis=0, dtype=np.float64),
                                       rtol=0, atol=workers * 2.0 ** (-k))  # fmt: skip
    net.drain()
    chunks = sum(_chunks(n, payload) for n in (1000, 300, 5))
    assert net.switch.count[Counter.EXPONENT_ROUNDS] == 3
    assert net.switch.count[Counter.SUMMED] == workers * (chunks + 3)
    assert net.switch.count[Counter.OVERFLOW] == 0


def test_window_smaller_than_slots_and_wrapping_use_numbers() -> None:
    """A window of 3 of 5 slots, use numbers crossing 2**32: still exact, nothing stale summed."""
    net = make(3, slots=5, payload=256, seed=3, window=3, loss=0.05, duplicate=0.05, jitter=10.0,
               late=0.05, late_delay=5e-3)  # fmt: skip
    for w in net.workers:
        w.use[:] = 2**32 - 3
    rng = np.random.default_rng(0)
    for _ in range(4):
        vectors = _ints(rng, 3, 500)
        net.reduce(vectors, quantised=True)
        for w in net.workers:
            np.testing.assert_array_equal(w.result, np.sum(vectors, axis=0))
    assert all(int(w.use.max()) < 10 for w in net.workers)  # wrapped
    net.drain()
    assert net.switch.count[Counter.SUMMED] == 3 * 4 * 8
    assert net.switch.state[3:].max() == 0  # slots past the window never used


def test_loss_recovered_through_the_shadow_copy() -> None:
    """At 30 % loss, lost results come back as shadow copies, unicast."""
    net = make(4, slots=2, payload=256, seed=1, loss=0.3)
    vectors = _ints(np.random.default_rng(1), 4, 2000)
    net.reduce(vectors, quantised=True)
    assert net.switch.count[Counter.RETRANSMITTED_RESULTS] > 0
    for w in net.workers:
        np.testing.assert_array_equal(w.result, np.sum(vectors, axis=0))


def test_a_run_is_a_function_of_its_seed() -> None:
    runs = []
    for _ in range(2):
        net = make(3, slots=2, payload=256, seed=5, loss=0.1, duplicate=0.1, jitter=5.0)
        net.reduce(_ints(np.random.default_rng(2), 3, 900), quantised=True)
        runs.append((net.now, net.switch.counters()))
    assert runs[0] == runs[1]


@pytest.mark.parametrize("workers", [2, 3, 8])
def test_the_switch_sums_the_same_integers_as_the_int32_ring(workers: int) -> None:
    """The exchange's int32 packing (hpcdl.comm.pack, the ring's) and the switch's workers quantise
    each rank's float32 gradients with the same k: the switch's int32 sum is the ring's, bit for bit."""
    from hpcdl.comm.pack import Packer, int32_exponent, int32_pow2_scale, local_maxabs  # noqa: PLC0415

    rng = np.random.default_rng(workers)
    grads = [(rng.standard_normal(1000) * 10.0 ** rng.uniform(-4, 1, 1000)).astype(np.float32)
             for _ in range(workers)]  # fmt: skip
    # the ring's side: each rank's exponent, MAX over the ranks, one scale, packed to int32 and summed
    exponent = max(int32_exponent(local_maxabs([g])) for g in grads)
    qscale = int32_pow2_scale(exponent, workers)
    packed = [Packer([g], mode="int32").pack([g], qscale=qscale).astype(np.int64) for g in grads]
    ring = np.sum(packed, axis=0)
    net = _net(workers, slots=4, payload=256, seed=workers, fault=FAULTS[-1])
    net.reduce(grads, quantised=False)
    for w in net.workers:
        assert 2.0**w.scale_exponent == qscale
        np.testing.assert_array_equal(w.result, ring.astype(np.int32))
