"""The stall watchdog under mpiexec: the contract holds on a watched world, and a stall is reported.

Run with ``tests/run_mpi.sh N tests/comm`` (N = 2 and 3 in ``make test``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import pytest

import hpcdl.comm as hc
from hpcdl.comm import Communicator, StallError, WatchedComm, long_wait, notes, watch

from .conformance import CHECKS
from .test_mpi_conformance import run_everywhere

pytestmark = pytest.mark.mpi(min_size=2)


@pytest.mark.parametrize("check", CHECKS, ids=[c.__name__ for c in CHECKS])
def test_conformance_on_a_watched_world(check: Callable[[Communicator], None], comm: Communicator) -> None:
    """Every conformance body passes on the watched world (waitall/waitany through its hooks)."""
    with watch(60.0) as watched:
        assert isinstance(watched, WatchedComm) and hc.world() is watched
        run_everywhere(check, watched)
    assert hc.world() is comm  # back to MPI's own world


def test_every_nonblocking_call_of_a_watched_world_gives_a_watched_request(comm: Communicator) -> None:
    """``Isend``/``Irecv``/``Iallreduce`` and the collectives reached through MPI's own names
    (``Ibarrier``, ``Ibcast``): each request's ``Wait()`` is the watchdog's."""
    from hpcdl.comm.mpi import WatchedRequest

    with watch(60.0) as world:
        rank, size = world.Get_rank(), world.Get_size()
        out, got, total = np.full(1, float(rank)), np.zeros(1), np.zeros(1)
        left, right = (rank - 1) % size, (rank + 1) % size
        reqs = [world.Irecv(got, source=left, tag=3), world.Isend(out, dest=right, tag=3),
                world.Iallreduce(out, total), world.Ibarrier(), world.Ibcast(got[:0], root=0)]  # fmt: skip
        assert all(isinstance(r, WatchedRequest) for r in reqs), [type(r) for r in reqs]
        for r in reqs:
            r.Wait()
        assert got[0] == (rank - 1) % size and total[0] == size * (size - 1) / 2
        late = world.Irecv(got, source=(rank - 1) % size, tag=4)
        world.Send(out, dest=(rank + 1) % size, tag=4)
    late.Wait()  # after the watch block (its watchdog freed): MPI's own wait
    assert got[0] == (rank - 1) % size


def test_watch_is_off_at_zero_and_inside_a_watched_world(comm: Communicator) -> None:
    with watch(0.0) as world:
        assert world is comm
    with watch(60.0) as outer, watch(5.0) as inner:
        assert inner is outer


def _late_sender(
    comm: Communicator, *, patient: bool, limit_s: float | None = None, request: bool = False
) -> tuple[StallError | None, np.ndarray]:
    """Rank 0 sleeps 2.5 s (outside any wait), then sends each rank its number; the others
    wait in ``Recv`` with ``stall_s = 1`` (inside ``long_wait(limit_s=...)`` when ``patient``;
    in mpi4py's ``Irecv(...).Wait()`` when ``request``)."""
    got = np.full(1, -1.0)
    error: StallError | None = None
    with watch(1.0, grace_s=0.5) as world:
        note = notes()
        note["step"], note["phase"] = 7, "late sender test"
        if world.Get_rank() == 0:
            time.sleep(2.5)
            for r in range(1, world.Get_size()):
                world.Send(np.full(1, float(r)), dest=r, tag=5)
            got[0] = 0.0
        else:
            try:
                with long_wait("a test's planned wait", limit_s) if patient else _nothing():
                    if request:
                        world.Irecv(got, source=0, tag=5).Wait()
                    else:
                        world.Recv(got, source=0, tag=5)
            except StallError as err:
                error = err
                hc.waitall(err.requests)  # the receive is still posted: complete it
        world.Barrier()
    return error, got


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


@pytest.mark.parametrize("request_wait", [False, True], ids=["Recv", "Irecv-Wait"])
def test_a_rank_outside_any_wait_is_named(comm: Communicator, request_wait: bool) -> None:
    """A blocking ``Recv`` and a request's own ``Wait()`` (mpi4py's idiom) are watched alike."""
    error, got = _late_sender(comm, patient=False, request=request_wait)
    assert got[0] == comm.Get_rank()  # the message arrived in the end, on every rank
    reports = comm.allgather(str(error) if error is not None else None)
    raised = [r for r, text in enumerate(reports) if text is not None]
    assert len(raised) == 1 and raised[0] != 0, reports  # one report, by a waiting rank
    text = reports[raised[0]]
    assert text.startswith("stall: rank 0 did not respond"), text
    what = "wait (step 7, phase late sender test): Irecv from" if request_wait else "Recv from"
    assert f"rank {raised[0]} waits" in text and f"{what} rank 0 tag 5 on world" in text, text
    assert "step 7" in text and "phase late sender test" in text, text
    assert all(f"rank {r} waits" in text for r in range(1, comm.Get_size())), text
    # rank 0 never read the questions sent to it: the watchdog drained them when it was freed,
    # or the next communicator, given the freed one's context by MPI, would receive them
    fresh = comm.Dup()
    comm.Barrier()
    time.sleep(0.2)
    assert not fresh.Iprobe(hc.ANY_SOURCE, hc.ANY_TAG)
    fresh.Free()


def test_a_long_wait_by_design_does_not_stall(comm: Communicator) -> None:
    error, got = _late_sender(comm, patient=True)
    assert error is None and got[0] == comm.Get_rank()


def test_a_long_wait_with_a_limit_stalls_after_it(comm: Communicator) -> None:
    error, got = _late_sender(comm, patient=True, limit_s=1.5)
    assert got[0] == comm.Get_rank()
    reports = [t for t in comm.allgather(str(error) if error is not None else None) if t is not None]
    assert len(reports) == 1 and reports[0].startswith("stall: rank 0 did not respond"), reports
    assert "(by design: a test's planned wait)" in reports[0], reports


def test_split_with_undefined_gives_comm_null(comm: Communicator) -> None:
    from mpi4py import MPI

    with watch(60.0) as world:
        rank = world.Get_rank()
        sub = world.Split(MPI.UNDEFINED if rank == 0 else 1, rank)
        if rank == 0:
            assert sub == MPI.COMM_NULL
        else:
            assert isinstance(sub, WatchedComm) and sub.Get_size() == world.Get_size() - 1
            sub.Barrier()
            sub.Free()


def test_a_watched_sub_communicator_of_some_ranks(comm: Communicator) -> None:
    with watch(60.0) as world:
        members = [0, world.Get_size() - 1]
        if world.Get_rank() in members:
            sub = hc.subcomm(world, members)
            assert isinstance(sub, WatchedComm) and sub.Get_size() == 2
            assert sub.allgather(world.Get_rank()) == members
            sub.Free()
        world.Barrier()


def test_a_late_request_stalls_a_waitany_while_others_complete(comm: Communicator) -> None:
    """Rank 0 serves messages to itself in a ``waitany`` loop beside a receive due since the
    start that rank 1 (asleep, outside any wait) sends 2.5 s late: the waits are short, the
    receive is waited for since it became due (``hpcdl.comm.due``), so it stalls all the same
    and names rank 1 (a parameter server whose other workers keep pushing)."""
    error: StallError | None = None
    served = 0
    with watch(1.0, grace_s=0.5) as world:
        rank, one = world.Get_rank(), np.ones(1)
        if rank == 0:
            late, mine = np.zeros(1), np.zeros(1)
            req = world.Irecv(late, source=1, tag=3)
            hc.due(req, hc.wtime())
            t0 = hc.wtime()
            try:
                while hc.wtime() - t0 < 10.0:
                    recv, send = world.Irecv(mine, source=0, tag=4), world.Isend(one, dest=0, tag=4)
                    assert hc.waitany([req, recv]) == 1  # the late one never completes first here
                    send.Wait()
                    served += 1
            except StallError as err:
                error = err
                with long_wait("the test drains its requests"):  # the late receive, the last pair
                    hc.waitall([req, recv, send])
            assert late[0] == 1.0
        elif rank == 1:
            time.sleep(2.5)
            world.Send(one, dest=0, tag=3)
        with long_wait("the test's end"):
            world.Barrier()
    if comm.Get_rank() == 0:
        assert error is not None and served > 10, (error, served)
        text = str(error)
        assert text.startswith("stall: rank 1 did not respond"), text
        assert "rank 0 waits" in text and "Irecv from rank 1 tag 3 on world" in text, text
        assert all(f"rank {r} waits" in text for r in range(2, comm.Get_size())), text


def test_a_report_is_handed_to_rank_0(comm: Communicator, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 stalls while rank 0 waits by design and answers: rank 1 hands its report to
    rank 0, which raises it from its wait (and so records it in the run file); rank 1 raises
    it too once :data:`FALLBACK_S` has passed and the job is still alive."""
    from hpcdl.comm import watchdog

    monkeypatch.setattr(watchdog, "FALLBACK_S", 1.5)
    error: StallError | None = None
    with watch(1.0, grace_s=0.5) as world:
        rank, buf = world.Get_rank(), np.zeros(1)
        if rank in (0, 1):
            other = 1 - rank
            recv = world.Irecv(buf, source=other, tag=9)
            try:
                with long_wait("waiting for rank 1 by design") if rank == 0 else _nothing():
                    recv.Wait()
            except StallError as err:
                error = err
            with long_wait("the test drains its requests"):
                world.Send(np.ones(1), dest=other, tag=9)
                recv.Wait()
        with long_wait("the test's end"):
            world.Barrier()
    if rank in (0, 1):
        assert error is not None
        text = str(error)
        assert text.startswith("stall: "), text
        assert "rank 0 waits" in text and "(by design: waiting for rank 1 by design)" in text, text
        assert "rank 1 waits" in text and "Irecv from rank 0 tag 9 on world" in text, text
    texts = comm.allgather(str(error) if error is not None else None)
    assert texts[0] == texts[1]  # rank 0 raised rank 1's report


def test_a_request_due_long_ago_that_has_come_is_no_stall(
    comm: Communicator, capfd: pytest.CaptureFixture[str]
) -> None:
    """A receive due for longer than ``stall_s`` whose message is there completes at once: no
    question to the other ranks, no warning of a long wait (it is tested before anything else)."""
    with watch(1.0, grace_s=0.5) as world:
        rank, buf = world.Get_rank(), np.zeros(1)
        if rank == 0:
            req = world.Irecv(buf, source=1, tag=6)
            hc.due(req, hc.wtime() - 5.0)
        elif rank == 1:
            world.Send(np.ones(1), dest=0, tag=6)
        world.Barrier()
        if rank == 0:
            time.sleep(0.2)  # the message is surely there
            assert hc.waitany([req]) == 0 and buf[0] == 1.0
        world.Barrier()
    assert "longer than debug.stall_s" not in capfd.readouterr().err


def test_node_memory_and_shm_on_a_watched_world(comm: Communicator) -> None:
    """Node memory through a watched world (its ``node_segments``: watched barriers around MPI's
    blocking window calls) and the allreduce ``shm`` on it equal MPI's."""
    from .test_collectives import check_shm_equals_mpi, check_shm_in_flight_with_others

    with watch(60.0) as watched:
        for check in (check_shm_equals_mpi, check_shm_in_flight_with_others):
            run_everywhere(check, watched)
