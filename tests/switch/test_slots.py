"""The switch's slot state machine, datagram by datagram (SwitchML's Algorithm 1 and its edge cases)."""

from __future__ import annotations

import numpy as np
import pytest

from hpcdl.switch import MULTICAST, Counter, SwitchState
from hpcdl.switch import protocol as p
from hpcdl.switch.protocol import Header


def contribution(worker: int, slot: int = 0, use: int = 0, offset: int = 0, values: tuple = (1, 2),
                 exponent: int | None = None, retransmission: bool = False) -> bytes:  # fmt: skip
    """A worker's datagram; ``exponent`` given: the exponent round's."""
    flags = p.CONTRIBUTION | (p.RETRANSMISSION if retransmission else 0)
    if exponent is not None:
        return p.encode(Header(flags | p.EXPONENT_ROUND, 7, worker, slot, use, 0, 0, exponent))
    return p.encode(Header(flags, 7, worker, slot, use, offset, len(values)), np.array(values, np.int32))


def result(send: object) -> tuple[Header, list[int]]:
    header, payload = p.parse(send.data, p.Limits(None, p.ALL_WORKERS, 2**16, 64))
    return header, payload.tolist()


def test_sums_once_per_worker_then_multicasts() -> None:
    sw = SwitchState(workers=3, slots=2, payload=256, job=7)
    assert sw.receive(contribution(0, values=(1, 2))) == []
    assert sw.receive(contribution(0, values=(1, 2))) == []  # a duplicate: not summed twice
    assert sw.receive(contribution(2, values=(10, 20))) == []
    (out,) = sw.receive(contribution(1, values=(100, -200)))
    header, values = result(out)
    assert out.dest == MULTICAST and header.worker == p.ALL_WORKERS
    assert header.flags == p.RESULT and values == [111, -178]
    assert (header.slot, header.use, header.offset, header.count) == (0, 0, 0, 2)
    assert sw.count[Counter.DUPLICATES] == 1 and sw.count[Counter.SUMMED] == 3
    assert sw.count[Counter.PACKETS_OUT] == 3 and sw.count[Counter.BYTES_OUT] == 3 * (24 + 8)


def test_shadow_copy_answers_a_worker_that_lost_the_result() -> None:
    sw = SwitchState(workers=2, slots=1, payload=256, job=7)
    sw.receive(contribution(0, values=(1, 1)))
    sw.receive(contribution(1, values=(2, 2)))  # complete: multicast (worker 1's copy is lost)
    sw.receive(contribution(0, use=1, offset=64, values=(5,)))  # worker 0 moved on: set 1
    (out,) = sw.receive(contribution(1, values=(2, 2), retransmission=True))
    header, values = result(out)
    assert out.dest == 1 and header.worker == 1
    assert header.flags == p.RESULT | p.RETRANSMISSION and header.use == 0 and values == [3, 3]
    assert sw.count[Counter.RETRANSMITTED_RESULTS] == 1 and sw.count[Counter.SUMMED] == 3
    (out,) = sw.receive(contribution(1, use=1, offset=64, values=(6,)))
    assert result(out)[1] == [11]


def test_a_stale_duplicate_is_not_mixed_into_the_slots_next_chunk() -> None:
    """Worker 1's first datagram, delayed, arrives after set 0 started its next chunk (use 2)."""
    sw = SwitchState(workers=2, slots=1, payload=256, job=7)
    for use, offset in ((0, 0), (1, 64)):
        sw.receive(contribution(0, use=use, offset=offset, values=(1,)))
        sw.receive(contribution(1, use=use, offset=offset, values=(1,)))
    sw.receive(contribution(0, use=2, offset=128, values=(1,)))
    assert sw.receive(contribution(1, use=0, offset=0, values=(1000,))) == []
    assert sw.count[Counter.STALE] == 1
    (out,) = sw.receive(contribution(1, use=2, offset=128, values=(1,)))
    assert result(out)[1] == [2]


def test_a_later_use_while_the_set_fills_is_dropped() -> None:
    sw = SwitchState(workers=2, slots=1, payload=256, job=7)
    sw.receive(contribution(0, use=0, values=(1,)))
    assert sw.receive(contribution(1, use=2, offset=128, values=(1,))) == []
    assert sw.count[Counter.STALE] == 1


def test_same_use_other_chunk_is_a_mismatch() -> None:
    sw = SwitchState(workers=2, slots=1, payload=256, job=7)
    sw.receive(contribution(0, values=(1, 2)))
    assert sw.receive(contribution(1, offset=64, values=(1, 2))) == []
    assert sw.receive(contribution(1, values=(1,))) == []
    assert sw.receive(contribution(1, exponent=3)) == []
    assert sw.count[Counter.MISMATCH] == 3 and sw.count[Counter.SUMMED] == 1


def test_exponent_round_takes_the_maximum() -> None:
    sw = SwitchState(workers=4, slots=3, payload=1024, job=7)
    for w, e in enumerate((-3, p.ZERO_EXPONENT, 12, -40)):
        outs = sw.receive(contribution(w, slot=2, use=6, exponent=e))
    header, values = result(outs[0])
    assert header.flags == p.RESULT | p.EXPONENT_ROUND and header.exponent == 12 and values == []
    assert sw.count[Counter.EXPONENT_ROUNDS] == 1


def test_all_zero_vectors_keep_the_zero_exponent() -> None:
    sw = SwitchState(workers=2, slots=1, payload=256, job=7)
    sw.receive(contribution(0, exponent=p.ZERO_EXPONENT))
    (out,) = sw.receive(contribution(1, exponent=p.ZERO_EXPONENT))
    assert result(out)[0].exponent == p.ZERO_EXPONENT


def test_one_worker_completes_at_once() -> None:
    sw = SwitchState(workers=1, slots=1, payload=256, job=7)
    for use in range(4):
        (out,) = sw.receive(contribution(0, use=use, offset=64 * use, values=(use,)))
        assert result(out)[1] == [use]


def test_more_than_64_workers_use_two_bitmap_words() -> None:
    sw = SwitchState(workers=65, slots=1, payload=256, job=7)
    for w in range(64):
        assert sw.receive(contribution(w, values=(1,))) == []
    assert sw.receive(contribution(63, values=(1,))) == []  # a duplicate in word 0
    (out,) = sw.receive(contribution(64, values=(1,)))
    assert result(out)[1] == [65] and sw.count[Counter.DUPLICATES] == 1


def test_an_overflow_is_counted_and_saturated_never_wrapped() -> None:
    sw = SwitchState(workers=2, slots=1, payload=256, job=7)
    top, bottom = p.INT32_LIMIT, -p.INT32_LIMIT - 1
    sw.receive(contribution(0, values=(top, bottom, 5)))
    (out,) = sw.receive(contribution(1, values=(1, -1, 5)))
    assert result(out)[1] == [top, bottom, 10] and sw.count[Counter.OVERFLOW] == 1


def test_results_and_malformed_datagrams_are_counted_and_dropped() -> None:
    sw = SwitchState(workers=2, slots=1, payload=256, job=7)
    to_switch = p.encode(Header(p.RESULT, 7, 0, 0, 0, 0, 1), np.ones(1, np.int32))
    assert sw.receive(to_switch) == []
    assert sw.receive(b"\x00" * 5) == []
    assert sw.receive(contribution(0)[:4] + b"\x08\x00\x00\x00" + contribution(0)[8:]) == []  # job 8
    assert sw.count[Counter.NOT_CONTRIBUTION] == 1 and sw.count[Counter.MALFORMED] == 2
    counters = sw.counters()
    assert counters["malformed_short"] == 1 and counters["malformed_job"] == 1
    assert counters["packets_in"] == 3 and counters["bytes_in"] == 28 + 5 + 32


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"workers": 0}, "workers"),
        ({"workers": 65535}, "workers"),
        ({"slots": 0}, "slots"),
        ({"payload": 255}, "payload"),
        ({"job": -1}, "job"),
    ],
)
def test_refuses_impossible_configurations(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SwitchState(**{"workers": 2, "slots": 4, "payload": 256, "job": 7, **kwargs})
