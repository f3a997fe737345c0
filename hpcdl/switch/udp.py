"""A worker's reductions through a UDP switch with the datagram loop in C (:class:`UdpSwitchClient`).

:class:`~hpcdl.switch.client.SwitchClient` drives the Python
:class:`~hpcdl.switch.worker.WorkerState` over any link, tens of microseconds of Python per
datagram; this client hands a connected UDP socket to the compiled
:class:`~hpcdl._ext.workerloop.WorkerLoop` (the same state machine, byte for byte), which sends,
receives, retransmits and injects the seeded faults without the GIL. What stays in Python is
per reduction: the queue, the ``then`` chaining of an exponent round to its data round, and
giving up after ``give_up`` seconds without a result (:class:`SwitchUnreachable`, naming the
address and the chunks outstanding). The rank form (a switch rank over MPI, also run in the
simulator) keeps the Python state machine.
"""

from __future__ import annotations

from collections.abc import Callable

from hpcdl._ext.workerloop import WorkerLoop
from hpcdl.comm import wtime
from hpcdl.switch.client import Reduction, SwitchClient, SwitchUnreachable
from hpcdl.switch.transport import UdpLink, parse_address

__all__ = ["UdpSwitchClient"]


class UdpSwitchClient(SwitchClient):
    """A worker's queue of reductions through the UDP switch at ``address``, in C per datagram.

    Args:
        address: the switch's ``HOST:PORT``.
        job, worker, workers, slots, payload: as :class:`~hpcdl.switch.worker.WorkerState`'s.
        timeout: seconds after which a chunk without result is sent again (backed off).
        give_up: seconds without any result, chunks outstanding, after which the switch is
            declared unreachable (``switch.timeout_s``).
        window: chunks in flight (default: all the slots).
        loss, duplicate, reorder: injected fault rates, each direction, in the loop.
        seed: this worker's fault stream (u64).
        fast: early retransmission (``WorkerState``'s ``fast``; 0: off).
        clock: seconds, for ``give_up`` (the loop times its retransmissions on its own clock).

    Raises:
        ValueError: a malformed address or an argument out of range.
        OSError: the socket could not be made or connected.
    """

    def __init__(self, address: str, job: int, worker: int, workers: int, slots: int, payload: int,
                 timeout: float, give_up: float, window: int | None = None, *, loss: float = 0.0,
                 duplicate: float = 0.0, reorder: float = 0.0, seed: int = 0, fast: int = 0,
                 clock: Callable[[], float] = wtime) -> None:  # fmt: skip
        loop = WorkerLoop(job, worker, workers, slots, payload, timeout, window, loss=loss,
                          duplicate=duplicate, reorder=reorder, seed=seed, fast=fast)  # fmt: skip
        link = UdpLink(parse_address(address))
        loop.attach(link.sock.fileno())
        super().__init__(loop, link, clock, give_up, address)  # type: ignore[arg-type]
        self.loop = loop

    @property
    def injected(self) -> dict[str, int]:
        """The faults the loop injected, by ``FaultyLink``'s names."""
        return self.loop.injected

    def _start(self, r: Reduction, now: float) -> None:
        """Begin ``r`` in the loop, which sends its first datagrams at once (data summed in place)."""
        if r.exponent is not None:
            self.loop.queue_exponent(r.exponent)
        else:
            assert r.values is not None
            self.loop.queue_quantised(r.values)
        self._count()

    def _count(self) -> None:
        self.datagrams_sent = self.loop.datagrams_sent
        self.bytes_sent = self.loop.bytes_sent

    def progress(self, block: bool) -> None:
        """Run the loop: without ``block``, take what has arrived and return; with it, until the
        reduction is done or the loop's slice ends (at most 50 ms, so signals are seen).

        Raises:
            SwitchUnreachable: ``give_up`` seconds passed without a result while chunks were
                outstanding.
        """
        now = self.clock()
        self._begin_next(now)
        if self.current is None:
            return
        wait = max(0.0, self._heard + self.give_up - now) if block else 0.0
        before = self.loop.results
        self.loop.progress(wait)
        now = self.clock()
        if self.loop.results != before:
            self._heard = now
        self._count()
        self._finish_if_done()
        self._begin_next(now)
        if self.current is not None and now - self._heard >= self.give_up:
            raise SwitchUnreachable(self._unreachable())

    def close(self) -> None:
        """Detach the loop and close the socket."""
        self.loop.attach(-1)
        self.link.close()
