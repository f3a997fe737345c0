"""The switch's wire format: a fixed 24-byte little-endian header and an int32 payload.

Every datagram, a worker's contribution or the switch's result, is one header followed by
``count`` little-endian int32 elements (at most ``payload // 4``: 64 for a 256-byte payload,
256 for 1,024 bytes)::

    byte  size  field     type  meaning
    0     2     magic     u16   0x5348 (the bytes ``b"HS"``): not an hpcdl switch datagram otherwise
    2     1     version   u8    VERSION (1); another version is dropped, never guessed at
    3     1     flags     u8    CONTRIBUTION 0x01 | RESULT 0x02 | RETRANSMISSION 0x04 |
                                EXPONENT_ROUND 0x08; exactly one of CONTRIBUTION and RESULT;
                                bits 4-7 are reserved and must be 0
    4     4     job       u32   the job (one training run's reduction group); the switch serves one
    8     2     worker    u16   the sender of a contribution (0 .. W-1); in a result, the worker
                                it is addressed to, or ALL_WORKERS (0xFFFF) when multicast
    10    2     slot      u16   the switch slot (0 .. slots-1)
    12    4     use       u32   how many times this job used this slot before (wraps modulo 2**32);
                                ``use & 1`` is the slot set (SwitchML's ``ver`` bit)
    16    4     offset    u32   the chunk's first element in the reduced vector (a multiple of
                                the chunk size ``payload // 4``)
    20    2     count     u16   int32 elements in the payload (1 .. payload//4; 0 in the exponent round)
    22    2     exponent  i16   exponent round: the sender's exponent e (max|g| < 2**e), or the
                                maximum over the workers in the result; ignored otherwise
    24    4*count payload i32   the chunk (contribution) or the sum of the W chunks (result)

Why these choices:

* The set bit is the low bit of ``use`` rather than a flag: the switch keeps each set's full
  use number to tell a retransmission (the same use), a new chunk (a later use) and a stale
  duplicate from a slot's earlier life (an older use) apart; one bit alone cannot, once the
  network reorders or duplicates datagrams.
* ``offset`` is u32: a reduction is one bucket of the gradient exchange, far below 2**32
  elements (16 GiB of int32); a larger vector is reduced in several buckets. A u64 would grow
  the header from 24 to 32 bytes (8.6 % → 11 % of a 256-byte payload).
* ``exponent`` is i16: a float64 magnitude's exponent spans -1074 .. 1024. An all-zero
  vector sends ``ZERO_EXPONENT`` (-32768), which loses every maximum.
* Every field is naturally aligned and the payload starts 8-aligned, so a P4 parser and a
  Cython packet loop read it with plain loads.

:func:`parse` never raises on bad bytes: it returns a :class:`Malformed` reason (the switch
counts and drops). :func:`encode_into` writes into a caller's buffer without allocating.
:func:`pow2_scale_exponent` is SwitchML's scale rule (the block-floating-point exponent round).
"""

from __future__ import annotations

import enum
import struct
from typing import NamedTuple

import numpy as np

from hpcdl.comm.pack import int32_pow2_shift

__all__ = [
    "ALL_WORKERS",
    "CONTRIBUTION",
    "EXPONENT_ROUND",
    "HEADER",
    "HEADER_SIZE",
    "INT32_LIMIT",
    "MAGIC",
    "PAYLOADS",
    "RESULT",
    "RETRANSMISSION",
    "VERSION",
    "ZERO_EXPONENT",
    "Header",
    "Limits",
    "Malformed",
    "encode",
    "encode_into",
    "parse",
    "pow2_scale_exponent",
]

MAGIC = 0x5348
VERSION = 1
#: ``<`` little-endian: magic, version, flags, job, worker, slot, use, offset, count, exponent
HEADER = struct.Struct("<HBBIHHIIHh")
HEADER_SIZE = HEADER.size  # 24
#: The payload sizes in bytes the issue names (``switch.payload``).
PAYLOADS = (256, 1024)
#: The worker field of a multicast result.
ALL_WORKERS = 0xFFFF
#: The exponent an all-zero vector sends: below every real one.
ZERO_EXPONENT = -32768
INT32_LIMIT = 2**31 - 1
_NO_MAGNITUDE = -1075  # below the exponent of every nonzero float64 (frexp of 2**-1074 is -1073)

CONTRIBUTION = 0x01
RESULT = 0x02
RETRANSMISSION = 0x04
EXPONENT_ROUND = 0x08
_KNOWN_FLAGS = CONTRIBUTION | RESULT | RETRANSMISSION | EXPONENT_ROUND
_PAYLOAD_DTYPE = np.dtype("<i4")


class Malformed(enum.IntEnum):
    """Why a datagram was dropped (the switch and the worker count drops by reason)."""

    SHORT = 0  # fewer bytes than the header, or than its count says
    LENGTH = 1  # more bytes than the header and its count
    MAGIC = 2
    VERSION = 3
    FLAGS = 4  # reserved bits set, or not exactly one of CONTRIBUTION and RESULT
    JOB = 5  # not the job this switch or worker serves
    WORKER = 6  # worker id out of range
    SLOT = 7  # slot out of range
    COUNT = 8  # element count 0 (outside the exponent round), above the payload, or not 0 in it
    OFFSET = 9  # not a multiple of the chunk size, or past the vector's end


class Header(NamedTuple):
    """One datagram's header, field by field (see the module docstring for sizes)."""

    flags: int
    job: int
    worker: int
    slot: int
    use: int
    offset: int
    count: int
    exponent: int = 0


class Limits(NamedTuple):
    """What :func:`parse` checks a datagram against.

    Attributes:
        job: the job served; ``None`` accepts any.
        workers: W; contributions must come from 0 .. W-1.
        slots: the switch's slots.
        elements: int32 elements per chunk (``payload // 4``).
        length: the reduced vector's length when known (the worker knows it; the switch
            does not), else ``None``.
    """

    job: int | None
    workers: int
    slots: int
    elements: int
    length: int | None = None


def pow2_scale_exponent(max_exponent: int, workers: int) -> int:
    """The largest k with ``workers * 2**(max_exponent + k) <= 2**31 - 1``: the exchange's own
    rule, :func:`hpcdl.comm.pack.int32_pow2_shift`, so that the switch and the int32 ring sum
    the same integers.

    With ``max|g| < 2**max_exponent`` on every worker, ``rint(g * 2**k)`` is at most
    ``2**(max_exponent + k)`` in magnitude, so the sum of ``workers`` such integers cannot
    overflow int32 (SwitchML's block floating point, with one exponent per bucket). k is capped
    at 1023 (``2**k`` a finite float64); an all-zero bucket on every worker (``max_exponent``
    at or below -1075, such as :data:`ZERO_EXPONENT`) gets k = 0.

    Args:
        max_exponent: the maximum over the workers of their exponents (``frexp(max|g|)[1]``).
        workers: W, the number of contributions summed.

    Returns:
        k, possibly negative (large gradients are scaled down).

    Raises:
        ValueError: ``workers`` is not in 1 .. 65535, or ``max_exponent`` is above 1024 (no
            finite float64 has it: a result datagram that carries one is refused by the worker).
    """
    if not 1 <= workers <= 0xFFFF:
        raise ValueError(f"workers must be in 1 .. 65535 (got {workers})")
    return int32_pow2_shift(max(int(max_exponent), _NO_MAGNITUDE), workers)


def encode_into(buf: bytearray | memoryview, header: Header, payload: np.ndarray | None = None) -> int:
    """Write ``header`` and ``payload`` (``header.count`` int32) into ``buf``; no allocation.

    Args:
        buf: a writable buffer of at least ``HEADER_SIZE + 4 * header.count`` bytes.
        header: the fields; the payload's size is ``header.count``.
        payload: the ``header.count`` elements (any integer dtype holding int32 values), or
            ``None`` to leave the payload bytes as they are (a retransmission re-flags a
            datagram already in ``buf``).

    Returns:
        The datagram's size in bytes.
    """
    HEADER.pack_into(buf, 0, MAGIC, VERSION, header.flags, header.job, header.worker, header.slot,
                     header.use, header.offset, header.count, header.exponent)  # fmt: skip
    if payload is not None and header.count:
        np.frombuffer(buf, _PAYLOAD_DTYPE, header.count, HEADER_SIZE)[:] = payload[: header.count]
    return HEADER_SIZE + 4 * header.count


def encode(header: Header, payload: np.ndarray | None = None) -> bytes:
    """:func:`encode_into` a new buffer, returned as bytes."""
    buf = bytearray(HEADER_SIZE + 4 * header.count)
    encode_into(buf, header, payload)
    return bytes(buf)


def parse(data: bytes | bytearray | memoryview, limits: Limits) -> tuple[Header, np.ndarray] | Malformed:
    """The header and a read-only int32 view of the payload, or why the datagram is malformed.

    Never raises on bad bytes.

    Args:
        data: one datagram.
        limits: the configuration it must fit.

    Returns:
        ``(header, payload)`` with ``payload`` an int32 view of ``data`` (``header.count``
        elements, no copy), or a :class:`Malformed` reason.
    """
    size = len(data)
    if size < HEADER_SIZE:
        return Malformed.SHORT
    magic, version, flags, job, worker, slot, use, offset, count, exponent = HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        return Malformed.MAGIC
    if version != VERSION:
        return Malformed.VERSION
    if flags & ~_KNOWN_FLAGS or ((flags & CONTRIBUTION) != 0) == ((flags & RESULT) != 0):
        return Malformed.FLAGS
    if limits.job is not None and job != limits.job:
        return Malformed.JOB
    if worker >= limits.workers and not (flags & RESULT and worker == ALL_WORKERS):
        return Malformed.WORKER
    if slot >= limits.slots:
        return Malformed.SLOT
    if flags & EXPONENT_ROUND:
        if count != 0:
            return Malformed.COUNT
    elif not 1 <= count <= limits.elements:
        return Malformed.COUNT
    if offset % limits.elements or (limits.length is not None and offset + count > limits.length):
        return Malformed.OFFSET
    if size < HEADER_SIZE + 4 * count:
        return Malformed.SHORT
    if size > HEADER_SIZE + 4 * count:
        return Malformed.LENGTH
    payload = np.frombuffer(data, _PAYLOAD_DTYPE, count, HEADER_SIZE)
    return Header(flags, job, worker, slot, use, offset, count, exponent), payload
