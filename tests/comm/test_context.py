"""Serial tests of hpcdl.comm: the world of one, set_world, wtime, waitall/waitany, abort."""

from __future__ import annotations

import contextvars
import io
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import hpcdl.comm as hc

REPO = Path(__file__).resolve().parents[2]

world_of_one = pytest.mark.skipif(hc.world().Get_size() != 1, reason="world-of-one tests run without mpiexec")


# -- the world of one (python -m pytest, no mpiexec) ------------------------------------


@world_of_one
def test_world_of_one_is_mpi_comm_world(comm: hc.Communicator) -> None:
    assert (comm.Get_rank(), comm.Get_size(), comm.rank, comm.size) == (0, 1, 0, 1)
    assert isinstance(comm, hc.Communicator)
    assert comm is hc.world()


@world_of_one
def test_world_of_one_point_to_point(comm: hc.Communicator) -> None:
    send = np.arange(4, dtype=np.float32)
    recv = np.zeros(4, dtype=np.float32)
    req = comm.Isend(send, dest=0, tag=3)
    status = hc.Status()
    while not comm.Iprobe(source=0, tag=3, status=status):
        pass
    assert (status.Get_source(), status.Get_tag(), status.Get_count()) == (0, 3, 16)
    comm.Recv(recv, source=hc.ANY_SOURCE, tag=hc.ANY_TAG)
    req.Wait()
    assert np.array_equal(recv, send)
    out = np.zeros(4, dtype=np.float32)
    comm.Sendrecv(send * 2, dest=0, recvbuf=out, source=0)
    assert np.array_equal(out, send * 2)
    rreq = comm.Irecv(out, source=0, tag=4)
    sreq = comm.Isend(send + 1, dest=0, tag=4)
    hc.waitall([rreq, sreq])
    assert np.array_equal(out, send + 1)


@world_of_one
def test_world_of_one_collectives(comm: hc.Communicator) -> None:
    x = np.array([1.5, -2.0, 3.0])
    for op in (hc.SUM, hc.MAX, hc.MIN):
        out = np.zeros(3)
        comm.Allreduce(x, out, op=op)
        assert np.array_equal(out, x)
        comm.Reduce(x, out, op=op, root=0)
        assert np.array_equal(out, x)
        y = x.copy()
        comm.Allreduce(hc.IN_PLACE, y, op=op)
        assert np.array_equal(y, x)
    out = np.zeros(3)
    comm.Iallreduce(x, out, op=hc.SUM).Wait()
    assert np.array_equal(out, x)
    b = x.copy()
    comm.Bcast(b, root=0)
    assert np.array_equal(b, x)
    g = np.zeros((1, 3))
    comm.Allgather(x, g)
    assert np.array_equal(g[0], x)
    g[:] = 0
    comm.Gather(x, g, root=0)
    assert np.array_equal(g[0], x)
    comm.Barrier()
    assert comm.bcast({"a": 1}) == {"a": 1}
    assert comm.gather(5) == [5] and comm.allgather(5) == [5]
    assert comm.allreduce(5) == 5 and comm.allreduce(5, op=hc.MAX) == 5


@world_of_one
def test_world_of_one_communicators(comm: hc.Communicator) -> None:
    for sub in (comm.Split(color=0, key=0), comm.Dup(), hc.subcomm(comm, [0])):
        try:
            assert (sub.Get_rank(), sub.Get_size()) == (0, 1)
            assert sub.allreduce(2) == 2
        finally:
            sub.Free()


# -- contract, imports --------------------------------------------------------------------


def test_import_is_cheap_and_lazy() -> None:
    code = (
        "import sys, hpcdl.comm, hpcdl.comm.pack\n"
        "assert 'mpi4py' not in sys.modules, 'import hpcdl.comm imported mpi4py'\n"
        "from hpcdl.comm import SUM\n"
        "from mpi4py import MPI\n"
        "assert SUM is MPI.SUM and hpcdl.comm.ANY_TAG == MPI.ANY_TAG\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env=_env_without_pmi(), timeout=60)


def test_only_the_adapter_imports_mpi4py() -> None:
    pattern = re.compile(r"^\s*(from|import)\s+mpi4py\b", re.MULTILINE)
    offenders = [
        str(p.relative_to(REPO))
        for p in (REPO / "hpcdl").rglob("*.py")
        if pattern.search(p.read_text(encoding="utf-8"))
    ]
    assert offenders == ["hpcdl/comm/mpi.py"]


def test_conformance_bodies_use_only_the_contract() -> None:
    text = (REPO / "tests" / "comm" / "conformance.py").read_text(encoding="utf-8")
    assert "mpi4py" not in text


def test_unknown_attribute() -> None:
    with pytest.raises(AttributeError, match="NOPE"):
        _ = hc.NOPE  # type: ignore[attr-defined]


# -- set_world, wtime, Status ---------------------------------------------------------------


class FakeStatus:
    def Get_source(self) -> int:
        return 0

    def Get_tag(self) -> int:
        return 0

    def Get_count(self, datatype: object = None) -> int:
        return 0


class FakeWorld:
    """A stand-in for the simulator's communicator: only the hooks hpcdl.comm looks up."""

    def __init__(self, rank: int = 0, size: int = 4, clock: float = 10.0) -> None:
        self.rank, self.size, self.clock = rank, size, clock
        self.aborted: int | None = None
        self.subcomms: list[list[int]] = []

    def Get_rank(self) -> int:
        return self.rank

    def Get_size(self) -> int:
        return self.size

    def Abort(self, errorcode: int = 0) -> None:
        self.aborted = errorcode

    def wtime(self) -> float:
        return self.clock

    def new_status(self) -> FakeStatus:
        return FakeStatus()

    def subcomm(self, ranks: list[int]) -> str:
        self.subcomms.append(ranks)
        return f"sub{ranks}"


def test_set_world_and_reset() -> None:
    mpi_world = hc.world()
    fake = FakeWorld()
    token = hc.set_world(fake)  # type: ignore[arg-type]
    try:
        assert hc.world() is fake
        assert hc.wtime() == 10.0
        assert isinstance(hc.Status(), FakeStatus)
    finally:
        hc.reset_world(token)
    assert hc.world() is mpi_world
    assert not isinstance(hc.Status(), FakeStatus)


def test_use_world_nests_and_restores() -> None:
    outer, inner = FakeWorld(clock=1.0), FakeWorld(clock=2.0)
    with hc.use_world(outer) as w1:  # type: ignore[arg-type]
        assert w1 is outer and hc.wtime() == 1.0
        with hc.use_world(inner):  # type: ignore[arg-type]
            assert hc.world() is inner and hc.wtime() == 2.0
        assert hc.world() is outer
    assert not isinstance(hc.world(), FakeWorld)


def test_world_is_per_context() -> None:
    """Each context (as each simulator greenlet) has its own world."""
    fakes = [FakeWorld(rank=r) for r in range(3)]

    def in_context(fake: FakeWorld) -> int:
        hc.set_world(fake)  # type: ignore[arg-type]
        return hc.world().Get_rank()

    ranks = [contextvars.copy_context().run(in_context, f) for f in fakes]
    assert ranks == [0, 1, 2]
    assert not isinstance(hc.world(), FakeWorld)  # this context untouched


def test_wtime_is_monotonic() -> None:
    times = [hc.wtime() for _ in range(1000)]
    assert all(b >= a for a, b in zip(times, times[1:], strict=False))
    assert times[-1] > 0


def test_subcomm_uses_the_communicators_hook_and_validates() -> None:
    fake = FakeWorld(rank=2, size=4)
    assert hc.subcomm(fake, [3, 2]) == "sub[3, 2]"  # type: ignore[arg-type]
    assert fake.subcomms == [[3, 2]]
    for bad, msg in (([], "distinct"), ([2, 2], "distinct"), ([2, 4], "outside"), ([0, 1], "members")):
        with pytest.raises(ValueError, match=msg):
            hc.subcomm(fake, bad)  # type: ignore[arg-type]


# -- waitall / waitany with non-MPI requests ----------------------------------------------


class FakeRequest:
    """Completes after ``polls`` calls of Test(); falsy once completed (like REQUEST_NULL)."""

    def __init__(self, polls: int, log: list[int], name: int) -> None:
        self.polls, self.log, self.name, self.done = polls, log, name, False

    def Test(self, status: object = None) -> bool:
        if not self.done:
            self.polls -= 1
            if self.polls <= 0:
                self.done = True
                self.log.append(self.name)
        return self.done

    def Wait(self, status: object = None) -> bool:
        while not self.Test(status):
            pass
        return True

    def __bool__(self) -> bool:
        return not self.done


def test_waitall_polls_own_requests() -> None:
    log: list[int] = []
    reqs = [FakeRequest(p, log, i) for i, p in enumerate([5, 1, 3])]
    hc.waitall([*reqs, None])
    assert sorted(log) == [0, 1, 2] and all(r.done for r in reqs)
    hc.waitall(reqs)  # all inactive now: returns at once


def test_waitany_returns_first_completed_and_skips_inactive() -> None:
    log: list[int] = []
    reqs: list[FakeRequest | None] = [FakeRequest(p, log, i) for i, p in enumerate([4, 2, 3])]
    order = []
    while (i := hc.waitany(reqs)) is not None:
        order.append(i)
    assert order == [1, 0, 2]  # polled in turn: 4,2,3 polls left
    assert hc.waitany([None, None]) is None


def test_waitall_mixes_mpi_and_own_requests(comm: hc.Communicator) -> None:
    me = comm.Get_rank()
    send, recv = np.arange(3.0), np.zeros(3)
    mpi_reqs = [comm.Irecv(recv, source=me, tag=77), comm.Isend(send, dest=me, tag=77)]
    hc.waitall([*mpi_reqs, FakeRequest(2, [], 0)])
    assert np.array_equal(recv, send)


# -- abort_on_exception -----------------------------------------------------------------------


def _raise() -> None:
    raise RuntimeError("boom on purpose")


def _exception() -> RuntimeError:
    try:
        _raise()
    except RuntimeError as exc:
        return exc
    raise AssertionError("unreachable")


def test_abort_on_exception_world_of_one_prints_and_returns() -> None:
    out = io.StringIO()
    fake = FakeWorld(rank=0, size=1)
    hc.abort_on_exception(_exception(), comm=fake, file=out)  # type: ignore[arg-type]
    text = out.getvalue()
    assert text.startswith("[rank 0] Traceback (most recent call last):")
    assert all(line.startswith("[rank 0] ") for line in text.splitlines())
    assert "RuntimeError: boom on purpose" in text and "_raise" in text
    assert fake.aborted is None


def test_abort_on_exception_aborts_when_other_ranks_exist() -> None:
    out = io.StringIO()
    fake = FakeWorld(rank=3, size=4)
    with hc.use_world(fake):  # type: ignore[arg-type]
        hc.abort_on_exception(_exception(), file=out)
    assert out.getvalue().startswith("[rank 3] Traceback")
    assert fake.aborted == 1


def _env_without_pmi() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "MPIR_", "HYDRA_"))}
    env.update(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    return env


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec")
@world_of_one
def test_abort_on_exception_ends_the_mpiexec_job() -> None:
    """Rank 1 fails while rank 0 waits in a Barrier: the job ends promptly, non-zero."""
    code = (
        "import hpcdl.comm as hc\n"
        "comm = hc.world()\n"
        "try:\n"
        "    if comm.Get_rank() == 1:\n"
        "        raise ValueError('rank one fails')\n"
        "    comm.Barrier()\n"
        "except Exception as exc:\n"
        "    hc.abort_on_exception(exc)\n"
    )
    proc = subprocess.run(
        [shutil.which("mpiexec"), "-n", "2", sys.executable, "-c", code],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env=_env_without_pmi(),
    )
    assert proc.returncode != 0
    assert "[rank 1] Traceback (most recent call last):" in proc.stderr
    assert "[rank 1] ValueError: rank one fails" in proc.stderr
