"""Distributed K-FAC under mpiexec (-n 2, -n 3; -n 4 in the slow suite) against one process.

``kfac.grad_workers`` = 1 (MEM-OPT) and N (COMM-OPT): the parameters end where one process with
``exchange.accumulate = N`` ends on the same samples (float64, relative 1e-10), on every rank;
at -n 2 a stop and ``--resume auto`` repeat the run bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from kfac_config import COMMON, flat  # tests/ is on sys.path (pytest prepend mode)

from hpcdl.comm import world
from hpcdl.config import load_config
from hpcdl.store.checkpoint import list_checkpoints, load_checkpoint
from hpcdl.train import run


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("workers", ["one", "all"])
def test_distributed_kfac_ends_where_one_process_accumulating_ends(workers: str) -> None:
    comm = world()
    n = comm.Get_size()
    k = 1 if workers == "one" else n
    got = run(load_config("digits-mlp", [*COMMON, f"kfac.grad_workers={k}"]), comm)
    alone_comm = comm.Split(comm.Get_rank(), 0)
    try:
        alone = run(load_config("digits-mlp", [*COMMON, f"exchange.accumulate={n}"]), alone_comm)
    finally:
        alone_comm.Free()
    want = flat(alone)
    np.testing.assert_allclose(flat(got), want, rtol=0, atol=1e-10 * np.abs(want).max())
    mine = flat(got)
    every = comm.allgather(mine)
    assert all(np.array_equal(x, every[0]) for x in every)  # every rank the same model, bitwise


@pytest.mark.mpi(min_size=2)
def test_a_stop_and_resume_auto_repeat_a_kfac_run_bit_for_bit(tmp_path: Path) -> None:
    comm = world()
    if comm.Get_size() != 2:
        pytest.skip("checked at -n 2")
    whole = Path(comm.bcast(str(tmp_path / "whole.h5"), root=0))
    part = Path(comm.bcast(str(tmp_path / "part.h5"), root=0))
    sets = [*COMMON, "kfac.grad_workers=1", "checkpoint.every=3", "train.steps=6", "kfac.inv_every=4"]
    run(load_config("digits-mlp", sets), comm, out=whole)
    run(load_config("digits-mlp", [*sets, "train.stop_at=3"]), comm, out=part)
    run(load_config("digits-mlp", sets), comm, out=part, resume="auto")
    if comm.Get_rank() == 0:
        a, b = load_checkpoint(list_checkpoints(whole)[0]), load_checkpoint(list_checkpoints(part)[0])
        assert a.step == b.step == 6
        for group in ("params", "optimizer", "kfac"):
            for key, value in a.pieces["model"][group].items():
                assert value.tobytes() == b.pieces["model"][group][key].tobytes(), (group, key)
