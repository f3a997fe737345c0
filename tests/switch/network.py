"""An in-memory network for the switch tests: a deterministic event loop, no threads, no sockets.

Every datagram, in both directions (a multicast copy to each worker separately), is lost with
probability ``loss``, duplicated with probability ``duplicate``, and delivered after
``latency * (1 + jitter * U)`` (U uniform in [0, 1): reordering), plus ``late_delay`` with
probability ``late`` (a datagram that arrives long after its slot moved on). All draws come
from one seeded ``numpy.random.Generator``, and events at equal times are taken in the order
they were sent, so a run is a pure function of its seed.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import numpy as np

from hpcdl.switch import MULTICAST, SwitchState, WorkerState

SWITCH = -1  # the switch's address in the event queue (workers are 0 .. W-1)


@dataclass
class Network:
    """A switch, W workers and the datagrams between them."""

    switch: SwitchState
    workers: list[WorkerState]
    rng: np.random.Generator
    loss: float = 0.0
    duplicate: float = 0.0
    jitter: float = 0.0
    late: float = 0.0
    late_delay: float = 0.0
    latency: float = 1e-5
    now: float = 0.0
    sent: int = 0
    lost: int = 0
    duplicated: int = 0
    queue: list = field(default_factory=list)

    def send(self, dest: int, data: bytes) -> None:
        """Put ``data`` on the wire to ``dest`` (SWITCH or a worker), through the loss model."""
        self.sent += 1
        if self.rng.random() < self.loss:
            self.lost += 1
            return
        copies = 1
        if self.rng.random() < self.duplicate:
            copies, self.duplicated = 2, self.duplicated + 1
        for _ in range(copies):
            delay = self.latency * (1.0 + self.jitter * self.rng.random())
            if self.rng.random() < self.late:
                delay += self.late_delay
            heapq.heappush(self.queue, (self.now + delay, self.sent, len(self.queue), dest, data))

    def deliver(self, dest: int, data: bytes) -> None:
        """Hand ``data`` to ``dest`` and send what it answers."""
        if dest == SWITCH:
            for out in self.switch.receive(data):
                targets = range(len(self.workers)) if out.dest == MULTICAST else [out.dest]
                for w in targets:
                    self.send(w, out.data)
        else:
            for out in self.workers[dest].receive(data, self.now):
                self.send(SWITCH, out)

    def reduce(self, vectors: list[np.ndarray], quantised: bool, limit: float = 60.0) -> None:
        """Run one reduction of ``vectors`` (one per worker) until every worker has its result.

        Datagrams still on the wire when the last worker finishes stay queued, and reach the
        next reduction late, as they would on a real network.

        Raises:
            AssertionError: the reduction has not finished ``limit`` seconds (virtual) later.
        """
        for worker, vector in zip(self.workers, vectors):
            start = worker.start_quantised if quantised else worker.start
            for data in start(vector, self.now):
                self.send(SWITCH, data)
        deadline = self.now + limit
        while not all(worker.done for worker in self.workers):
            assert self.now < deadline, f"no result after {limit} s: {self.switch.counters()}"
            arrival = self.queue[0][0] if self.queue else math.inf
            timer = min(worker.next_deadline() for worker in self.workers)
            if arrival <= timer:
                self.now, _, _, dest, data = heapq.heappop(self.queue)
                self.deliver(dest, data)
            else:
                self.now = timer
                for worker in self.workers:
                    for data in worker.tick(self.now):
                        self.send(SWITCH, data)

    def drain(self) -> None:
        """Deliver everything still on the wire (late duplicates, the last results' copies)."""
        while self.queue:
            self.now, _, _, dest, data = heapq.heappop(self.queue)
            self.deliver(dest, data)


def make(workers: int, slots: int, payload: int, seed: int, timeout: float = 1e-3,
         window: int | None = None, job: int = 7, **faults: float) -> Network:  # fmt: skip
    """A switch and ``workers`` workers of job ``job`` on a :class:`Network` with ``faults``."""
    switch = SwitchState(workers, slots, payload, job)
    members = [WorkerState(job, w, workers, slots, payload, timeout, window) for w in range(workers)]
    return Network(switch, members, np.random.default_rng(seed), **faults)
