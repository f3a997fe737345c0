"""Data-parallel training under mpiexec equals single-process training on the same global batches."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest

from hpcdl.comm import world
from hpcdl.config import load_config
from hpcdl.store.checkpoint import checkpoint_path
from hpcdl.train import run

EXCHANGES = [
    ["exchange.name=allreduce"],
    # several buckets (0.05 MiB holds ~6,500 float64), each of hpcdl's own algorithms, and MPI's
    *[["exchange.name=bucketed", "exchange.bucket_mb=0.05", f"exchange.algorithm={a}"]
      for a in ("ring", "doubling", "rabenseifner", "mpi")],
]  # fmt: skip


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("exchange", EXCHANGES, ids=lambda e: e[-1].split("=")[1])
def test_data_parallel_equals_one_process_on_global_batches(optimizer: str, exchange: list[str]) -> None:
    comm = world()
    n, batch = comm.Get_size(), 16
    common = [
        f"optimizer.name={optimizer}",
        "optimizer.lr=0.01",
        "train.steps=12",
        "dtype=float64",
        "optimizer.weight_decay=1e-4",
        "schedule.name=cosine",
        "schedule.scale=none",  # the same lr as the single process with N x the batch
    ]
    parallel = run(load_config("digits-mlp", [*common, *exchange, f"data.batch_size={batch}"]), comm)
    alone_comm = comm.Split(comm.Get_rank(), 0)  # a world of one on every rank
    try:
        alone = run(load_config("digits-mlp", [*common, f"data.batch_size={n * batch}"]), alone_comm)
    finally:
        alone_comm.Free()
    assert parallel.steps == alone.steps == 12
    for p, q in zip(parallel.model.parameters(), alone.model.parameters()):
        np.testing.assert_allclose(p.data, q.data, rtol=1e-9, atol=1e-12, err_msg=p.name)
    # and every rank holds the same parameters, bit for bit
    mine = np.concatenate([p.data.ravel() for p in parallel.model.parameters()])
    theirs = comm.bcast(mine, root=0)
    np.testing.assert_array_equal(mine, theirs)


COMMON = ["optimizer.lr=0.01", "train.steps=6", "dtype=float64", "schedule.scale=none"]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("exchange", ["allreduce", "bucketed"])
def test_accumulation_equals_one_process_on_the_whole_global_batch(exchange: str) -> None:
    """N ranks x 3 micro-steps of 8 = one process with batches of 24 N: the same trajectory."""
    comm = world()
    n = comm.Get_size()
    sets = [*COMMON, f"exchange.name={exchange}", "exchange.bucket_mb=0.05"]
    parallel = run(load_config("digits-mlp", [*sets, "data.batch_size=8", "exchange.accumulate=3"]), comm)
    alone_comm = comm.Split(comm.Get_rank(), 0)
    try:
        alone = run(load_config("digits-mlp", [*COMMON, f"data.batch_size={24 * n}"]), alone_comm)
    finally:
        alone_comm.Free()
    assert parallel.steps == alone.steps == 6
    assert parallel.history[0]["samples_per_s"] > 0 and parallel.samples_per_s > 0
    for p, q in zip(parallel.model.parameters(), alone.model.parameters()):
        np.testing.assert_allclose(p.data, q.data, rtol=1e-9, atol=1e-12, err_msg=p.name)


@pytest.mark.mpi(min_size=2)
def test_compressed_runs_send_half_the_bytes_and_stay_close() -> None:
    comm = world()
    sets = [*COMMON, "dtype=float32"]
    plain = run(load_config("digits-mlp", sets), comm)
    half = run(load_config("digits-mlp", [*sets, 'exchange.compression="float16"']), comm)
    assert half.history[-1]["bytes_sent"] * 2 == plain.history[-1]["bytes_sent"] > 0
    for p, q in zip(half.model.parameters(), plain.model.parameters()):
        np.testing.assert_allclose(p.data, q.data, rtol=0, atol=2e-3, err_msg=p.name)
        assert not np.array_equal(p.data, q.data) or p.name.endswith("bias")


@pytest.mark.mpi(min_size=2)
def test_compression_needs_the_bucketed_exchange() -> None:
    from hpcdl.errors import ConfigError

    cfg = load_config("digits-mlp", ["exchange.name=allreduce", 'exchange.compression="int32"'])
    with pytest.raises(ConfigError, match="needs exchange.name = 'bucketed'"):
        run(cfg, world())


@pytest.mark.mpi(min_size=2)
def test_weights_broadcast_from_rank_0() -> None:
    """Even if the ranks' seeds differ, rank 0's initial weights win (train.steps=0 is not allowed,
    so one step at lr 0 leaves the broadcast weights untouched)."""
    comm = world()
    cfg = load_config("digits-mlp", ["train.steps=1", "optimizer.lr=0", f"seed={comm.Get_rank()}"])
    result = run(cfg, comm)
    mine = np.concatenate([p.data.ravel() for p in result.model.parameters()])
    np.testing.assert_array_equal(mine, comm.bcast(mine, root=0))


@pytest.mark.mpi(min_size=2)
def test_batchnorm_statistics_stay_local() -> None:
    comm = world()
    result = run(load_config("digits-cnn", ["train.steps=2", "model.channels=4"]), comm)
    bn = result.model[1]
    means = comm.allgather(np.asarray(bn.running_mean).copy())
    assert any(not np.array_equal(means[0], m) for m in means[1:])


@pytest.mark.mpi(min_size=2)
def test_the_exchanges_duplicated_communicator_is_freed_at_the_end() -> None:
    from hpcdl.comm.collectives import CollectivesFreedError

    result = run(load_config("digits-mlp", ["train.steps=2"]), world())
    with pytest.raises(CollectivesFreedError):
        _ = result.strategy.exchange.coll.comm


def _as_before(path: Path, key: str) -> None:
    """Make the config a run file or checkpoint stores read as a hpcdl before ``key`` wrote it."""
    section, _, leaf = key.rpartition(".")
    with h5py.File(path, "r+") as f:
        text = str(f.attrs["config"])
        kept, where = [], ""
        for line in text.splitlines():
            where = line.strip("[]") if line.startswith("[") else where
            if not (where == section and line.split(" = ")[0] == leaf):
                kept.append(line)
        assert len(kept) == len(text.splitlines()) - 1, f"{key} is not in {path}'s config"
        f.attrs["config"] = "\n".join(kept) + "\n"


@pytest.mark.mpi(min_size=2)
def test_an_int32_run_begun_before_the_pow2_rule_resumes_under_the_max_rule_bitwise(tmp_path: Path) -> None:
    """A run file and checkpoint of before exchange.int32_scale (the key absent from their configs) resume,
    under today's config and default, with the rule they began with: bitwise the uninterrupted max run."""
    comm = world()
    base = Path(comm.bcast(str(tmp_path), root=0))
    sets = [*COMMON, "exchange.compression='int32'", "exchange.bucket_mb=0.05"]
    old = [*sets, "exchange.int32_scale='max'"]
    whole_max = run(load_config("digits-mlp", old), comm, out=base / "max.h5")
    whole_pow2 = run(load_config("digits-mlp", sets), comm, out=base / "pow2.h5")
    first = run(load_config("digits-mlp", [*old, "train.stop_at=3"]), comm, out=base / "split.h5")
    assert first.steps == 3
    if comm.Get_rank() == 0:
        for path in (base / "split.h5", checkpoint_path(base / "split.h5", 3)):
            _as_before(path, "exchange.int32_scale")
    comm.Barrier()
    rest = run(load_config("digits-mlp", sets), comm, out=base / "split.h5", resume="auto")
    assert rest.steps == whole_max.steps == 6
    for p, q, r in zip(rest.model.parameters(), whole_max.model.parameters(), whole_pow2.model.parameters()):
        assert np.array_equal(p.data, q.data), p.name  # the old rule, bitwise
        assert not np.array_equal(p.data, r.data), p.name  # which the new one is not
    if comm.Get_rank() == 0:
        with h5py.File(base / "split.h5", "r") as f:
            assert 'int32_scale = "max"' in str(f.attrs["config"])  # the rule, recorded now
            assert list(f.attrs["resumed_at"]) == [3]
