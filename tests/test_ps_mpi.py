"""Parameter servers under mpiexec (-n 2 and -n 3): every mode, against simpler equivalents.

* one server and one worker in ``async`` mode is single-process training, bit for bit;
* ``ssp`` with a 3x straggler (``debug.slowdown``) never exceeds the largest staleness the
  rule allows; ``async`` and ``ssp`` finish with one staleness row per push and shard.

``sync`` mode against sync data parallel, and its stop and ``--resume auto``, are the
conformance suite's (``tests/strategies/``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
from ps_config import cfg

from hpcdl.comm import world
from hpcdl.parallel.ps_plan import max_staleness
from hpcdl.train import run


def master(result: Any, comm: Any, servers: int) -> np.ndarray | None:
    """The packed master parameters gathered from the servers onto rank 0 (None elsewhere)."""
    shard = result.strategy.shard.data if comm.Get_rank() < servers else None
    shards = comm.gather(shard, root=0)
    return np.concatenate(shards[:servers]) if shards is not None else None


def packed(result: Any) -> np.ndarray:
    return np.concatenate([p.data.ravel() for p in result.model.parameters()])


def shared_path(comm: Any, tmp_path: Path, name: str) -> Path:
    """Rank 0's temporary path, on every rank (the run file is written by rank 0 only)."""
    return Path(comm.bcast(str(tmp_path / name), root=0))


@pytest.mark.mpi(min_size=2)
def test_one_worker_async_is_single_process_training_bit_for_bit() -> None:
    comm = world()
    pair = comm.Split(0 if comm.Get_rank() < 2 else 1, comm.Get_rank())
    try:
        if comm.Get_rank() < 2:
            ps = run(cfg("train.steps=24", "ps.mode=async"), pair)
            got = master(ps, pair, 1)
            losses = [r["loss"] for r in ps.history]
    finally:
        pair.Free()
    alone_comm = comm.Split(comm.Get_rank(), 0)
    try:
        alone = run(cfg("train.steps=24", "parallel.strategy=sync"), alone_comm)
    finally:
        alone_comm.Free()
    if comm.Get_rank() == 0:
        np.testing.assert_array_equal(got, packed(alone))
        assert losses == [r["loss"] for r in alone.history]


@pytest.mark.mpi(min_size=3)
@pytest.mark.parametrize("bound", [0, 1])
def test_ssp_never_exceeds_its_staleness_bound_with_a_3x_straggler(tmp_path: Path, bound: int) -> None:
    comm = world()
    n = comm.Get_size()
    out = shared_path(comm, tmp_path, "ssp.h5")
    straggler = f"debug.slowdown=['{n - 1}:3']"
    sets = ["train.steps=60", "ps.mode=ssp", f"ps.staleness={bound}", straggler]
    result = run(cfg(*sets), comm, out=out)
    if comm.Get_rank() == 0:
        with h5py.File(out) as f:
            tau, worker = f["staleness/tau"][...], f["staleness/worker"][...]
        assert len(tau) == result.steps == 60
        assert tau.max() <= max_staleness(n - 1, bound), np.bincount(tau)
        assert (worker == n - 2).sum() <= 60 / (n - 1)  # the straggler pushes no more than its share


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mode", ["async", "ssp", "sync"])
def test_every_mode_finishes_with_a_row_per_push_and_shard(tmp_path: Path, mode: str) -> None:
    comm = world()
    n = comm.Get_size()
    servers = 2 if n >= 3 else 1
    out = shared_path(comm, tmp_path, f"{mode}.h5")
    steps = 12 * (n - servers)
    result = run(cfg(f"train.steps={steps}", f"ps.mode={mode}", f"ps.servers={servers}",
                     "train.eval_every=10"), comm, out=out)  # fmt: skip
    if comm.Get_rank() == 0:
        with h5py.File(out) as f:
            rows = {k: f["staleness"][k][...] for k in f["staleness"]}
            accuracy = f["metrics/test_accuracy"][...]
            pushes = f["ranks/pushes_per_s"][...]
        assert len(rows["update"]) == steps * servers
        workers = n - servers
        # every server applied every push once; a sync round's W pushes share its update
        rounds = np.repeat(np.arange(workers, steps + 1, workers), workers)
        expected = np.arange(1, steps + 1) if mode != "sync" else rounds
        for k in range(servers):
            np.testing.assert_array_equal(np.sort(rows["update"][rows["server"] == k]), expected)
        assert (rows["tau"] >= 0).all()
        if mode == "sync":
            assert not rows["tau"].any()
        assert np.isfinite(accuracy[-1]) and np.isfinite(accuracy).sum() >= 2  # evaluated on the way
        assert np.isnan(pushes[:, :servers]).all() and (pushes[:, servers:] > 0).all()
        assert result.test_accuracy == accuracy[-1]


@pytest.mark.mpi(min_size=3)
@pytest.mark.parametrize("mode", ["sync", "ssp", "async"])
def test_waits_for_a_slow_worker_do_not_trip_the_stall_watchdog(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str], mode: str
) -> None:
    """The last worker takes 0.4 s a push, 0.4 stall limits, the others next to nothing: the
    server's wait for its push, the workers held by the round (sync) or the bound (ssp, s = 0),
    and those waiting at the end of the phase for its last push (async) each last about one
    of its pushes, not more (however many pushes the others make meanwhile): no stall, nor the
    warning of a long wait. (A push slower than ``debug.stall_s`` is a stall, as a step is
    under sync: tests/test_watchdog.py stops a worker.)"""
    import time

    import hpcdl.parallel.ps_worker as ps_module
    from hpcdl.comm import WatchedComm, watch

    n = world().Get_size()
    if world().Get_rank() == n - 1:
        compute = ps_module.forward_backward

        def slow(*args: Any) -> Any:
            time.sleep(0.4)
            return compute(*args)

        monkeypatch.setattr(ps_module, "forward_backward", slow)
    steps = 3 * (n - 1)
    with watch(1.0, grace_s=0.5) as comm:
        assert isinstance(comm, WatchedComm)
        result = run(cfg(f"train.steps={steps}", f"ps.mode={mode}", "ps.staleness=0",
                         "debug.stall_s=1.0"), comm)  # fmt: skip
    assert result.steps == steps
    assert "longer than debug.stall_s" not in capfd.readouterr().err
