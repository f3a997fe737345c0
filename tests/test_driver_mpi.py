"""The driver's seam carries a strategy that is not sync data parallel (under mpiexec -n 2 and -n 3).

The toy strategy (``toy_strategy.py``): a keeper and workers, ranks meeting every 4 steps.
The driver's collectives (log flushes, the stop vote, checkpoints, evaluation) must come at
those meetings only; stops, checkpoints and resume work through its pieces, which are not
the sync strategy's (each rank holds a piece of its own).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import toy_strategy

from hpcdl.comm import Communicator
from hpcdl.config import load_config
from hpcdl.driver import train
from hpcdl.store.checkpoint import checkpoint_path, load_checkpoint

pytestmark = pytest.mark.mpi(min_size=2)

TOY = ["parallel.strategy='toy_strategy:KeeperAveraging'", "train.steps=12", "checkpoint.every=8",
       "log.flush_every=1", "model.width=32"]  # fmt: skip
#: the collectives of the contract
COLLECTIVES = {"Barrier", "Bcast", "Reduce", "Allreduce", "Iallreduce", "Allgather", "Gather",
               "bcast", "gather", "allgather", "allreduce"}  # fmt: skip


class Recorder:
    """The world, with a note of every collective and of the step the toy strategy was at."""

    def __init__(self, comm: Communicator, events: list[tuple[str, int]], steps: list[int]) -> None:
        self._comm, self._events, self._steps = comm, events, steps

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._comm, name)
        if name not in COLLECTIVES:
            return attr

        def recorded(*args: Any, **kwargs: Any) -> Any:
            self._events.append((name, self._steps[0]))
            return attr(*args, **kwargs)

        return recorded


def _shared(comm: Communicator, tmp_path: Path) -> Path:
    return Path(comm.bcast(str(tmp_path), root=0))


def _digest(result: Any) -> str:
    h = hashlib.sha256()
    for name, p in result.model.named_parameters():
        h.update(name.encode() + np.ascontiguousarray(p.data).tobytes())
    return h.hexdigest()


class Counting(toy_strategy.KeeperAveraging):
    """The toy strategy, counting its steps for the recorder."""

    steps = [0]

    def step(self, step: int) -> Any:
        Counting.steps[0] = step + 1
        return super().step(step)


def test_the_driver_meets_only_at_the_strategys_meetings(comm: Communicator, tmp_path: Path) -> None:
    out = _shared(comm, tmp_path) / "toy.h5"
    events: list[tuple[str, int]] = []
    Counting.steps[0] = 0
    cfg = load_config("digits-mlp", [*TOY, 'parallel.strategy="test_driver_mpi:Counting"'])
    result = train(cfg, Recorder(comm, events, Counting.steps), out=out)
    assert result.steps == 12 and result.strategy.meetings == 3
    during = {step for _, step in events if 0 < step < 12}
    assert during <= {4, 8}, f"collectives after steps {sorted(during)}: the toy meets after 4, 8, 12"
    assert {step for _, step in events} >= {4, 8, 12}
    assert len(set(comm.allgather(_digest(result)))) == 1  # after the last meeting: one average everywhere
    if comm.Get_rank() == 0:  # rank 0, the keeper, reads no batches: a row's lr, time, bytes are others'
        with h5py.File(out, "r") as f:
            assert list(f["metrics/step"][...]) == list(range(1, 13)) and f.attrs["status"] == "finished"
            assert np.all(f["metrics/lr"][...] > 0) and np.all(np.diff(f["metrics/time"][...]) > 0)
            assert f["metrics/bytes_sent"][3] > 0 and np.isfinite(f["metrics/samples_per_s"][...]).all()
            assert f["ranks/comm_time"][3, 1] > 0  # the averaging at the meeting after step 4
            assert f["ranks/compute_time"].shape == (12, comm.Get_size()) and f.attrs["strategy"] == "toy"
            assert np.isfinite(f["metrics/loss"][...]).all() and np.isfinite(f["metrics/test_accuracy"][-1])
        ckpt = load_checkpoint(checkpoint_path(out, 12))
        replicas = [f"replica {w}" for w in range(comm.Get_size() - 1)]
        assert sorted(ckpt.pieces) == sorted(["average", *replicas])


def test_a_stop_at_a_meeting_resumes_bitwise_and_one_between_meetings_meets_there(
    comm: Communicator, tmp_path: Path
) -> None:
    base = _shared(comm, tmp_path)
    cfg = load_config("digits-mlp", TOY)
    whole = train(cfg, comm, out=base / "whole.h5")
    first = train(load_config("digits-mlp", [*TOY, "train.stop_at=8"]), comm, out=base / "split.h5")
    assert first.stopped_by == "train.stop_at = 8" and first.steps == 8
    rest = train(cfg, comm, out=base / "split.h5", resume="auto")
    assert rest.steps == 12 and rest.strategy.meetings == whole.strategy.meetings == 3
    assert all(comm.allgather(rest.train_s > first.train_s))  # each rank's own time goes on
    same = _digest(rest) == _digest(whole)
    assert all(comm.allgather(same)), "a resumed toy run must end bitwise where the whole run ends"
    if comm.Get_rank() == 0:
        with h5py.File(base / "split.h5", "r") as f, h5py.File(base / "whole.h5", "r") as g:
            assert list(f.attrs["resumed_at"]) == [8]
            np.testing.assert_array_equal(f["metrics/loss"][...], g["metrics/loss"][...])
    # a stop between the toy's own meetings (4, 8) needs every rank: they meet at 6, not 8
    early = train(load_config("digits-mlp", [*TOY, "train.stop_at=6"]), comm, out=base / "early.h5")
    assert early.stopped_by == "train.stop_at = 6" and early.steps == 6 and early.strategy.meetings == 2
