"""Resume under mpiexec: N ranks stop, continue, and end bit for bit where an uninterrupted run ends."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import h5py
import numpy as np
import pytest

from hpcdl.comm import world
from hpcdl.comm.collectives import CollectivesFreedError
from hpcdl.config import load_config
from hpcdl.train import run

SETS = ["model.channels=4", "model.dropout=0.3", "train.epochs=3", "checkpoint.every=0"]


@pytest.mark.mpi(min_size=2)
def test_resume_is_bitwise_identical_across_ranks() -> None:
    comm = world()
    tmp = comm.bcast(tempfile.mkdtemp(prefix="hpcdl-resume-") if comm.Get_rank() == 0 else None, root=0)
    whole = run(load_config("digits-cnn", SETS), comm, out=Path(tmp) / "whole.h5")
    first = run(load_config("digits-cnn", [*SETS, "train.stop_at=17"]), comm, out=Path(tmp) / "split.h5")
    assert first.steps == 17
    rest = run(load_config("digits-cnn", SETS), comm, out=Path(tmp) / "split.h5", resume="auto")
    assert rest.steps == whole.steps
    mine, ref = rest.model.state_dict(), whole.model.state_dict()  # each rank's own BatchNorm statistics too
    for name in ref:
        assert mine[name].tobytes() == ref[name].tobytes(), name
    for key, value in whole.optimizer.state_dict().items():
        if isinstance(value, np.ndarray):
            assert rest.optimizer.state_dict()[key].tobytes() == value.tobytes(), key
    if comm.Get_rank() == 0:  # every metric but the timings, bytes sent included (it restarted at 0)
        with h5py.File(Path(tmp) / "split.h5", "r") as f, h5py.File(Path(tmp) / "whole.h5", "r") as g:
            for name in ("step", "loss", "train_accuracy", "test_accuracy", "lr", "bytes_sent"):
                np.testing.assert_array_equal(f["metrics"][name][...], g["metrics"][name][...], err_msg=name)
    for result in (whole, rest):  # the exchange's duplicated communicator is freed at the end
        with pytest.raises(CollectivesFreedError):
            _ = result.strategy.exchange.coll.comm
    comm.Barrier()
    if comm.Get_rank() == 0:
        shutil.rmtree(tmp)
