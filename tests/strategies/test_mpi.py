"""The conformance suite under mpiexec (``tests/run_mpi.sh 2`` and ``3``): where a case is
deterministic under MPI, a stop and ``--resume auto`` repeat the run bit for bit; each case
agrees with its reference, run on as many of the world's ranks as it takes."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcdl.comm import Communicator
from hpcdl.config import load_config
from hpcdl.driver.run import train
from hpcdl.parallel.conformance import Case

from .suite import (
    assert_agrees,
    assert_same_checkpoints,
    assert_same_rows,
    cases,
    config,
    final_checkpoint,
    parameter_names,
    parameters,
    reference_or_skip,
    skip_below,
    stop_step,
)


def _shared(comm: Communicator, tmp_path: Path) -> Path:
    """Rank 0's temporary directory, on every rank (rank 0 writes the run files and checkpoints)."""
    return Path(comm.bcast(str(tmp_path), root=0))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize(("name", "case_name", "case"), cases("mpi"))
def test_a_stop_and_resume_auto_repeat_the_run_bit_for_bit_under_mpiexec(
    name: str, case_name: str, case: Case, comm: Communicator, tmp_path: Path
) -> None:
    skip_below(name, comm.Get_size())
    base = _shared(comm, tmp_path)
    cfg = config(name, case)
    stop = stop_step(cfg)
    train(cfg, comm, out=base / "whole.h5")
    stopped = train(config(name, case, f"train.stop_at={stop}"), comm, out=base / "part.h5")
    assert stopped.stopped_by and stopped.steps == stop
    train(cfg, comm, out=base / "part.h5", resume="auto")
    comm.Barrier()
    if comm.Get_rank() == 0:
        assert final_checkpoint(base / "part.h5").step == cfg["train.steps"]
        assert_same_checkpoints(final_checkpoint(base / "part.h5"), final_checkpoint(base / "whole.h5"))
        assert_same_rows(name, base / "part.h5", base / "whole.h5", resumed_at=stop)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize(("name", "case_name", "case"), cases(reference=True))
def test_the_strategy_agrees_with_its_reference_under_mpiexec(
    name: str, case_name: str, case: Case, comm: Communicator, tmp_path: Path
) -> None:
    n = comm.Get_size()
    ref_sets, ranks = reference_or_skip(name, case, n)
    base = _shared(comm, tmp_path)
    cfg = config(name, case)
    train(cfg, comm, out=base / "run.h5")
    ref_cfg = load_config("digits-mlp", ref_sets)
    member = comm.Get_rank() < ranks
    sub = comm.Split(0 if member else 1, comm.Get_rank())
    try:
        if member:
            train(ref_cfg, sub, out=base / "ref.h5")
    finally:
        sub.Free()
    comm.Barrier()
    if comm.Get_rank() == 0:
        names = parameter_names(cfg)
        got = parameters(name, final_checkpoint(base / "run.h5"), names)
        want = parameters(ref_cfg["parallel.strategy"], final_checkpoint(base / "ref.h5"), names)
        assert_agrees(name, case, got, want)
