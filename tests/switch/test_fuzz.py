"""Hypothesis fuzzing: the parser, the switch and the worker take any bytes without raising, and count them.

The normal run tries ``HPCDL_FUZZ_EXAMPLES`` examples per test (300 by default); the ``slow``
test tries 5,000 sequences of datagrams. For a long campaign::

    HPCDL_FUZZ_EXAMPLES=100000 pytest -p no:cacheprovider tests/switch/test_fuzz.py \
        -k parse_and_switch --hypothesis-show-statistics
"""

from __future__ import annotations

import os

import numpy as np
import pytest

pytest.importorskip("hypothesis", reason="hypothesis is in the test extra: pip install -e '.[test]'")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from hpcdl.switch import Counter, SwitchState, WorkerState  # noqa: E402
from hpcdl.switch import protocol as p  # noqa: E402

EXAMPLES = int(os.environ.get("HPCDL_FUZZ_EXAMPLES", "300"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
WORKERS, SLOTS, PAYLOAD, JOB = 3, 4, 256, 7
ELEMENTS = PAYLOAD // 4
#: every way a switch ends one datagram's handling: the counters add up to PACKETS_IN
OUTCOMES = (Counter.MALFORMED, Counter.NOT_CONTRIBUTION, Counter.STALE, Counter.MISMATCH,
            Counter.RETRANSMITTED_RESULTS, Counter.DUPLICATES, Counter.SUMMED)  # fmt: skip


def _either(*choices: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(*choices)


@st.composite
def near_valid(draw: st.DrawFn) -> bytes:
    """A datagram whose every field is usually in range and sometimes just or far outside it."""
    flags = draw(_either(st.sampled_from([p.CONTRIBUTION, p.CONTRIBUTION | p.RETRANSMISSION,
                                          p.CONTRIBUTION | p.EXPONENT_ROUND, p.RESULT,
                                          p.RESULT | p.EXPONENT_ROUND]),
                         st.integers(0, 255)))  # fmt: skip
    exp_round = bool(flags & p.EXPONENT_ROUND)
    count = draw(_either(st.just(0 if exp_round else ELEMENTS), st.integers(0, ELEMENTS + 1),
                         st.integers(0, 0xFFFF)))  # fmt: skip
    fields = (
        draw(_either(st.just(p.MAGIC), st.integers(0, 0xFFFF))),
        draw(_either(st.just(p.VERSION), st.integers(0, 255))),
        flags,
        draw(_either(st.just(JOB), st.integers(0, 2**32 - 1))),
        draw(_either(st.integers(0, WORKERS), st.integers(0, 0xFFFF))),
        draw(_either(st.integers(0, SLOTS), st.integers(0, 0xFFFF))),
        draw(_either(st.integers(0, 5), st.integers(2**32 - 3, 2**32 - 1), st.integers(0, 2**32 - 1))),
        draw(_either(st.integers(0, 8).map(lambda c: c * ELEMENTS), st.integers(0, 2**32 - 1))),
        count,
        draw(st.integers(-(2**15), 2**15 - 1)),
    )
    header = p.HEADER.pack(*fields)
    size = draw(_either(st.just(4 * min(count, ELEMENTS + 1)), st.integers(0, 300)))
    extremes = st.sampled_from([0, 1, -1, 2**31 - 1, -(2**31)])
    payload = draw(_either(st.binary(min_size=size, max_size=size),
                           st.lists(extremes, min_size=size // 4, max_size=size // 4)
                           .map(lambda v: np.array(v, "<i4").tobytes() + b"\0" * (size % 4))))  # fmt: skip
    return header + payload


DATAGRAM = _either(st.binary(max_size=300), near_valid())


def _check_parse(data: bytes, limits: p.Limits) -> None:
    parsed = p.parse(data, limits)
    if isinstance(parsed, p.Malformed):
        return
    header, payload = parsed
    assert len(payload) == header.count <= limits.elements
    assert header.slot < limits.slots and header.job == limits.job
    assert len(data) == p.HEADER_SIZE + 4 * header.count


def _switch_takes(datagrams: list[bytes]) -> None:
    sw = SwitchState(WORKERS, SLOTS, PAYLOAD, JOB)
    limits = p.Limits(JOB, p.ALL_WORKERS, SLOTS, ELEMENTS)
    for data in datagrams:
        for out in sw.receive(data):
            header, _ = p.parse(out.data, limits)  # what the switch sends is well formed
            assert header.flags & p.RESULT
    assert sw.count[Counter.PACKETS_IN] == len(datagrams)
    assert sum(sw.count[c] for c in OUTCOMES) == len(datagrams)  # every datagram counted once
    assert sw.count[Counter.MALFORMED] == sw.malformed.sum()
    filling = sw.contributors[sw.state == 1].sum()  # a complete set was summed exactly W times
    assert sw.count[Counter.SUMMED] == WORKERS * sw.count[Counter.COMPLETED] + filling


@FUZZ
@given(data=DATAGRAM)
def test_parse_and_switch_never_raise(data: bytes) -> None:
    """One datagram of any bytes: the parser answers, and a switch counts it exactly once."""
    _check_parse(data, p.Limits(JOB, WORKERS, SLOTS, ELEMENTS))
    _check_parse(data, p.Limits(JOB, WORKERS, SLOTS, ELEMENTS, length=300))
    _switch_takes([data])


@FUZZ
@given(datagrams=st.lists(DATAGRAM, max_size=12))
def test_switch_never_raises_and_counts_every_datagram(datagrams: list[bytes]) -> None:
    _switch_takes(datagrams)


@pytest.mark.slow
@settings(FUZZ, max_examples=max(EXAMPLES, 5_000))
@given(datagrams=st.lists(DATAGRAM, max_size=12))
def test_switch_never_raises_long(datagrams: list[bytes]) -> None:
    _switch_takes(datagrams)


@FUZZ
@given(datagrams=st.lists(DATAGRAM, max_size=12))
def test_worker_never_raises(datagrams: list[bytes]) -> None:
    w = WorkerState(JOB, 1, WORKERS, SLOTS, PAYLOAD, timeout=1.0)
    w.start_quantised(np.ones(300, np.int32), now=0.0)
    for data in datagrams:
        for out in w.receive(data, now=0.5):
            assert isinstance(p.parse(out, p.Limits(JOB, WORKERS, SLOTS, ELEMENTS)), tuple)
    assert w.ignored + w.malformed.sum() <= len(datagrams)
