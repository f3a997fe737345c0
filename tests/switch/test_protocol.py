"""The wire format: the header's bytes, the round trip, every malformed reason, the scale rule."""

from __future__ import annotations

import numpy as np
import pytest

from hpcdl.switch import protocol as p
from hpcdl.switch.protocol import Header, Limits, Malformed

LIMITS = Limits(job=7, workers=3, slots=4, elements=64, length=1000)
GOOD = Header(p.CONTRIBUTION, job=7, worker=2, slot=3, use=5, offset=128, count=3, exponent=-2)


def test_header_layout_byte_by_byte() -> None:
    data = p.encode(GOOD, np.array([1, -1, 2**31 - 1], np.int32))
    assert p.HEADER_SIZE == 24
    assert data.hex(" ") == " ".join([
        "48 53",  # magic 0x5348, little-endian: b"HS"
        "01",  # version
        "01",  # flags: CONTRIBUTION
        "07 00 00 00",  # job
        "02 00",  # worker
        "03 00",  # slot
        "05 00 00 00",  # use (set = use & 1 = 1)
        "80 00 00 00",  # offset 128
        "03 00",  # count
        "fe ff",  # exponent -2
        "01 00 00 00", "ff ff ff ff", "ff ff ff 7f",  # payload, int32 little-endian
    ])  # fmt: skip


def test_round_trip_and_payload_is_a_view() -> None:
    buf = bytearray(p.HEADER_SIZE + 256)
    size = p.encode_into(buf, GOOD, np.array([4, 5, 6, 99]))
    assert size == p.HEADER_SIZE + 12
    header, payload = p.parse(memoryview(buf)[:size], LIMITS)
    assert header == GOOD
    assert payload.tolist() == [4, 5, 6] and payload.dtype == np.dtype("<i4")
    assert np.shares_memory(payload, np.frombuffer(buf, np.uint8))


def _bad(**fields: int) -> bytes:
    return p.encode(GOOD._replace(**fields), np.zeros(fields.get("count", GOOD.count), np.int32))


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"", Malformed.SHORT),
        (p.encode(GOOD, np.zeros(3, np.int32))[:23], Malformed.SHORT),
        (p.encode(GOOD, np.zeros(3, np.int32))[:-1], Malformed.SHORT),
        (p.encode(GOOD, np.zeros(3, np.int32)) + b"\0", Malformed.LENGTH),
        (b"SH" + p.encode(GOOD, np.zeros(3, np.int32))[2:], Malformed.MAGIC),
        (p.encode(GOOD, np.zeros(3, np.int32))[:2] + b"\x02" + p.encode(GOOD, np.zeros(3, np.int32))[3:],
         Malformed.VERSION),
        (_bad(flags=p.CONTRIBUTION | 0x10), Malformed.FLAGS),
        (_bad(flags=p.CONTRIBUTION | p.RESULT), Malformed.FLAGS),
        (_bad(flags=p.RETRANSMISSION), Malformed.FLAGS),
        (_bad(job=8), Malformed.JOB),
        (_bad(worker=3), Malformed.WORKER),
        (_bad(worker=p.ALL_WORKERS), Malformed.WORKER),  # only a result goes to all
        (_bad(slot=4), Malformed.SLOT),
        (_bad(count=0), Malformed.COUNT),
        (_bad(count=65), Malformed.COUNT),
        (_bad(flags=p.CONTRIBUTION | p.EXPONENT_ROUND), Malformed.COUNT),  # count must be 0
        (_bad(offset=100), Malformed.OFFSET),  # not a chunk boundary
        (_bad(offset=960, count=64), Malformed.OFFSET),  # past the end (1000)
    ],
)  # fmt: skip
def test_malformed_reasons(data: bytes, reason: Malformed) -> None:
    assert p.parse(data, LIMITS) is reason


def test_result_to_all_and_any_job_when_not_known() -> None:
    data = _bad(flags=p.RESULT, worker=p.ALL_WORKERS, job=12345)
    header, _ = p.parse(data, LIMITS._replace(job=None))
    assert header.worker == p.ALL_WORKERS and header.job == 12345
    assert p.parse(_bad(offset=2**32 - 64), LIMITS._replace(length=None))[0].offset == 2**32 - 64


@pytest.mark.parametrize(
    ("exponent", "workers", "k"),
    [(0, 1, 30), (1, 1, 29), (0, 2, 29), (0, 3, 29), (0, 4, 28), (-10, 8, 37), (40, 5, -12), (0, 65535, 15)],
)
def test_pow2_scale_exponent_table(exponent: int, workers: int, k: int) -> None:
    assert p.pow2_scale_exponent(exponent, workers) == k


def test_pow2_scale_exponent_is_the_largest_safe_k() -> None:
    for workers in [*range(1, 70), 1000, 4096, 65535]:
        for exponent in range(-40, 40):
            k = p.pow2_scale_exponent(exponent, workers)
            assert workers * 2 ** (exponent + k) <= p.INT32_LIMIT < workers * 2 ** (exponent + k + 1)


def test_pow2_scale_exponent_of_zero_and_tiny_buckets() -> None:
    assert p.pow2_scale_exponent(p.ZERO_EXPONENT, 3) == p.pow2_scale_exponent(-1075, 3) == 0
    assert p.pow2_scale_exponent(-1073, 1) == 1023  # capped: 2**k stays a finite float64
    assert p.pow2_scale_exponent(-992, 1) == 1022


def test_pow2_scale_exponent_refuses_impossible_worker_counts() -> None:
    with pytest.raises(ValueError, match="got 0"):
        p.pow2_scale_exponent(0, 0)
