"""A worker's reductions through a switch, over a link, one after another, with a deadline.

:class:`SwitchClient` drives a :class:`~hpcdl.switch.worker.WorkerState` over a
:class:`~hpcdl.switch.transport.Link`: it sends what the state machine asks, feeds it what
arrives, retransmits on its timeouts, and takes queued reductions in turn (the exchange's
buckets: an exponent round, then the quantised data). :meth:`progress` does what can be done
now without blocking, or blocks until the next datagram or timeout; a reduction is an
:class:`Reduction` the caller tests or waits on, like a nonblocking collective's request.

If no result arrives for ``give_up`` seconds while chunks are outstanding (the switch was
killed, or never listened), :class:`SwitchUnreachable` names the switch's address and what is
outstanding: a worker fails, it never hangs.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import numpy as np

from hpcdl.switch.transport import Link
from hpcdl.switch.worker import EXPONENT_CHUNK, WorkerState

__all__ = ["Reduction", "SwitchClient", "SwitchUnreachable"]


class SwitchUnreachable(RuntimeError):
    """No result came from the switch for ``switch.timeout_s`` seconds while chunks were outstanding."""


class Reduction:
    """One reduction queued on a :class:`SwitchClient`: an exponent round or an int32 vector.

    Behaves like a nonblocking collective's request (:func:`hpcdl.comm.waitall` takes it):
    ``Test()`` makes progress and says whether it is done, ``Wait()`` blocks until it is; it is
    truthy (active) until one of them has reported completion.

    Attributes:
        exponent: an exponent round: this worker's exponent; the maximum when done.
        values: a data reduction: the int32 vector; the sum when done (written in place).
        name: what it is, for messages (``bucket 2``).
        then: called with the reduction when it is done, returns an int32 vector to reduce
            next, before anything queued after it (so every worker reduces in the same order).
        next: the reduction ``then`` started.
    """

    __slots__ = ("_active", "client", "done", "exponent", "name", "next", "then", "values")

    def __init__(self, client: SwitchClient, name: str, exponent: int | None = None,
                 values: np.ndarray | None = None,
                 then: Callable[[Reduction], np.ndarray] | None = None) -> None:  # fmt: skip
        self.client, self.name = client, name
        self.exponent, self.values = exponent, values
        self.then = then
        self.next: Reduction | None = None
        self.done = False
        self._active = True

    def __bool__(self) -> bool:
        return self._active

    @property
    def finished(self) -> bool:
        """The reduction has completed (whether or not a Test/Wait reported it)."""
        return self.done

    def Test(self, status: object = None) -> bool:  # noqa: N802 - an mpi4py request's name
        """Progress without blocking; True (once, then inactive) when the reduction is done."""
        if not self.done:
            self.client.progress(block=False)
        if self.done:
            self._active = False
        return self.done

    def Wait(self, status: object = None) -> None:  # noqa: N802
        """Progress, blocking, until the reduction is done.

        Raises:
            SwitchUnreachable: the switch stopped answering.
        """
        while not self.done:
            self.client.progress(block=True)
        self._active = False


class SwitchClient:
    """A worker's queue of reductions through the switch at ``address`` over ``link``.

    Args:
        state: the worker's protocol state.
        link: its link to the switch.
        clock: seconds (``hpcdl.comm.wtime``), the same clock for every call.
        give_up: seconds without any result, with chunks outstanding, after which the switch is
            declared unreachable (``switch.timeout_s``).
        address: the switch's address, for messages.
    """

    def __init__(self, state: WorkerState, link: Link, clock: Callable[[], float], give_up: float,
                 address: str) -> None:  # fmt: skip
        if give_up <= 0:
            raise ValueError(f"give_up must be positive (got {give_up} s)")
        self.state, self.link, self.clock = state, link, clock
        self.give_up, self.address = give_up, address
        self.queue: deque[Reduction] = deque()
        self.current: Reduction | None = None
        self.datagrams_sent = 0
        self.bytes_sent = 0
        #: the link loses nothing (``link.reliable``, MPI without injected faults): no retransmissions
        self.reliable = bool(getattr(link, "reliable", False))
        self._heard = 0.0  # when the last result for the current reduction arrived (or it began)

    def exponent(self, exponent: int, name: str = "",
                 then: Callable[[Reduction], np.ndarray] | None = None) -> Reduction:  # fmt: skip
        """Queue an exponent round: the maximum over the workers of ``exponent`` (an i16).

        ``then(done_round)``, if given, returns the int32 vector reduced right after it.
        """
        return self._queue(Reduction(self, name, exponent=exponent, then=then))

    def reduce(self, values: np.ndarray, name: str = "") -> Reduction:
        """Queue the int32 sum of ``values`` over the workers (written back into ``values``)."""
        _check_vector(values)
        return self._queue(Reduction(self, name, values=values))

    def _queue(self, r: Reduction) -> Reduction:
        self.queue.append(r)
        self.progress(block=False)
        return r

    def _send(self, datagrams: list[bytes]) -> None:
        for data in datagrams:
            self.link.send(data)
            self.bytes_sent += len(data)
        self.datagrams_sent += len(datagrams)

    def _begin_next(self, now: float) -> None:
        """Start queued reductions until one is in flight (an empty vector finishes at once)."""
        while self.current is None and self.queue:
            r = self.queue.popleft()
            self.current, self._heard = r, now
            self._start(r, now)
            self._finish_if_done()

    def _start(self, r: Reduction, now: float) -> None:
        """Begin ``r`` in the state machine and send its first datagrams (a subclass that owns
        its socket I/O, :class:`~hpcdl.switch.udp.UdpSwitchClient`, hands it to its loop)."""
        if r.exponent is not None:
            self._send(self.state.start_exponent(r.exponent, now))
        else:
            assert r.values is not None
            self._send(self.state.start_quantised(r.values, now))

    def _finish_if_done(self) -> None:
        r = self.current
        if r is None or not self.state.done:
            return
        if r.exponent is not None:
            r.exponent = int(self.state.max_exponent)
        else:
            assert r.values is not None
            if r.values is not self.state.result:  # a loop that sums in place already wrote it
                r.values[...] = self.state.result
        r.done = True
        self.current = None
        if r.then is not None:  # its follow-up goes first, on every worker alike
            values = r.then(r)
            _check_vector(values)
            r.next = Reduction(self, r.name, values=values)
            self.queue.appendleft(r.next)

    def progress(self, block: bool) -> None:
        """Send, receive and retransmit what is due; with ``block``, wait for the next event first.

        Raises:
            SwitchUnreachable: ``give_up`` seconds passed without a result while chunks were
                outstanding.
        """
        now = self.clock()
        self._begin_next(now)
        if self.current is None:
            return
        wait = 0.0
        if block:
            due = self._heard + self.give_up
            if not self.reliable:
                due = min(due, self.state.next_deadline())
            wait = max(0.0, due - now)
        arrived = self.link.poll(wait)
        now = self.clock()
        before = self.state.results
        for data in arrived:
            self._send(self.state.receive(data, now))
            self._finish_if_done()
            self._begin_next(now)
        if self.state.results != before:
            self._heard = now
        if self.current is None:
            return
        if not self.reliable:
            self._send(self.state.tick(now))
        if now - self._heard >= self.give_up:
            raise SwitchUnreachable(self._unreachable())

    def _unreachable(self) -> str:
        flying, unsent = self.state.outstanding()
        r = self.current
        assert r is not None
        what = "the exponent round" if flying == [EXPONENT_CHUNK] else f"chunks {_span(flying)} in flight"
        more = f" and {unsent} not sent" if unsent else ""
        n = len(self.queue)
        queued = f", {n} more reduction{'s' * (n != 1)} queued" if n else ""
        name = f" of {r.name}" if r.name else ""
        return (
            f"the switch at {self.address} sent no result for {self.give_up:g} s (switch.timeout_s): "
            f"{what}{more}{name}{queued}; is it running, for this job and {self.state.workers} workers, "
            f"with at least {self.state.window} slots?"
        )

    def close(self) -> None:
        """Close the link."""
        self.link.close()


def _check_vector(values: np.ndarray) -> None:
    if values.dtype != np.int32 or values.ndim != 1 or not values.flags.c_contiguous:
        raise ValueError("the switch sums contiguous 1-D int32 vectors")


def _span(chunks: list[int]) -> str:
    if not chunks:
        return "none"
    if len(chunks) > 2 and chunks == list(range(chunks[0], chunks[-1] + 1)):
        return f"{chunks[0]}-{chunks[-1]}"
    shown = ", ".join(map(str, chunks[:6]))
    return shown + (f", ... ({len(chunks)})" if len(chunks) > 6 else "")
