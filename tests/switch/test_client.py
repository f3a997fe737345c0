"""The worker's client (queued reductions, the exponent round's follow-up, giving up) and its faulty link.

W clients share one in-process switch through in-memory links; one thread drives them in turn
with non-blocking progress on a fake clock, so every run is a function of its seeds.
"""

from __future__ import annotations

import numpy as np
import pytest

from hpcdl.comm.pack import int32_exponent, int32_pow2_scale
from hpcdl.switch import MULTICAST, SwitchState, WorkerState
from hpcdl.switch.client import SwitchClient, SwitchUnreachable
from hpcdl.switch.transport import FaultyLink, parse_address


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Wire:
    """The switch and every worker's inbox; ``dead`` drops everything sent to the switch."""

    def __init__(self, switch: SwitchState, workers: int) -> None:
        self.switch = switch
        self.inbox: list[list[bytes]] = [[] for _ in range(workers)]
        self.dead = False

    def link(self, worker: int) -> MemLink:
        return MemLink(self, worker)


class MemLink:
    def __init__(self, wire: Wire, worker: int) -> None:
        self.wire, self.worker = wire, worker
        self.closed = False

    def send(self, data: bytes) -> None:
        if self.wire.dead:
            return
        for out in self.wire.switch.receive(data):
            targets = range(len(self.wire.inbox)) if out.dest == MULTICAST else [out.dest]
            for w in targets:
                self.wire.inbox[w].append(out.data)

    def poll(self, timeout: float) -> list[bytes]:
        got, self.wire.inbox[self.worker] = self.wire.inbox[self.worker], []
        return got

    def close(self) -> None:
        self.closed = True


def clients(workers: int, seed: int = 0, slots: int = 8, payload: int = 256, give_up: float = 1.0,
            **faults: float) -> tuple[list[SwitchClient], Wire, Clock]:  # fmt: skip
    clock = Clock()
    wire = Wire(SwitchState(workers, slots, payload, job=3), workers)
    out = []
    for w in range(workers):
        link = wire.link(w)
        if faults:
            link = FaultyLink(link, np.random.default_rng([seed, w]), **faults)
        state = WorkerState(3, w, workers, slots, payload, timeout=1e-3)
        out.append(SwitchClient(state, link, clock, give_up, "127.0.0.1:9"))
    return out, wire, clock


def drive(requests: list, clock: Clock, limit: float = 60.0) -> None:
    """Test every request in turn, 50 us of fake time per turn, until all are done."""
    while not all([r.Test() or not r for r in requests]):  # a list: every request progresses each turn
        clock.now += 5e-5
        assert clock.now < limit, "no progress"


@pytest.mark.parametrize("faults", [{}, {"loss": 0.1}, {"loss": 0.01, "duplicate": 0.05, "reorder": 0.1}])
def test_queued_reductions_give_exact_sums_in_order(faults: dict) -> None:
    rng = np.random.default_rng(1)
    workers = 3
    cs, _, clock = clients(workers, seed=2, **faults)
    sizes = (1000, 1, 130)
    vectors = [[rng.integers(-(2**20), 2**20, n, dtype=np.int32) for n in sizes] for _ in range(workers)]
    expect = [sum(v[i].astype(np.int64) for v in vectors) for i in range(3)]
    reqs = [[c.reduce(v.copy(), f"bucket {i}") for i, v in enumerate(vs)] for c, vs in zip(cs, vectors)]
    drive([r for rs in reqs for r in rs], clock)
    for rs in reqs:
        for r, e in zip(rs, expect):
            assert np.array_equal(r.values, e)
    if faults.get("loss", 0) >= 0.05:
        assert sum(c.state.retransmissions for c in cs) > 0
        assert sum(c.link.injected["lost_out"] + c.link.injected["lost_in"] for c in cs) > 0


def quantise(g: np.ndarray, workers: int) -> object:
    """The data round after an exponent round: ``g`` at the scale of the workers' maximum."""
    return lambda r: np.rint(g * int32_pow2_scale(r.exponent, workers)).astype(np.int32)


def test_an_exponent_round_is_followed_by_its_data_before_anything_queued_after_it() -> None:
    """The ring's rule through the switch: max exponent, then the bucket at 2**k, bitwise."""
    rng = np.random.default_rng(4)
    workers = 3
    cs, _, clock = clients(workers, seed=5, loss=0.05, reorder=0.05)
    grads = [[rng.standard_normal(n) * s for n, s in ((300, 1e-3), (70, 40.0))] for _ in range(workers)]
    buckets = []
    for c, gs in zip(cs, grads):
        mine = []
        for b, g in enumerate(gs):
            e = int32_exponent(float(np.abs(g).max()))
            mine.append(c.exponent(e, f"bucket {b}", then=quantise(g, workers)))
        buckets.append(mine)
    while not all(r.next is not None and r.next.done for rs in buckets for r in rs):
        for c in cs:
            c.progress(block=False)
        clock.now += 5e-5
        assert clock.now < 60.0, "no progress"
    for b in range(2):
        top = max(int32_exponent(float(np.abs(gs[b]).max())) for gs in grads)
        scale = int32_pow2_scale(top, workers)
        expect = sum(np.rint(gs[b] * scale).astype(np.int64) for gs in grads)
        for rs in buckets:
            assert rs[b].exponent == top
            assert np.array_equal(rs[b].next.values, expect)


def test_a_silent_switch_fails_every_worker_naming_it_and_the_chunks() -> None:
    cs, wire, clock = clients(2, give_up=0.5)
    wire.dead = True
    reqs = [c.reduce(np.ones(1000, np.int32), "bucket 0") for c in cs]
    with pytest.raises(SwitchUnreachable) as e:
        drive(reqs, clock)
    text = str(e.value)
    assert "127.0.0.1:9" in text and "0.5 s" in text and "chunks 0-7 in flight" in text
    assert "and 0 not sent" not in text and "not sent" in text  # 1000 / 64 = 16 chunks: 8 unsent
    assert clock.now == pytest.approx(0.5, abs=1e-3)


def test_a_switch_dying_mid_reduction_fails_it_within_the_timeout() -> None:
    cs, wire, clock = clients(2, give_up=0.25)
    reqs = [c.reduce(np.arange(5000, dtype=np.int32), "bucket 1") for c in cs]
    for _ in range(4):  # some results arrive (a window of 8 of the 79 chunks a turn), then the switch dies
        for r in reqs:
            r.Test()
        clock.now += 5e-5
    wire.dead = True
    died = clock.now
    assert 0 < cs[0].state.results < 79
    with pytest.raises(SwitchUnreachable, match="of bucket 1"):
        drive(reqs, clock)
    assert clock.now - died <= 0.25 + 1e-3


def test_faulty_link_rates_and_reordering_are_seeded() -> None:
    sent: list[bytes] = []

    class Sink:
        def send(self, data: bytes) -> None:
            sent.append(data)

        def poll(self, timeout: float) -> list[bytes]:
            return []

        def close(self) -> None:
            pass

    link = FaultyLink(Sink(), np.random.default_rng(9), loss=0.1, duplicate=0.1, reorder=0.1)
    for i in range(20000):
        link.send(i.to_bytes(4, "little"))
    link.poll(0)  # flushes what is held back
    got = [int.from_bytes(d, "little") for d in sent]
    inj = link.injected
    assert len(got) == 20000 - inj["lost_out"] + inj["duplicated_out"]
    assert 0.08 < inj["lost_out"] / 20000 < 0.12 and 0.07 < inj["duplicated_out"] / 20000 < 0.11
    assert inj["reordered_out"] > 0 and sum(a > b for a, b in zip(got, got[1:])) == inj["reordered_out"]
    again: list[bytes] = []
    sent, keep = again, sent
    link2 = FaultyLink(Sink(), np.random.default_rng(9), loss=0.1, duplicate=0.1, reorder=0.1)
    for i in range(20000):
        link2.send(i.to_bytes(4, "little"))
    link2.poll(0)
    assert again == keep


def test_parse_address() -> None:
    assert parse_address("127.0.0.1:5000") == ("127.0.0.1", 5000)
    assert parse_address("[::1]:7") == ("::1", 7)
    for bad in ("127.0.0.1", ":80", "host:0", "host:x", "host:70000"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            parse_address(bad)
