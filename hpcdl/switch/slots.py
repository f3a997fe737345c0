"""The switch's slot logic as a pure state machine: datagrams in, datagrams out, no transport.

This is Algorithm 1 of SwitchML (Sapio et al., "Scaling Distributed Machine Learning with
In-Network Aggregation", NSDI'21, §3-4; p4app-switchML), done in numpy arrays so that a
Cython packet loop can take it over as is. The switch holds ``slots`` slots, each in two
sets (SwitchML's ``ver``); a worker streams the chunks of its vector through a slot,
alternating the sets. Per (slot, set) the switch keeps:

* ``use``: which use of the slot the set holds (the datagram's ``use``; set = ``use & 1``),
* ``state``: EMPTY (never used), FILLING, or COMPLETE,
* ``seen``: the bitmap of the workers that have contributed (uint64 words),
* ``sums``: the running sum, int64 (the scale rule guarantees that the int32 sum of W
  contributions does not overflow; the switch still sums in int64, and a sum outside int32
  is counted as ``overflow`` and saturated, never wrapped),
* ``offset``, ``count``, ``exponent`` of the chunk and whether it is an exponent round.

A contribution for (slot, use) goes to set ``use & 1``:

* a *later* use than the set holds, when the set is EMPTY or COMPLETE: the set starts the
  new chunk (its old result is dropped: every worker had it, since a worker contributes to
  use u + 2 only after the result of u + 1, which needs all W contributions to u + 1, each
  sent after its sender had the result of u);
* the *same* use, worker not yet in the bitmap: summed (max of the exponents in the exponent
  round); the W-th contribution completes the set and its result is multicast;
* the same use, worker already in the bitmap: a duplicate, never summed twice; when the set
  is COMPLETE the worker lost the result, and it is answered from the set, which stays as the
  **shadow copy** until the slot's use after next (unicast, flagged RETRANSMISSION);
* an *older* use: a stale datagram from the slot's earlier life (a late duplicate), dropped;
  so is a later use while the set is still FILLING (no correct worker sends one), and a
  datagram whose offset, count or kind differs from the chunk the set holds.

Malformed datagrams (see :class:`hpcdl.switch.protocol.Malformed`) are counted by reason and
dropped. Nothing here raises on what the network delivers.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

import numpy as np

from hpcdl.switch import protocol as p

__all__ = ["MULTICAST", "Counter", "Send", "SwitchState"]

#: The destination of a result sent to every worker.
MULTICAST = -1

EMPTY, FILLING, COMPLETE = 0, 1, 2


class Counter(enum.IntEnum):
    """The switch's counters (indices of ``SwitchState.count``)."""

    PACKETS_IN = 0
    BYTES_IN = 1
    PACKETS_OUT = 2  # a multicast counts once per worker
    BYTES_OUT = 3
    SUMMED = 4  # contributions added into a slot (data and exponent rounds)
    COMPLETED = 5  # results multicast
    EXPONENT_ROUNDS = 6  # of which exponent rounds
    DUPLICATES = 7  # contributions already in the bitmap of a set still filling
    RETRANSMITTED_RESULTS = 8  # shadow results unicast to a worker that asked again
    STALE = 9  # older use than the set holds, or a later one while it fills
    MISMATCH = 10  # same use, but another offset, count or kind than the set's chunk
    NOT_CONTRIBUTION = 11  # a RESULT datagram sent to the switch
    OVERFLOW = 12  # results with an element outside int32 (saturated)
    MALFORMED = 13  # all malformed datagrams; by reason in ``SwitchState.malformed``


class Send(NamedTuple):
    """A datagram to send: ``dest`` is a worker id or :data:`MULTICAST`."""

    dest: int
    data: bytes


def _newer(a: int, b: int) -> bool:
    """``a`` is a later use than ``b``, modulo 2**32 (serial-number arithmetic, RFC 1982)."""
    return 0 < ((a - b) & 0xFFFFFFFF) < 0x80000000


class SwitchState:
    """The slots of one switch serving one job of ``workers`` workers.

    Args:
        workers: W, the contributions each chunk needs (1 .. 65535).
        slots: the slots (``switch.slots``).
        payload: payload bytes (``switch.payload``, 256 or 1,024; a multiple of 4).
        job: the job served; datagrams of another job are dropped as ``Malformed.JOB``.

    Attributes:
        count: the counters, an int64 array indexed by :class:`Counter`.
        malformed: drops by reason, an int64 array indexed by ``protocol.Malformed``.
    """

    def __init__(self, workers: int, slots: int, payload: int, job: int) -> None:
        if not 1 <= workers < p.ALL_WORKERS:
            raise ValueError(f"workers must be in 1 .. {p.ALL_WORKERS - 1} (got {workers})")
        if not 1 <= slots <= 0xFFFF:
            raise ValueError(f"slots must be in 1 .. 65535 (got {slots})")
        if payload < 4 or payload % 4 or payload // 4 > 0xFFFF:
            raise ValueError(f"payload must be a positive multiple of 4 bytes (got {payload})")
        if not 0 <= job <= 0xFFFFFFFF:
            raise ValueError(f"job must be a u32 (got {job})")
        self.workers, self.slots, self.payload, self.job = workers, slots, payload, job
        self.elements = payload // 4
        self.limits = p.Limits(job=job, workers=workers, slots=slots, elements=self.elements)
        words = (workers + 63) // 64
        self.full = np.full(words, np.iinfo(np.uint64).max, np.uint64)  # the bitmap of all W
        if workers % 64:
            self.full[-1] = np.uint64((1 << (workers % 64)) - 1)
        self.sums = np.zeros((slots, 2, self.elements), np.int64)
        self.seen = np.zeros((slots, 2, words), np.uint64)
        self.contributors = np.zeros((slots, 2), np.int32)
        self.state = np.zeros((slots, 2), np.int8)
        self.use = np.zeros((slots, 2), np.uint32)
        self.offset = np.zeros((slots, 2), np.uint32)
        self.elems = np.zeros((slots, 2), np.uint16)
        self.exponent = np.zeros((slots, 2), np.int16)
        self.exponent_round = np.zeros((slots, 2), np.bool_)
        self.count = np.zeros(len(Counter), np.int64)
        self.malformed = np.zeros(len(p.Malformed), np.int64)
        self._out = bytearray(p.HEADER_SIZE + payload)

    def counters(self) -> dict[str, int]:
        """The counters by name (lower case), with ``malformed_<reason>`` for each reason."""
        named = {c.name.lower(): int(self.count[c]) for c in Counter}
        named.update({f"malformed_{m.name.lower()}": int(self.malformed[m]) for m in p.Malformed})
        return named

    def receive(self, data: bytes | bytearray | memoryview) -> list[Send]:
        """Take one datagram from the network; return what to send in answer.

        Args:
            data: the datagram's bytes, whatever arrived.

        Returns:
            The datagrams to send (none, a multicast result, or a unicast shadow result).
        """
        self.count[Counter.PACKETS_IN] += 1
        self.count[Counter.BYTES_IN] += len(data)
        parsed = p.parse(data, self.limits)
        if isinstance(parsed, p.Malformed):
            self.malformed[parsed] += 1
            self.count[Counter.MALFORMED] += 1
            return []
        return self.receive_parsed(*parsed)

    def receive_parsed(self, header: p.Header, payload: np.ndarray) -> list[Send]:
        """:meth:`receive` for a datagram already parsed against ``self.limits``."""
        if not header.flags & p.CONTRIBUTION:
            self.count[Counter.NOT_CONTRIBUTION] += 1
            return []
        s, u, w = header.slot, header.use, header.worker
        v = u & 1
        state = self.state[s, v]
        exp_round = bool(header.flags & p.EXPONENT_ROUND)
        held = int(self.use[s, v])
        if state == EMPTY or (state == COMPLETE and _newer(u, held)):
            self._start(s, v, header, exp_round)
        elif u != held:
            self.count[Counter.STALE] += 1  # older, or later while the set still fills
            return []
        elif (
            header.offset != self.offset[s, v]
            or header.count != self.elems[s, v]
            or exp_round != self.exponent_round[s, v]
        ):
            self.count[Counter.MISMATCH] += 1
            return []
        word, bit = w >> 6, np.uint64(1 << (w & 63))
        if self.seen[s, v, word] & bit:
            if state == COMPLETE:  # the worker lost the result: answer from the shadow copy
                self.count[Counter.RETRANSMITTED_RESULTS] += 1
                return [self._result(s, v, w, p.RETRANSMISSION)]
            self.count[Counter.DUPLICATES] += 1
            return []
        self.seen[s, v, word] |= bit
        self.count[Counter.SUMMED] += 1
        n = header.count
        if exp_round:
            self.exponent[s, v] = max(self.exponent[s, v], header.exponent)
        else:
            self.sums[s, v, :n] += payload
        self.contributors[s, v] += 1
        if self.contributors[s, v] < self.workers:
            return []
        self.state[s, v] = COMPLETE
        self.count[Counter.COMPLETED] += 1
        if exp_round:
            self.count[Counter.EXPONENT_ROUNDS] += 1
        else:
            chunk = self.sums[s, v, :n]
            if chunk.min() < -p.INT32_LIMIT - 1 or chunk.max() > p.INT32_LIMIT:
                self.count[Counter.OVERFLOW] += 1
                np.clip(chunk, -p.INT32_LIMIT - 1, p.INT32_LIMIT, out=chunk)
        return [self._result(s, v, MULTICAST, 0)]

    def _start(self, s: int, v: int, header: p.Header, exp_round: bool) -> None:
        """Set ``v`` of slot ``s`` begins a new chunk (the set's old result is no longer needed)."""
        self.state[s, v] = FILLING
        self.use[s, v] = header.use
        self.offset[s, v] = header.offset
        self.elems[s, v] = header.count
        self.exponent_round[s, v] = exp_round
        self.exponent[s, v] = p.ZERO_EXPONENT
        self.seen[s, v] = 0
        self.contributors[s, v] = 0
        self.sums[s, v] = 0

    def _result(self, s: int, v: int, dest: int, extra: int) -> Send:
        """The result datagram of set ``v`` of slot ``s``, for ``dest`` (a worker or MULTICAST)."""
        exp_round = bool(self.exponent_round[s, v])
        n = 0 if exp_round else int(self.elems[s, v])
        header = p.Header(
            flags=p.RESULT | extra | (p.EXPONENT_ROUND if exp_round else 0),
            job=self.job,
            worker=p.ALL_WORKERS if dest == MULTICAST else dest,
            slot=s,
            use=int(self.use[s, v]),
            offset=int(self.offset[s, v]),
            count=n,
            exponent=int(self.exponent[s, v]) if exp_round else 0,
        )
        size = p.encode_into(self._out, header, self.sums[s, v, :n])
        copies = self.workers if dest == MULTICAST else 1
        self.count[Counter.PACKETS_OUT] += copies
        self.count[Counter.BYTES_OUT] += copies * size
        return Send(dest, bytes(self._out[:size]))
