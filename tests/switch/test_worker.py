"""The worker's state machine alone: what it sends, what it ignores, when it retransmits."""

from __future__ import annotations

import numpy as np
import pytest

from hpcdl.switch import WorkerState, exponent_of
from hpcdl.switch import protocol as p
from hpcdl.switch.protocol import Header
from hpcdl.switch.worker import MAX_BACKOFF

LIMITS = p.Limits(job=7, workers=2, slots=2, elements=64)


def headers(datagrams: list[bytes]) -> list[Header]:
    return [p.parse(d, LIMITS)[0] for d in datagrams]


def answer(h: Header, values: np.ndarray | None = None, exponent: int = 0, worker: int = p.ALL_WORKERS,
           extra: int = 0) -> bytes:  # fmt: skip
    """The switch's result for the contribution ``h``."""
    flags = (h.flags & ~(p.CONTRIBUTION | p.RETRANSMISSION)) | p.RESULT | extra
    return p.encode(h._replace(flags=flags, worker=worker, exponent=exponent), values)


def test_exponent_of() -> None:
    assert exponent_of(np.array([0.5, -0.25])) == 0  # 0.5 < 2**0
    assert exponent_of(np.array([1.0])) == 1
    assert exponent_of(np.array([-3.0, 0.0])) == 2
    assert exponent_of(np.zeros(3)) == p.ZERO_EXPONENT == exponent_of(np.zeros(0))
    with pytest.raises(ValueError, match="non-finite"):
        exponent_of(np.array([1.0, np.nan]))


def test_streams_chunks_through_its_window_and_alternates_sets() -> None:
    w = WorkerState(job=7, worker=1, workers=2, slots=2, payload=256, timeout=1.0)
    first = headers(w.start_quantised(np.arange(200, dtype=np.int32), now=0.0))
    assert [(h.slot, h.use, h.offset, h.count) for h in first] == [(0, 0, 0, 64), (1, 0, 64, 64)]
    nxt = headers(w.receive(answer(first[0], np.full(64, 3)), now=0.1))
    assert [(h.slot, h.use, h.offset, h.count) for h in nxt] == [(0, 1, 128, 64)]
    last = headers(w.receive(answer(first[1], np.full(64, 4)), now=0.1))
    assert [(h.slot, h.use, h.offset, h.count) for h in last] == [(1, 1, 192, 8)]  # 200 = 3·64 + 8
    assert w.receive(answer(nxt[0], np.full(64, 5)), now=0.2) == []
    assert not w.done
    assert w.receive(answer(last[0], np.full(8, 6)), now=0.2) == []
    assert w.done
    assert w.result.tolist() == [3] * 64 + [4] * 64 + [5] * 64 + [6] * 8


def test_ignores_stale_duplicate_and_foreign_results() -> None:
    w = WorkerState(job=7, worker=1, workers=2, slots=2, payload=256, timeout=1.0, window=1)
    (h,) = headers(w.start_quantised(np.arange(100, dtype=np.int32), now=0.0))
    good = answer(h, np.ones(64))
    assert len(w.receive(good, now=0.0)) == 1
    assert w.receive(good, now=0.0) == []  # a duplicate of the result: stale now
    assert w.receive(answer(h, np.ones(64), worker=0), now=0.0) == []  # unicast to another worker
    assert w.receive(answer(h._replace(slot=1), np.ones(64)), now=0.0) == []  # outside the window
    assert w.receive(answer(h, np.ones(64))[:30], now=0.0) == []  # malformed
    assert w.ignored == 3 and w.malformed[p.Malformed.SHORT] == 1
    assert w.result[:64].tolist() == [1] * 64


def test_tick_retransmits_after_the_timeout_only() -> None:
    w = WorkerState(job=7, worker=0, workers=2, slots=2, payload=256, timeout=0.5)
    sent = w.start(np.array([0.75, -3.5]), now=1.0)
    (h,) = headers(sent)
    assert h.flags == p.CONTRIBUTION | p.EXPONENT_ROUND and h.exponent == 2 and h.count == 0
    assert w.tick(1.49) == [] and w.next_deadline() == 1.5
    (again,) = w.tick(1.5)
    assert headers([again])[0] == h._replace(flags=h.flags | p.RETRANSMISSION)
    assert w.next_deadline() == 2.5 and w.retransmissions == 1  # backed off: 2 x the timeout
    assert len(w.tick(2.5)) == 1 and w.next_deadline() == 4.5  # then 4 x
    data = headers(w.receive(answer(h, exponent=5, extra=p.RETRANSMISSION), now=1.6))
    k = p.pow2_scale_exponent(5, 2)
    assert w.scale_exponent == k and (data[0].slot, data[0].use) == (0, 1)  # the round used slot 0 once
    assert np.frombuffer(w.buffers[0], "<i4", 2, 24).tolist() == [0.75 * 2**k, -3.5 * 2**k]
    assert w.tick(1.9) == [] and w.next_deadline() == 2.1  # the new chunk's timer starts afresh


def test_backoff_is_capped() -> None:
    w = WorkerState(job=7, worker=0, workers=2, slots=1, payload=256, timeout=1.0)
    w.start(np.ones(3), now=0.0)
    now, gaps = 1.0, []
    for _ in range(MAX_BACKOFF + 3):
        assert len(w.tick(now)) == 1
        gaps.append(w.next_deadline() - now)
        now = w.next_deadline()
    assert gaps == [2.0**min(k, MAX_BACKOFF) for k in range(1, MAX_BACKOFF + 4)]


def test_refuses_misuse() -> None:
    with pytest.raises(ValueError, match="window"):
        WorkerState(7, 0, 2, slots=2, payload=256, timeout=1.0, window=3)
    with pytest.raises(ValueError, match="worker"):
        WorkerState(7, 2, 2, slots=2, payload=256, timeout=1.0)
    with pytest.raises(ValueError, match="timeout"):
        WorkerState(7, 0, 2, slots=2, payload=256, timeout=0.0)
    w = WorkerState(7, 0, 2, slots=2, payload=256, timeout=1.0)
    w.start_quantised(np.ones(10, np.int32), now=0.0)
    with pytest.raises(RuntimeError, match="in flight"):
        w.start_quantised(np.ones(10, np.int32), now=0.0)


def test_an_empty_vector_is_done_at_once() -> None:
    w = WorkerState(7, 0, 2, slots=2, payload=256, timeout=1.0)
    assert w.start_quantised(np.zeros(0, np.int32), now=0.0) == [] and w.done


def test_an_exponent_round_result_beyond_every_float64_is_ignored_not_raised() -> None:
    w = WorkerState(job=7, worker=0, workers=2, slots=2, payload=256, timeout=1.0)
    (h,) = headers(w.start(np.array([0.5, -2.0, 3.0]), now=0.0))
    assert h.flags & p.EXPONENT_ROUND and h.exponent == 2
    assert w.receive(answer(h, exponent=2000), now=0.0) == []  # no finite float64 has 2**2000
    assert w.ignored == 1
    sent = headers(w.receive(answer(h, exponent=2), now=0.0))  # the true maximum still completes the round
    assert w.scale_exponent == p.pow2_scale_exponent(2, 2) and sent and not sent[0].flags & p.EXPONENT_ROUND


def test_early_retransmission_follows_the_order_of_sending_once_per_chunk() -> None:
    """With ``fast = 2``: a chunk whose result is missing while the results of chunks sent two or
    more sends later arrive is sent again at once (once), the others only after their timeouts;
    a slot that fell behind is compared by when its chunk was sent, not by the chunk's index."""
    limits = p.Limits(job=7, workers=2, slots=4, elements=64)
    w = WorkerState(job=7, worker=0, workers=2, slots=4, payload=256, timeout=1.0, fast=2)
    first = [p.parse(d, limits)[0] for d in w.start_quantised(np.arange(64 * 12, dtype=np.int32), now=0.0)]
    assert [h.offset // 64 for h in first] == [0, 1, 2, 3]
    # chunk 0's result is lost; chunk 1's (one send later) is not enough to call it lost
    nxt = w.receive(answer(first[1], np.ones(64)), now=0.1)
    assert [p.parse(d, limits)[0].offset // 64 for d in nxt] == [5] and w.early == 0
    # chunk 2's result (two sends later): chunk 0 goes again, flagged, right after chunk 6
    out = [p.parse(d, limits)[0] for d in w.receive(answer(first[2], np.ones(64)), now=0.2)]
    assert [(h.offset // 64, bool(h.flags & p.RETRANSMISSION)) for h in out] == [(6, False), (0, True)]
    assert w.early == 1 == w.retransmissions and w.next_deadline() == 1.0  # chunk 3, sent at 0
    assert w.deadline[0] == 0.2 + 2.0  # backed off as after a timeout
    # chunk 3's result: chunk 0 is not sent early twice
    out = [p.parse(d, limits)[0] for d in w.receive(answer(first[3], np.ones(64)), now=0.3)]
    assert [h.offset // 64 for h in out] == [7] and w.early == 1
    # chunk 0 completes late; its next chunk (4) is the newest send, not "behind" chunks 5-7
    out = [p.parse(d, limits)[0] for d in w.receive(answer(first[0], np.ones(64)), now=0.4)]
    assert [h.offset // 64 for h in out] == [4] and w.early == 1
    assert w.tick(0.9) == []  # nothing else is due before the timeouts


def test_without_fast_only_timeouts_retransmit() -> None:
    limits = p.Limits(job=7, workers=2, slots=4, elements=64)
    w = WorkerState(job=7, worker=0, workers=2, slots=4, payload=256, timeout=1.0)
    first = [p.parse(d, limits)[0] for d in w.start_quantised(np.arange(64 * 12, dtype=np.int32), now=0.0)]
    for h in first[1:]:
        assert len(w.receive(answer(h, np.ones(64)), now=0.1)) == 1
    assert w.early == 0 == w.retransmissions
    with pytest.raises(ValueError, match="fast"):
        WorkerState(job=7, worker=0, workers=2, slots=4, payload=256, timeout=1.0, fast=-1)
