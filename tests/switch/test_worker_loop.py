"""The compiled worker loop: WorkerState's bytes exactly, and its socket path through a real switch."""

from __future__ import annotations

import os
import socket
import time

import numpy as np
import pytest

pytest.importorskip("hypothesis", reason="hypothesis is in the test extra: pip install -e '.[test]'")
from hpcdl._ext.workerloop import WorkerLoop  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from hpcdl._ext import workerloop  # noqa: E402
from hpcdl.parallel.switched import spawn_switch, stop_switch  # noqa: E402
from hpcdl.switch import SwitchState, WorkerState  # noqa: E402
from hpcdl.switch import protocol as p  # noqa: E402
from hpcdl.switch.client import SwitchUnreachable  # noqa: E402
from hpcdl.switch.udp import UdpSwitchClient  # noqa: E402

from .network import Network  # noqa: E402
from .test_fuzz import DATAGRAM  # noqa: E402

EXAMPLES = int(os.environ.get("HPCDL_FUZZ_EXAMPLES", "300")) // 3
JOB = 7


class Twin:
    """A WorkerState and a WorkerLoop fed the same calls; every answer and counter must agree."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.py = WorkerState(*args, **kwargs)
        self.c = WorkerLoop(*args, **kwargs)

    def _same(self, a: list[bytes], b: list[bytes]) -> list[bytes]:
        assert a == b
        py, c = self.py, self.c
        assert (py.results, py.retransmissions, py.ignored) == (c.results, c.retransmissions, c.ignored)
        assert py.early == c.early
        assert np.array_equal(py.malformed, c.malformed) and np.array_equal(py.use, c.use)
        assert py.done == c.done and py.next_deadline() == c.next_deadline()
        assert py.outstanding() == c.outstanding() and py.max_exponent == c.max_exponent
        assert np.array_equal(py.result, c.result)
        return a

    def start(self, exponent: int, now: float) -> list[bytes]:
        """The network's ``start``: here an exponent round (``start_exponent``)."""
        return self._same(self.py.start_exponent(exponent, now), self.c.start_exponent(exponent, now))

    def start_quantised(self, values: np.ndarray, now: float) -> list[bytes]:
        return self._same(self.py.start_quantised(values, now), self.c.start_quantised(values, now))

    def receive(self, data: bytes, now: float) -> list[bytes]:
        return self._same(self.py.receive(data, now), self.c.receive(data, now))

    def tick(self, now: float) -> list[bytes]:
        return self._same(self.py.tick(now), self.c.tick(now))

    def next_deadline(self) -> float:
        return self.py.next_deadline()

    @property
    def done(self) -> bool:
        return self.py.done


def answer(datagram: bytes, values: np.ndarray | None = None, exponent: int = 0, worker: int = p.ALL_WORKERS,
           extra: int = 0) -> bytes:  # fmt: skip
    """The switch's result for a contribution."""
    h, _ = p.parse(datagram, p.Limits(JOB, 2, 2, 64))
    flags = (h.flags & ~(p.CONTRIBUTION | p.RETRANSMISSION)) | p.RESULT | extra
    return p.encode(h._replace(flags=flags, worker=worker, exponent=exponent), values)


def test_constants_agree_with_the_python_worker() -> None:
    from hpcdl.switch.worker import MAX_BACKOFF

    assert MAX_BACKOFF == 6 and workerloop.IO_COUNTERS[2:8] == (
        "lost_out", "duplicated_out", "reordered_out", "lost_in", "duplicated_in", "reordered_in",
    )  # fmt: skip
    loop = WorkerLoop(JOB, 0, 2, 4, 256, 1e-3)
    assert loop.max_exponent == p.ZERO_EXPONENT and len(loop.malformed) == len(p.Malformed)
    assert loop.window == 4 and loop.done and loop.next_deadline() == float("inf")


def test_scripted_traffic_gives_the_same_bytes_counters_and_backoff() -> None:
    w = Twin(JOB, 1, 2, 2, 256, 0.5)
    first = w.start_quantised(np.arange(200, dtype=np.int32), now=0.0)
    assert len(first) == 2
    nxt = w.receive(answer(first[0], np.full(64, 3)), now=0.1)
    w.receive(answer(first[0], np.full(64, 3)), now=0.1)  # a duplicate: ignored
    w.receive(answer(first[1], np.full(64, 4), worker=0), now=0.1)  # unicast to another worker
    w.receive(answer(first[1], np.full(64, 4), worker=5), now=0.1)  # worker out of range: malformed
    w.receive(answer(first[1], np.full(64, 4))[:30], now=0.1)  # short
    w.receive(b"HS" + bytes(40), now=0.1)  # version 0
    for now in (0.59, 0.6, 1.0, 1.6, 2.6, 4.6, 8.6, 16.6, 40.0, 80.0):  # backoff, capped
        w.tick(now)
    last = w.receive(answer(first[1], np.full(64, 4), extra=p.RETRANSMISSION), now=80.1)
    w.receive(answer(nxt[0], np.full(64, 5)), now=80.2)
    w.receive(answer(last[0], np.full(8, 6)), now=80.2)
    assert w.done and w.c.result.tolist() == [3] * 64 + [4] * 64 + [5] * 64 + [6] * 8
    assert w.c.retransmissions > 6 and w.c.ignored == 2 and w.c.malformed.sum() == 3
    e = w.start(-5, now=81.0)
    w.receive(answer(e[0], exponent=-3), now=81.1)
    assert w.done and w.c.max_exponent == -3
    assert w.start_quantised(np.zeros(0, np.int32), now=82.0) == [] and w.done


def test_refuses_misuse_as_the_python_worker_does() -> None:
    bad = (({"window": 3}, "window"), ({"worker": 2}, "worker"), ({"timeout_s": 0.0}, "timeout"))
    for kwargs, match in bad:
        args = {"job": JOB, "worker": 0, "workers": 2, "slots": 2, "payload": 256, "timeout_s": 1.0, **kwargs}
        with pytest.raises(ValueError, match=match):
            WorkerLoop(**args)
    loop = WorkerLoop(JOB, 0, 2, 2, 256, 1.0)
    loop.start_quantised(np.ones(10, np.int32), now=0.0)
    with pytest.raises(RuntimeError, match="in flight"):
        loop.start_quantised(np.ones(10, np.int32), now=0.0)
    with pytest.raises(RuntimeError, match="attach"):
        loop.progress(0.0)


@settings(max_examples=max(EXAMPLES, 20), deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip
@given(
    seed=st.integers(0, 2**32 - 1),
    workers=st.integers(1, 3),
    window=st.integers(1, 4),
    lengths=st.lists(st.integers(0, 700), min_size=1, max_size=3),
    loss=st.sampled_from([0.0, 0.05, 0.3]),
    duplicate=st.sampled_from([0.0, 0.1]),
    jitter=st.sampled_from([0.0, 3.0]),
    late=st.sampled_from([0.0, 0.05]),
    garbage=st.lists(DATAGRAM, max_size=8),
    fast=st.sampled_from([0, 1, 2]),
)
def test_c_and_python_workers_agree_under_any_traffic(
    seed: int, workers: int, window: int, lengths: list[int], loss: float, duplicate: float, jitter: float,
    late: float, garbage: list[bytes], fast: int,
) -> None:  # fmt: skip
    """Every worker is a twin; the switch is the Python SwitchState; the network loses, duplicates,
    reorders and delivers late; garbage is fed to the workers between reductions."""
    payload, slots = 256, 4
    twins = [Twin(JOB, w, workers, slots, payload, 1e-3, window, fast=fast) for w in range(workers)]
    net = Network(SwitchState(workers, slots, payload, JOB), twins, np.random.default_rng(seed), loss=loss,
                  duplicate=duplicate, jitter=jitter, late=late, late_delay=5e-3)  # fmt: skip
    rng = np.random.default_rng(seed + 1)
    for n in lengths:
        for k, data in enumerate(garbage):
            net.send(k % workers, data)
        net.reduce([int(e) for e in rng.integers(-40, 40, workers)], quantised=False)  # exponent rounds
        vectors = [rng.integers(-(2**20), 2**20, n, dtype=np.int32) for _ in range(workers)]
        net.reduce(vectors, quantised=True)
        expect = sum(v.astype(np.int64) for v in vectors)
        for t in twins:
            assert np.array_equal(t.c.result, expect)
    net.drain()


@pytest.mark.timeout(60)
def test_a_reduction_is_summed_in_place_into_the_queued_vector() -> None:
    process, address = spawn_switch(2, 8, 256, 11)
    try:
        clients = [UdpSwitchClient(address, 11, w, 2, 8, 256, 2e-3, 10.0) for w in range(2)]
        vectors = [np.arange(5000, dtype=np.int32) * (w + 1) for w in range(2)]
        values = [v.copy() for v in vectors]
        reqs = [c.reduce(v, "bucket 0") for c, v in zip(clients, values)]
        _drive(reqs)
        for c, v in zip(clients, values):
            assert c.loop.result is v and np.array_equal(v, vectors[0] + vectors[1])
            assert c.datagrams_sent >= 79 and c.loop.counters()["received"] >= 79
            c.close()
    finally:
        stop_switch(process)


def _drive(reqs: list, limit: float = 60.0) -> None:
    t0 = time.monotonic()
    while not all([r.Test() or not r for r in reqs]):
        assert time.monotonic() - t0 < limit, "no progress"


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "faults",
    [{}, {"loss": 0.01}, {"loss": 0.1}, {"loss": 0.01, "duplicate": 0.05, "reorder": 0.1}],
    ids=["clean", "loss1", "loss10", "dup-reorder"],
)
@pytest.mark.parametrize("workers", [2, 3])
def test_the_fast_path_through_a_spawned_switch_gives_the_exact_int32_sum(faults: dict, workers: int) -> None:
    slots, payload, job = 16, 1024, 3
    process, address = spawn_switch(workers, slots, payload, job)
    try:
        clients = [UdpSwitchClient(address, job, w, workers, slots, payload, 2e-3, 20.0, seed=w, fast=4,
                                   **faults) for w in range(workers)]  # fmt: skip
        rng = np.random.default_rng(workers)
        sizes = (70_000, 1, 300)
        vectors = [[rng.integers(-(2**20), 2**20, n, dtype=np.int32) for n in sizes] for _ in range(workers)]
        exponents = rng.integers(-100, 100, workers)
        reqs = []
        for c, vs, e in zip(clients, vectors, exponents):
            reqs.append(c.exponent(int(e), "bucket 0", then=lambda r, v=vs[0]: v.copy()))
            reqs += [c.reduce(v.copy(), f"bucket {i}") for i, v in enumerate(vs[1:], start=1)]
        _drive(reqs)
        per = len(reqs) // workers
        for w in range(workers):
            mine = reqs[w * per : (w + 1) * per]
            assert mine[0].exponent == exponents.max()
            values = [mine[0].next.values] + [r.values for r in mine[1:]]
            for i, got in enumerate(values):
                assert np.array_equal(got, sum(vs[i].astype(np.int64) for vs in vectors))
        injected = {k: sum(c.injected[k] for c in clients) for k in clients[0].injected}
        if faults.get("loss", 0) >= 0.01:
            assert injected["lost_out"] + injected["lost_in"] > 0
            assert sum(c.loop.retransmissions for c in clients) > 0
        if faults.get("reorder"):
            assert injected["reordered_out"] > 0 and injected["reordered_in"] > 0
            assert injected["duplicated_out"] > 0 and injected["duplicated_in"] > 0
        if not faults:
            assert sum(injected.values()) == 0
        for c in clients:
            c.close()
    finally:
        stop_switch(process)


def test_the_fault_stream_is_seeded() -> None:
    """The same seed injects the same faults on the same traffic (no socket needed to tell)."""

    def faults(seed: int) -> dict:
        peer = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        peer.bind(("127.0.0.1", 0))
        peer.setblocking(False)
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.connect(peer.getsockname())
        sock.setblocking(False)
        loop = WorkerLoop(JOB, 0, 1, 64, 256, 10.0, loss=0.2, duplicate=0.2, reorder=0.2, seed=seed)
        loop.attach(sock.fileno())
        loop.queue_quantised(np.ones(64 * 64, np.int32))
        got = []
        while True:
            try:
                got.append(peer.recv(2048))
            except BlockingIOError:
                break
        loop.attach(-1)
        sock.close()
        peer.close()
        return {"got": got, **loop.injected}

    a, b, c = faults(1), faults(1), faults(2)
    assert a == b and a != c and a["lost_out"] > 0 and a["duplicated_out"] > 0 and a["reordered_out"] > 0


@pytest.mark.timeout(60)
def test_a_dead_address_raises_switch_unreachable_within_give_up() -> None:
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    probe.bind(("127.0.0.1", 0))
    address = f"127.0.0.1:{probe.getsockname()[1]}"
    probe.close()  # nobody listens there: the kernel answers with ICMP port unreachable
    client = UdpSwitchClient(address, JOB, 0, 2, 8, 256, 1e-3, 0.5)
    req = client.reduce(np.ones(1000, np.int32), "bucket 4")
    t0 = client.clock()
    with pytest.raises(SwitchUnreachable) as e:  # within give_up, not a hang (the test's timeout)
        req.Wait()
    assert client.clock() - t0 >= 0.5  # not before give_up, on the client's own clock
    text = str(e.value)
    assert address in text and "no result for 0.5 s" in text and "chunks 0-7" in text
    assert "not sent" in text and "of bucket 4" in text
    assert client.loop.retransmissions > 0  # backed off, still trying until give_up
    assert client.loop.counters()["refused"] > 0  # ICMP errors were counted, never raised
    client.close()


@pytest.mark.timeout(60)
def test_malformed_datagrams_on_the_socket_are_counted_not_raised() -> None:
    """A fake switch answers with garbage; the loop counts each by reason and keeps running."""
    fake = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    fake.bind(("127.0.0.1", 0))
    mine = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    mine.connect(fake.getsockname())
    mine.setblocking(False)
    fake.connect(mine.getsockname())
    loop = WorkerLoop(JOB, 0, 2, 2, 256, 10.0)
    loop.attach(mine.fileno())
    loop.queue_quantised(np.ones(300, np.int32))  # 5 chunks: slot 0 carries chunk 2 next
    first, _ = fake.recv(2048), fake.recv(2048)  # the window: chunks 0 and 1
    good = answer(first, np.full(64, 2))
    garbage = [b"", b"x" * 10, b"HS" + bytes(40), good[:-1], good + b"\0", good + bytes(5000), b"\xff" * 24]
    for data in garbage:
        fake.send(data)
    fake.send(good)
    for _ in range(20):
        loop.progress(0.01)
        if loop.results:
            break
    assert loop.results == 1 and loop.malformed.sum() == len(garbage)
    m = loop.malformed
    assert m[p.Malformed.SHORT] == 3 and m[p.Malformed.LENGTH] == 2 and m[p.Malformed.MAGIC] == 1
    assert m[p.Malformed.VERSION] == 1
    assert fake.recv(2048)[10:12] == b"\0\0"  # slot 0's next chunk went out
    loop.attach(-1)
    mine.close()
    fake.close()
