"""The switch as an MPI rank: the workers' link over a communicator, and the switch rank's serving loop.

In the ``rank`` form of the switch exchange (``exchange.switch = "rank"``) the last rank of
the job runs the slot logic (:class:`~hpcdl.switch.slots.SwitchState`) and the datagrams are
MPI messages on a communicator of their own: a worker's :class:`CommLink` sends each datagram
to the switch rank and receives the results, and :class:`SwitchRank` receives contributions
from any worker and sends back what the slot logic answers (a multicast is one message per
worker). The same code runs in the simulator, where a network file's ``[switch]`` may make that
rank a switch (a port per worker, a per-packet cost) or its host baseline.

MPI loses nothing, so without injected faults a worker waits for the next result in a blocking
receive; with them (``switch.loss`` and the others, injected by
:class:`~hpcdl.switch.transport.FaultyLink` on the worker's side, both directions), it polls and
sleeps in slices of a quarter of the retransmission timeout so that its timers fire — in the
simulator the sleep moves the rank's virtual clock.

A step ends for the switch rank when every worker has said it is done
(:meth:`CommLink.done`, a message of its own tag sent after the worker's last result): until
then it answers whatever comes, late retransmissions included.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hpcdl import comm as ops  # ops.ANY_SOURCE resolved at use: importing this module starts no MPI
from hpcdl.comm import Communicator, Status, sleep, wtime
from hpcdl.switch.slots import MULTICAST, SwitchState

__all__ = ["DATA_TAG", "DONE_TAG", "CommLink", "SwitchRank"]

DATA_TAG = 1
DONE_TAG = 2
_MAX_DATAGRAM = 2048


class CommLink:
    """A worker's link to the switch rank over ``comm`` (a communicator of the links' own).

    Args:
        comm: the communicator the switch rank serves (every worker's and the switch's rank).
        switch: the switch's rank in ``comm``.
        blocking: wait for results in a blocking receive (no faults are injected: nothing is
            lost); else poll in slices of ``quantum`` seconds.
        quantum: the polling slice when not ``blocking``.
    """

    def __init__(self, comm: Communicator, switch: int, blocking: bool, quantum: float = 2.5e-4) -> None:
        self.comm, self.switch = comm, switch
        self.blocking, self.quantum = blocking, quantum
        #: nothing is lost: the worker need not retransmit (:class:`~hpcdl.switch.client.SwitchClient`)
        self.reliable = blocking
        self._sends: list = []
        self._buf = np.empty(_MAX_DATAGRAM, np.uint8)
        self._status = Status()

    def send(self, data: bytes) -> None:
        self._sends.append(self.comm.Isend(np.frombuffer(data, np.uint8), dest=self.switch, tag=DATA_TAG))
        if len(self._sends) >= 64:
            self._sends = [r for r in self._sends if not r.Test()]

    def _drain(self) -> list[bytes]:
        out = []
        while self.comm.Iprobe(source=self.switch, tag=DATA_TAG, status=self._status):
            out.append(self._receive())
        return out

    def _receive(self) -> bytes:
        self.comm.Recv(self._buf, source=self.switch, tag=DATA_TAG, status=self._status)
        return self._buf[: self._status.Get_count()].tobytes()

    def poll(self, timeout: float) -> list[bytes]:
        out = self._drain()
        if out or timeout <= 0:
            return out
        if self.blocking:  # a result will come: nothing is lost on this link
            return [self._receive(), *self._drain()]
        deadline = wtime() + timeout
        while not out:
            left = deadline - wtime()
            if left <= 0:
                break
            sleep(min(self.quantum, left))
            out = self._drain()
        return out

    def done(self) -> None:
        """Tell the switch rank this worker has every result of the step (collective-free)."""
        self._flush()
        self.comm.Send(np.zeros(0, np.uint8), dest=self.switch, tag=DONE_TAG)

    def _flush(self) -> None:
        for r in self._sends:
            r.Wait()
        self._sends = []

    def close(self) -> None:
        self._flush()


class SwitchRank:
    """The switch rank: serves the workers' datagrams with the slot logic, a step at a time.

    Args:
        comm: the links' communicator.
        state: the slot logic (a :class:`~hpcdl.switch.slots.SwitchState`, or anything with its
            ``receive(data) -> [(dest, data)]``, such as the compiled loop's).
        workers: the workers' ranks in ``comm``, by worker id.

    Attributes:
        busy_s: seconds spent serving (waiting for datagrams included).
    """

    def __init__(self, comm: Communicator, state: SwitchState, workers: Sequence[int]) -> None:
        self.comm, self.state, self.workers = comm, state, list(workers)
        self.busy_s = 0.0
        self._buf = np.empty(_MAX_DATAGRAM, np.uint8)
        self._status = Status()

    def serve_step(self) -> None:
        """Answer datagrams until every worker has said it is done with this step."""
        t0 = wtime()
        done = 0
        sends: list = []
        while done < len(self.workers):
            self.comm.Recv(self._buf, source=ops.ANY_SOURCE, tag=ops.ANY_TAG, status=self._status)
            if self._status.Get_tag() == DONE_TAG:
                done += 1
                continue
            for dest, data in self.state.receive(self._buf[: self._status.Get_count()].tobytes()):
                message = np.frombuffer(data, np.uint8)
                targets = self.workers if dest == MULTICAST else [self.workers[dest]]
                sends.extend(self.comm.Isend(message, dest=t, tag=DATA_TAG) for t in targets)
            if len(sends) >= 256:
                sends = [r for r in sends if not r.Test()]
        for r in sends:
            r.Wait()
        self.busy_s += wtime() - t0
