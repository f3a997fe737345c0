"""The conformance bodies against MPI's world, under mpiexec (``tests/run_mpi.sh N tests/comm``)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

import hpcdl.comm as hc
from hpcdl.comm import Communicator

from .conformance import CHECKS


def run_everywhere(check: Callable[[Communicator], None], comm: Communicator) -> None:
    """Run ``check`` on a Dup of ``comm``; fail on every rank if it failed on any.

    The Dup keeps a failed body's stray messages away from the next test, and the
    agreement makes all ranks leave the test together instead of some of them waiting
    in the next collective.
    """
    error: BaseException | None = None
    dup = comm.Dup()
    try:
        check(dup)
    except Exception as exc:  # reported below, after the ranks agree
        error = exc
    failed = comm.allgather(error is not None)
    dup.Free()
    if error is not None:
        raise error
    if any(failed):
        pytest.fail(f"{check.__name__} failed on ranks {[r for r, f in enumerate(failed) if f]}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("check", CHECKS, ids=[c.__name__ for c in CHECKS])
def test_conformance(check: Callable[[Communicator], None], comm: Communicator) -> None:
    run_everywhere(check, comm)


@pytest.mark.mpi(min_size=2)
def test_world_is_mpi_comm_world(comm: Communicator) -> None:
    from mpi4py import MPI

    assert comm is MPI.COMM_WORLD
    assert isinstance(comm, hc.Communicator)
    assert hc.SUM is MPI.SUM and hc.ANY_SOURCE == MPI.ANY_SOURCE


@pytest.mark.mpi(min_size=2)
def test_wtime_close_across_ranks(comm: Communicator) -> None:
    """MPI.Wtime is a wall clock: every rank reads it, it only moves forward."""
    t0 = hc.wtime()
    comm.Barrier()
    t1 = hc.wtime()
    assert t1 >= t0
    assert all(t >= 0 for t in comm.allgather(t1 - t0))
