"""Resumable schedules of point-to-point rounds, and the request that advances one.

A collective is written once, as a generator: it posts the ``Isend``/``Irecv`` of a round,
yields the list of requests the round waits for, and when resumed (all of them complete)
does its local work (a reduction, a copy) and goes on to the next round. :class:`CollRequest`
drives it: ``Test()`` advances it as far as it can without blocking, ``Wait()`` finishes it.
The blocking collective is ``CollRequest(schedule).Wait()``. There are no threads: progress
happens only inside ``Test()``/``Wait()``, which a greenlet of the simulator runs as well.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from typing import Any

from hpcdl.comm.context import _world_hook, waiter
from hpcdl.comm.contract import Request

__all__ = ["CollRequest", "Schedule", "sendrecv"]

#: A collective's schedule: yields the requests of each round, returns when done.
Schedule = Generator[Sequence[Request], None, None]


def sendrecv(comm: Any, sendbuf: Any, dest: int, recvbuf: Any, source: int, tag: int) -> list[Request]:
    """Post one exchange of a round: receive from ``source`` into ``recvbuf``, send ``sendbuf``.

    Returns:
        The two requests, for the schedule to yield.
    """
    return [comm.Irecv(recvbuf, source, tag), comm.Isend(sendbuf, dest, tag)]  # positional: parsed faster


class CollRequest:
    """A nonblocking collective in flight: a schedule and the requests of its current round.

    Behaves like an mpi4py request for :func:`hpcdl.comm.waitall`/:func:`~hpcdl.comm.waitany`:
    ``Test()`` makes progress and says whether it is done, ``Wait()`` blocks until done.
    Creating it posts the first round (and may run the whole schedule, e.g. on one rank).
    Like an mpi4py request, it stays active (truthy) until a ``Test()`` returning True or a
    ``Wait()`` has reported its completion; then it is falsy (inactive), and those functions
    skip it as they skip ``MPI.REQUEST_NULL``. So a ``waitany`` loop sees every request
    complete exactly once. A collective that failed (an error from a request or from the
    schedule) is finished and stays active: every later ``Test``/``Wait`` raises that error.

    Args:
        schedule: the collective's generator (see :data:`Schedule`).
        name: what the collective is, for ``repr`` and error messages.
        on_done: called once when the schedule has run to its end (not after an error).
    """

    __slots__ = ("_active", "_error", "_name", "_on_done", "_pending", "_schedule")

    def __init__(
        self, schedule: Schedule, name: str = "collective", on_done: Callable[[], None] | None = None
    ) -> None:
        self._name = name
        self._schedule: Schedule | None = schedule
        self._pending: Sequence[Request] = ()
        self._on_done = on_done
        self._active = True
        self._error: BaseException | None = None
        self._advance()

    def _advance(self) -> None:
        """Run the schedule to its next round (or to its end)."""
        assert self._schedule is not None
        try:
            self._pending = next(self._schedule)
        except StopIteration:
            self._end()
        except BaseException:
            self._schedule, self._pending = None, ()
            raise

    def _end(self) -> None:
        """The schedule ran to its end."""
        self._schedule, self._pending = None, ()
        if self._on_done is not None:
            self._on_done()

    def _fail(self, exc: BaseException) -> None:
        """The collective failed with ``exc``: no more progress; later calls raise it again."""
        schedule, self._schedule, self._pending, self._error = self._schedule, None, (), exc
        if schedule is not None:
            schedule.close()

    def Test(self, status: Any = None) -> bool:  # noqa: N802  (mpi4py's name)
        """Advance the schedule without blocking.

        Tests the current round's requests; when all are complete, runs the schedule's
        next step and tests again, until a round is still pending or the schedule ended.

        Args:
            status: accepted for compatibility with mpi4py's ``Test``; not filled.

        Returns:
            True when the collective has completed.
        """
        if self._error is not None:
            raise self._error
        try:
            while self._schedule is not None:
                self._pending = [r for r in self._pending if not r.Test()]
                if self._pending:
                    return False
                self._advance()
        except BaseException as exc:
            self._fail(exc)
            raise
        self._active = False
        return True

    def Wait(self, status: Any = None) -> None:  # noqa: N802  (mpi4py's name)
        """Block until the collective has completed (each round: wait, then advance).

        Args:
            status: accepted for compatibility with mpi4py's ``Wait``; not filled.
        """
        if self._error is not None:
            raise self._error
        if self._schedule is not None:
            drive = _world_hook("run_rounds")  # a simulated world runs the rounds in C
            try:
                if drive is not None:
                    drive(self._schedule, self._pending)
                    self._end()
                else:
                    wait = waiter()  # the world's waitall, looked up once for all the rounds
                    while self._schedule is not None:
                        wait(self._pending)
                        self._advance()
            except BaseException as exc:
                self._fail(exc)
                raise
        self._active = False

    @property
    def name(self) -> str:
        """What the collective is (``allreduce[ring]``, ...)."""
        return self._name

    @property
    def round_requests(self) -> tuple[Request, ...]:
        """The requests the current round waits for (empty when finished): for stall reports."""
        return tuple(self._pending)

    @property
    def finished(self) -> bool:
        """True when the schedule has run to its end (reported by ``Test``/``Wait`` or not)."""
        return self._schedule is None

    def __bool__(self) -> bool:
        """True until ``Test``/``Wait`` has reported completion (then inactive, like mpi4py's)."""
        return self._active

    def __repr__(self) -> str:
        if self._error is not None:
            state = f"failed: {type(self._error).__name__}: {self._error}"
        elif self._schedule is not None:
            state = f"{len(self._pending)} requests pending"
        else:
            state = "completed" if self._active else "completed, inactive"
        return f"<CollRequest {self._name}: {state}>"
