"""A worker's side of the switch protocol as a pure state machine: no transport, no clock.

This is Algorithm 2 (with the timeouts of §4, "Tolerating packet loss") of SwitchML (Sapio
et al., NSDI'21). The worker uses the slots 0 .. window-1 of the switch; slot i streams
chunks i, i + window, i + 2·window, ... of the vector: a slot's next chunk is sent when the
result of its previous one arrives, so at most ``window`` chunks are in flight and the slot
sets alternate (``use & 1``). A chunk whose result has not come ``timeout`` seconds after it
was sent is sent again, flagged RETRANSMISSION, by :meth:`WorkerState.tick`; each further
retransmission of the same chunk waits twice as long as the one before (at most
``2**MAX_BACKOFF`` times ``timeout``), as TCP backs off its retransmission timer. A fixed
timer is SwitchML's, whose switch runs at line rate; a software switch that falls behind
would otherwise be flooded with retransmissions of every chunk in flight each period, and fall
further behind (congestion collapse: W workers x the window every ``timeout``).

**Early retransmission** (``fast``, TCP's fast retransmit in the protocol's terms): the switch
answers in about the order the chunks were sent, so when the result of a chunk arrives while a
chunk sent ``fast`` or more sends before it is still without its result, that one's datagram
or its result was most likely lost: it is sent again at once, once per chunk, instead of after
its timeout. The order is the order of sending, not of chunk indices: a slot that waited for a
lost result stays behind the others for the rest of the reduction. A timeout waits about two
rounds of the window, so each loss otherwise leaves its slot idle that long; ``fast`` sends of
slack absorb reordering (the switch completes a chunk when the last worker's contribution
arrives). A wrong guess costs one datagram, which the switch counts as a duplicate.

One reduction (:meth:`WorkerState.start`) of a float vector g:

1. the exponent round: one datagram on slot 0 carrying e = ``frexp(max|g|)[1]``
   (``max|g| < 2**e``); the switch returns the maximum E over the workers;
2. k = :func:`~hpcdl.switch.protocol.pow2_scale_exponent` (E, W); each chunk is sent as
   ``rint(g * 2**k)`` in int32, and the results are written into :attr:`WorkerState.result`,
   the exact int32 sum (``result * 2**-k`` is the float sum).

:meth:`WorkerState.start_quantised` reduces an int32 vector the caller has already scaled
(no exponent round). The per-slot ``use`` numbers live as long as the object: all workers of
a job reduce the same sequence of vectors, so they agree on them. Time is passed in (``now``,
seconds), so the same object runs under a real clock, in the simulator and in tests.
"""

from __future__ import annotations

import numpy as np

from hpcdl.switch import protocol as p

__all__ = ["FAST_RETRANSMIT", "MAX_BACKOFF", "WorkerState", "exponent_of"]

#: a chunk's k-th retransmission waits ``timeout * 2**min(k, MAX_BACKOFF)``
MAX_BACKOFF = 6
#: the default ``fast``: a chunk 16 behind one whose result arrived is sent again at once
FAST_RETRANSMIT = 16

IDLE, EXPONENT, DATA = 0, 1, 2
#: ``WorkerState.chunk`` of a slot with nothing in flight, and of the slot carrying the exponent round
NOTHING, EXPONENT_CHUNK = -1, -2


def exponent_of(values: np.ndarray) -> int:
    """The smallest e with ``max|values| < 2**e`` (``ZERO_EXPONENT`` for an all-zero vector).

    Raises:
        ValueError: a value is not finite.
    """
    if values.size == 0:
        return p.ZERO_EXPONENT
    top = float(np.max(np.abs(values)))
    if not np.isfinite(top):
        raise ValueError("cannot scale a vector with non-finite values for the switch")
    return p.ZERO_EXPONENT if top == 0.0 else int(np.frexp(top)[1])


class WorkerState:
    """One worker of a job: its reductions through the switch's slots.

    Args:
        job: the job id (u32).
        worker: this worker's id, 0 .. workers-1.
        workers: W.
        slots: the switch's slots.
        payload: payload bytes per datagram (``switch.payload``).
        timeout: seconds after which a chunk without result is sent again (``switch.timeout_ms``/1000).
        window: chunks in flight, the slots 0 .. window-1 used (default: all); the same on every worker.
        fast: a chunk still without result when the result of a chunk ``fast`` or more after it
            arrives is sent again at once (once per chunk; 0: only after timeouts). A link that
            loses nothing (MPI without injected faults) has no use for it.

    Attributes:
        result: the last reduction's int32 sum (complete when :attr:`done`).
        scale_exponent: k of the last float reduction (``result * 2**-k`` is the float sum).
        retransmissions: datagrams sent again (after a timeout, or early).
        early: of them, sent again early (``fast``).
        ignored: results that were stale, duplicated or not for a chunk in flight.
        malformed: drops by reason, indexed by ``protocol.Malformed``.
    """

    def __init__(self, job: int, worker: int, workers: int, slots: int, payload: int,
                 timeout: float, window: int | None = None, fast: int = 0) -> None:  # fmt: skip
        window = slots if window is None else window
        if fast < 0:
            raise ValueError(f"fast must be 0 (off) or positive (got {fast})")
        if not 0 <= worker < workers:
            raise ValueError(f"worker must be in 0 .. {workers - 1} (got {worker})")
        if not 1 <= window <= slots:
            raise ValueError(f"window must be in 1 .. slots = {slots} (got {window})")
        if timeout <= 0:
            raise ValueError(f"timeout must be positive (got {timeout} s)")
        self.job, self.worker, self.workers, self.slots = job, worker, workers, slots
        self.elements = payload // 4
        self.timeout, self.window, self.fast = timeout, window, fast
        self.use = np.zeros(window, np.uint32)  # each slot's next use; lives across reductions
        self.chunk = np.full(window, NOTHING, np.int64)  # the chunk in flight on each slot
        self.deadline = np.full(window, np.inf)
        self.attempts = np.zeros(window, np.int64)  # retransmissions of the chunk in flight
        self.hurried = np.zeros(window, bool)  # the chunk in flight was sent again early
        self.sent = np.zeros(window, np.int64)  # the send number of the chunk in flight
        self._sends = 0  # chunks sent (first sends), the order early retransmission compares
        self.size = np.zeros(window, np.int64)  # bytes of the datagram in flight
        self.buffers = [bytearray(p.HEADER_SIZE + 4 * self.elements) for _ in range(window)]
        self.phase = IDLE
        self.values = np.zeros(0, np.int32)
        self.result = np.zeros(0, np.int32)
        self.scale_exponent = 0
        self.max_exponent = p.ZERO_EXPONENT
        self.results = 0  # results taken, of every reduction (a caller sees progress by it)
        self.retransmissions = 0
        self.early = 0
        self.ignored = 0
        self.malformed = np.zeros(len(p.Malformed), np.int64)
        self._grad: np.ndarray | None = None
        self._chunks = 0
        self._done_chunks = 0
        self._limits = p.Limits(job=job, workers=workers, slots=slots, elements=self.elements)

    @property
    def done(self) -> bool:
        """The last reduction is complete (or none was started)."""
        return self.phase == IDLE

    def start(self, grad: np.ndarray, now: float) -> list[bytes]:
        """Begin reducing a float vector: the exponent round's datagram.

        Args:
            grad: the vector (float32 or float64, finite), the same length on every worker;
                it is read again when the exponent round ends, so it must not change before.
            now: the caller's clock, seconds.

        Returns:
            The datagrams to send to the switch.
        """
        self._begin(len(grad))
        self._grad = grad
        self.phase = EXPONENT
        header = self._header(0, p.EXPONENT_ROUND, 0, 0, exponent_of(grad))
        return [self._send(0, EXPONENT_CHUNK, header, None, now)]

    def start_exponent(self, exponent: int, now: float) -> list[bytes]:
        """Begin an exponent round alone: the maximum of the workers' ``exponent`` (i16).

        The caller quantises itself once it is :attr:`done` (:attr:`max_exponent` holds the
        maximum), then reduces with :meth:`start_quantised`: the exchange does this, so that
        its own packing kernel quantises, as the int32 ring's does.

        Returns:
            The exponent round's datagram.
        """
        if not -0x8000 <= exponent <= 0x7FFF:
            raise ValueError(f"an exponent travels as an i16 (got {exponent})")
        self._begin(0)
        self._grad = None
        self.phase = EXPONENT
        header = self._header(0, p.EXPONENT_ROUND, 0, 0, exponent)
        return [self._send(0, EXPONENT_CHUNK, header, None, now)]

    def outstanding(self) -> tuple[list[int], int]:
        """The chunks in flight (their indices; ``-2`` the exponent round) and the chunks of the
        reduction not sent yet, for a message when the switch stops answering."""
        flying = sorted(int(c) for c in self.chunk if c != NOTHING)
        if self.phase != DATA:
            return flying, 0
        return flying, self._chunks - self._done_chunks - len(flying)

    def start_quantised(self, values: np.ndarray, now: float) -> list[bytes]:
        """Begin reducing an int32 vector already scaled so that W of them cannot overflow.

        Returns:
            The first ``window`` chunks' datagrams.
        """
        self._begin(len(values))
        self.values = np.ascontiguousarray(values, np.int32)
        return self._first_chunks(now)

    def receive(self, data: bytes | bytearray | memoryview, now: float) -> list[bytes]:
        """Take a datagram from the switch; return the datagrams to send next.

        A result for the chunk in flight on its slot is written into :attr:`result` and the
        slot's next chunk is sent; anything else (stale, duplicate, malformed) is counted
        and ignored.
        """
        parsed = p.parse(data, self._limits)
        if isinstance(parsed, p.Malformed):
            self.malformed[parsed] += 1
            return []
        header, payload = parsed
        s = header.slot
        exp_round = bool(header.flags & p.EXPONENT_ROUND)
        c = int(self.chunk[s]) if s < self.window else NOTHING
        if (
            not header.flags & p.RESULT
            or header.worker not in (p.ALL_WORKERS, self.worker)
            or c == NOTHING
            or exp_round != (c == EXPONENT_CHUNK)
            or header.use != self.use[s]
            or (not exp_round and (header.offset != c * self.elements or header.count != self._count(c)))
        ):
            self.ignored += 1
            return []
        if exp_round and self._grad is None:  # start_exponent: the maximum is the result
            self.results += 1
            self.use[s] = (int(self.use[s]) + 1) & 0xFFFFFFFF
            self.chunk[s] = NOTHING
            self.deadline[s] = np.inf
            self.max_exponent = header.exponent
            self.phase = IDLE
            return []
        if exp_round:
            try:
                k = p.pow2_scale_exponent(header.exponent, self.workers)
            except ValueError:  # an exponent no finite float has: not a result of this round
                self.ignored += 1
                return []
        self.results += 1
        self.use[s] = (int(self.use[s]) + 1) & 0xFFFFFFFF
        if exp_round:
            self.chunk[s] = NOTHING
            self.deadline[s] = np.inf
            self.scale_exponent = k
            self.max_exponent = header.exponent
            grad = self._grad
            self._grad = None
            self.values = np.rint(np.ldexp(grad.astype(np.float64), self.scale_exponent)).astype(np.int32)
            return self._first_chunks(now)
        self.result[header.offset : header.offset + header.count] = payload
        self._done_chunks += 1
        nxt = c + self.window
        sent = int(self.sent[s])
        out = []
        if nxt < self._chunks:
            out.append(self._send_chunk(s, nxt, now))
        else:
            self.chunk[s] = NOTHING
            self.deadline[s] = np.inf
            if self._done_chunks == self._chunks:
                self.phase = IDLE
        if self.fast:
            late = (self.chunk >= 0) & (self.sent <= sent - self.fast) & ~self.hurried
            for t in np.flatnonzero(late):
                self.hurried[t] = True
                out.append(self._resend(t, now))
            self.early += int(late.sum())
        return out

    def tick(self, now: float) -> list[bytes]:
        """The retransmissions due at ``now``: every datagram in flight past its deadline.

        Args:
            now: the caller's clock, seconds (the same clock as the other calls).
        """
        return [self._resend(s, now) for s in np.flatnonzero(self.deadline <= now)]

    def _resend(self, s: int, now: float) -> bytes:
        """Slot ``s``'s datagram again, flagged RETRANSMISSION; its timer backed off."""
        buf = self.buffers[s]
        buf[3] |= p.RETRANSMISSION  # the flags byte
        self.attempts[s] += 1
        self.deadline[s] = now + self.timeout * 2.0 ** min(int(self.attempts[s]), MAX_BACKOFF)
        self.retransmissions += 1
        return bytes(buf[: self.size[s]])

    def next_deadline(self) -> float:
        """When :meth:`tick` next has something to send (``inf`` when nothing is in flight)."""
        return float(self.deadline.min())

    def _begin(self, length: int) -> None:
        if self.phase != IDLE:
            raise RuntimeError("a reduction is in flight: feed receive() and tick() until done")
        if length >= 2**32:
            raise ValueError(f"a reduction holds at most 2**32 - 1 elements (got {length})")
        self.result = np.zeros(length, np.int32)
        self._limits = self._limits._replace(length=length)
        self._chunks = -(-length // self.elements)
        self._done_chunks = 0
        self.phase = DATA

    def _first_chunks(self, now: float) -> list[bytes]:
        self.phase = DATA if self._chunks else IDLE
        return [self._send_chunk(s, s, now) for s in range(min(self.window, self._chunks))]

    def _count(self, chunk: int) -> int:
        return min(self.elements, len(self.result) - chunk * self.elements)

    def _header(self, slot: int, flags: int, offset: int, count: int, exponent: int = 0) -> p.Header:
        return p.Header(p.CONTRIBUTION | flags, self.job, self.worker, slot, int(self.use[slot]),
                        offset, count, exponent)  # fmt: skip

    def _send_chunk(self, s: int, chunk: int, now: float) -> bytes:
        offset = chunk * self.elements
        count = self._count(chunk)
        header = self._header(s, 0, offset, count)
        return self._send(s, chunk, header, self.values[offset : offset + count], now)

    def _send(self, s: int, chunk: int, header: p.Header, payload: np.ndarray | None, now: float) -> bytes:
        """Encode into slot ``s``'s buffer (kept for retransmissions) and arm its timer."""
        self.chunk[s] = chunk
        self.size[s] = p.encode_into(self.buffers[s], header, payload)
        self.deadline[s] = now + self.timeout
        self.attempts[s] = 0
        self.hurried[s] = False
        self.sent[s] = self._sends
        self._sends += 1
        return bytes(self.buffers[s][: self.size[s]])
