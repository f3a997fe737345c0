"""The Cython packet loop (``hpcdl._ext.switchloop``) and the switch program over real UDP.

``SwitchLoop.receive`` must equal ``SwitchState.receive`` byte for byte and counter for counter:
both are driven, in lockstep, by the in-memory network's traffic (loss, duplicates,
reordering, late datagrams, use numbers wrapping past 2**32, overflow) and by malformed
datagrams. The program ``python -m hpcdl.switch`` is then run as a subprocess on loopback:
W ``WorkerState`` instances over their own UDP sockets get exact int32 sums (also when they
drop datagrams), malformed datagrams are counted, bad arguments exit 2 with one line, and
``--parent-pid`` ends it.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from hpcdl.switch import Counter, SwitchState, WorkerState
from hpcdl.switch import protocol as p
from hpcdl.switch.protocol import INT32_LIMIT

from .network import SWITCH, make
from .test_network import FAULTS

switchloop = pytest.importorskip(
    "hpcdl._ext.switchloop", reason="the packet loop is not built: pip install -e ."
)
SwitchLoop = switchloop.SwitchLoop
ROOT = Path(__file__).resolve().parents[2]


class Twin:
    """A SwitchState and a SwitchLoop fed the same datagrams; every answer must agree."""

    def __init__(self, workers: int, slots: int, payload: int, job: int) -> None:
        self.state = SwitchState(workers, slots, payload, job)
        self.loop = SwitchLoop(workers, slots, payload, job)
        self.datagrams = 0

    def receive(self, data: bytes) -> list:
        expected = self.state.receive(data)
        got = self.loop.receive(data)
        assert got == [(s.dest, s.data) for s in expected], f"datagram {self.datagrams}: {data.hex()}"
        self.datagrams += 1
        return expected

    def counters(self) -> dict[str, int]:
        return self.state.counters()

    def check(self) -> None:
        np.testing.assert_array_equal(self.loop.count, self.state.count)
        np.testing.assert_array_equal(self.loop.malformed, self.state.malformed)
        arrays = self.loop.arrays()
        np.testing.assert_array_equal(arrays["sums"], self.state.sums.ravel())
        np.testing.assert_array_equal(arrays["seen"], self.state.seen.ravel())
        for name in ("contributors", "state", "use", "offset", "elems", "exponent"):
            np.testing.assert_array_equal(arrays[name], getattr(self.state, name).ravel(), err_msg=name)
        np.testing.assert_array_equal(arrays["exp_round"], self.state.exponent_round.ravel())
        named = self.loop.counters()
        assert {k: named[k] for k in self.state.counters()} == self.state.counters()


def test_names_follow_the_enums() -> None:
    """The loop's counter arrays are in Counter and Malformed order."""
    assert switchloop.COUNTERS == tuple(c.name.lower() for c in Counter)
    loop = SwitchLoop(2, 4, 256, 1)
    assert [k for k in loop.counters() if k.startswith("malformed_")] == [
        f"malformed_{m.name.lower()}" for m in p.Malformed
    ]
    assert len(loop.count) == len(Counter) and len(loop.malformed) == len(p.Malformed)


def _mutate(rng: np.random.Generator, data: bytes) -> bytes:
    """A datagram broken one way or another (or, sometimes, left well formed)."""
    kind = rng.integers(6)
    b = bytearray(data)
    if kind == 0:
        return bytes(b[: rng.integers(len(b))])  # truncated
    if kind == 1:
        return bytes(b) + bytes(rng.integers(0, 256, rng.integers(1, 9), dtype=np.uint8))  # extended
    if kind == 2:
        return rng.integers(0, 256, rng.integers(0, 80), dtype=np.uint8).tobytes()  # noise
    if kind == 3:  # a flag, a field or a payload byte changed
        i = rng.integers(len(b))
        b[i] ^= 1 << rng.integers(8)
        return bytes(b)
    if kind == 4:  # a result sent to the switch
        b[3] = (b[3] & ~p.CONTRIBUTION) | p.RESULT
        return bytes(b)
    b[4:8] = (0xFFFFFFFF).to_bytes(4, "little")  # another job
    return bytes(b)


#: (workers, fault): every fault mix at 1 and 3 workers; the harshest one beyond 64 workers (two bitmap words)
CASES = [(w, f) for w in (1, 3) for f in FAULTS] + [(70, FAULTS[0]), (70, FAULTS[-1])]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("workers", "fault"), CASES, ids=[f"{w}-{f[0]}" for w, f in CASES])
def test_receive_equals_switch_state(workers: int, fault: tuple) -> None:
    """Network traffic with faults, malformed datagrams mixed in, uses wrapping past 2**32."""
    _, loss, duplicate, jitter, late = fault
    payload = 256
    net = make(workers, 3, payload, seed=workers, loss=loss, duplicate=duplicate, jitter=jitter,
               late=late, late_delay=5e-3)  # fmt: skip
    twin = Twin(workers, 3, payload, net.switch.job)
    net.switch = twin
    rng = np.random.default_rng(workers)
    for w in net.workers:
        w.use[:] = 2**32 - 2  # the slots' uses wrap around during the run
    seen: list[bytes] = []
    broken = 0
    deliver = net.deliver

    def deliver_and_break(dest: int, data: bytes) -> None:
        nonlocal broken
        if dest == SWITCH:
            seen.append(data)
            bad = _mutate(rng, data)
            parsed = p.parse(bad, twin.state.limits)
            # during the reductions, only datagrams that cannot be summed (a valid-looking
            # corruption would be, as it would on a network without checksums)
            if rng.random() < 0.1 and (
                isinstance(parsed, p.Malformed) or not parsed[0].flags & p.CONTRIBUTION
            ):
                twin.receive(bad)
                broken += 1
        deliver(dest, data)

    net.deliver = deliver_and_break
    bound = INT32_LIMIT // workers
    lengths = (200, 37) if workers > 64 else (200, 37, 1, 150)
    for length in lengths:
        vectors = [rng.integers(-bound, bound + 1, length).astype(np.int32) for _ in range(workers)]
        net.reduce(vectors, quantised=True)
        for w in net.workers:
            np.testing.assert_array_equal(w.result, np.sum(vectors, axis=0, dtype=np.int64).astype(np.int32))
    net.reduce([rng.normal(0, 1e-3, 100) for _ in range(workers)], quantised=False)  # an exponent round
    net.drain()
    for i in rng.integers(len(seen), size=100):  # very late copies, and broken ones of any kind
        twin.receive(seen[i])
        twin.receive(_mutate(rng, seen[i]))
    assert twin.datagrams == len(seen) + broken + 200
    twin.check()


@pytest.mark.timeout(30)
def test_overflow_and_mismatch_agree() -> None:
    """Contributions that break the scale rule saturate alike; a changed chunk is a mismatch alike."""
    twin = Twin(2, 2, 256, 5)
    big = np.full(64, INT32_LIMIT, np.int32)
    for w in range(2):
        twin.receive(p.encode(p.Header(p.CONTRIBUTION, 5, w, 0, 0, 0, 64), big))
        twin.receive(p.encode(p.Header(p.CONTRIBUTION, 5, w, 1, 0, 0, 64), -big - 1))
    twin.receive(p.encode(p.Header(p.CONTRIBUTION, 5, 0, 0, 1, 64, 10), big[:10]))
    twin.receive(p.encode(p.Header(p.CONTRIBUTION, 5, 1, 0, 1, 128, 10), big[:10]))  # another offset
    twin.receive(p.encode(p.Header(p.CONTRIBUTION | p.RETRANSMISSION, 5, 1, 0, 0, 0, 64), big))  # shadow
    twin.receive(b"")
    assert twin.state.count[Counter.OVERFLOW] == 2 and twin.state.count[Counter.MISMATCH] == 1
    assert twin.state.count[Counter.RETRANSMITTED_RESULTS] == 1
    twin.check()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("gso", [True, False])
def test_serve_sends_what_switch_state_answers(gso: bool) -> None:
    """serve() on a real socket: one recvmmsg batch in, every worker gets SwitchState's answers in order."""
    n, slots, payload, job = 3, 16, 256, 2
    elements = payload // 4
    state, loop = SwitchState(n, slots, payload, job), SwitchLoop(n, slots, payload, job, batch=64, gso=gso)
    rng = np.random.default_rng(5)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as switch:
        switch.bind(("127.0.0.1", 0))
        switch.setblocking(False)
        socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(n)]
        expected: list[list[bytes]] = [[] for _ in range(n)]

        def send_all(datagrams: list[tuple[int, bytes]]) -> None:
            for w, data in datagrams:
                socks[w].sendto(data, switch.getsockname())
                for out in state.receive(data):
                    for dest in range(n) if out.dest == -1 else [out.dest]:
                        expected[dest].append(out.data)
            loop.serve(switch.fileno(), 100.0)

        def received(w: int) -> list[bytes]:
            out = []
            socks[w].setblocking(False)
            with contextlib.suppress(BlockingIOError):
                while True:
                    out.append(socks[w].recv(4096))
            return out

        try:
            traffic = []
            for w in range(n):
                for s in range(slots):
                    count = elements if s % 5 else 1 + s  # some short chunks: GSO runs break on size
                    flags = p.CONTRIBUTION | (p.EXPONENT_ROUND if s == 7 else 0)
                    count = 0 if s == 7 else count
                    values = rng.integers(-1000, 1000, count).astype(np.int32)
                    traffic.append((w, p.encode(p.Header(flags, job, w, s, 0, 0, count, w), values)))
            send_all(traffic)
            send_all([(1, traffic[slots + 13][1])])  # a lost result asked again: unicast to worker 1
            assert expected[1][-1][3] & p.RETRANSMISSION
            for w in range(n):
                assert received(w) == expected[w]
        finally:
            for s in socks:
                s.close()
    counters = loop.counters()
    assert {k: counters[k] for k in state.counters()} == state.counters()
    assert counters["send_failed"] == counters["no_address"] == 0
    assert (counters["gso_messages"] > 0) == gso


# --- the program over UDP on loopback ---------------------------------------------------------


def _env() -> dict[str, str]:
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


class Program:
    """``python -m hpcdl.switch`` as a subprocess, its stdout in a file."""

    def __init__(self, tmp: Path, *args: str) -> None:
        self.ready, self.stats, self.out = tmp / "ready", tmp / "stats.json", tmp / "out.txt"
        command = [sys.executable, "-m", "hpcdl.switch", "--port", "0", "--ready-file", str(self.ready),
                   "--stats-json", str(self.stats), *args]  # fmt: skip
        with open(self.out, "w") as out:
            self.proc = subprocess.Popen(command, stdout=out, stderr=subprocess.PIPE, text=True, env=_env())
        deadline = time.monotonic() + 20
        while not self.ready.exists():
            assert self.proc.poll() is None, self.proc.stderr.read()
            assert time.monotonic() < deadline, "the switch did not write its ready file"
            time.sleep(0.01)
        host, port = self.ready.read_text().rsplit(":", 1)
        self.address = (host, int(port))

    def output(self, needle: str, timeout: float = 10.0) -> str:
        """Wait until stdout holds ``needle``; return it all."""
        deadline = time.monotonic() + timeout
        while needle not in (text := self.out.read_text()):
            assert time.monotonic() < deadline, f"{needle!r} not printed: {text}"
            time.sleep(0.02)
        return text

    def stop(self) -> dict:
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(timeout=10) == 0, self.proc.stderr.read()
        return json.loads(self.stats.read_text())

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def program(tmp_path: Path):
    made: list[Program] = []

    def start(*args: str) -> Program:
        made.append(Program(tmp_path, *args))
        return made[-1]

    yield start
    for prog in made:
        prog.kill()


def _reduce_over_udp(address: tuple, workers: list[WorkerState], vectors: list, quantised: bool,
                     drop: float, rng: np.random.Generator, limit: float = 15.0) -> None:  # fmt: skip
    """Run one reduction: each worker on its own socket, dropping ``drop`` of its datagrams both ways."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in workers]
    try:
        for s in socks:
            s.connect(address)
            s.setblocking(False)

        def send(s: socket.socket, datagrams: list[bytes]) -> None:
            for data in datagrams:
                if rng.random() >= drop:
                    s.send(data)

        now = time.monotonic()
        for s, w, v in zip(socks, workers, vectors):
            send(s, (w.start_quantised if quantised else w.start)(v, now))
        deadline = now + limit
        while not all(w.done for w in workers):
            now = time.monotonic()
            assert now < deadline, "the reduction over UDP did not finish"
            wait = max(0.0, min(min(w.next_deadline() for w in workers) - now, 0.05))
            readable, _, _ = select.select(socks, [], [], wait)
            now = time.monotonic()
            for s in readable:
                w = workers[socks.index(s)]
                while True:
                    try:
                        data = s.recv(4096)
                    except BlockingIOError:
                        break
                    if rng.random() >= drop:
                        send(s, w.receive(data, now))
            for s, w in zip(socks, workers):
                send(s, w.tick(now))
    finally:
        for s in socks:
            s.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("drop", "gso"), [(0.0, "--gso"), (0.1, "--gso"), (0.1, "--no-gso")])
def test_program_sums_exactly_over_udp(program, drop: float, gso: str) -> None:
    """3 workers over loopback: exact int32 sums (a float reduction too), with and without drops."""
    n, slots, payload, job = 3, 8, 256, 9
    prog = program(
        "--workers", str(n), "--slots", str(slots), "--payload", str(payload), "--job", str(job), gso
    )
    workers = [WorkerState(job, w, n, slots, payload, timeout=0.02) for w in range(n)]
    rng = np.random.default_rng(3)
    bound = INT32_LIMIT // n
    chunks = 0
    for length in (1000, 65, 1):
        vectors = [rng.integers(-bound, bound + 1, length).astype(np.int32) for _ in range(n)]
        _reduce_over_udp(prog.address, workers, vectors, True, drop, rng)
        expected = np.sum(vectors, axis=0, dtype=np.int64).astype(np.int32)
        for w in workers:
            np.testing.assert_array_equal(w.result, expected)
        chunks += -(-length // (payload // 4))
    grads = [rng.normal(0, 1.0, 300) for _ in range(n)]
    _reduce_over_udp(prog.address, workers, grads, False, drop, rng)
    k = workers[0].scale_exponent
    ints = [np.rint(np.ldexp(g, k)).astype(np.int64) for g in grads]
    for w in workers:
        np.testing.assert_array_equal(w.result, np.sum(ints, axis=0).astype(np.int32))
    stats = prog.stop()
    c = stats["counters"]
    chunks += 1 + -(-300 // (payload // 4))  # the float's exponent round and its chunks
    assert c["summed"] == n * chunks and c["completed"] == chunks
    assert c["exponent_rounds"] == 1 and c["malformed"] == c["overflow"] == 0
    if drop:
        assert sum(w.retransmissions for w in workers) > 0
    else:
        assert c["retransmitted_results"] == c["duplicates"] == 0
    assert stats["workers"] == n and stats["batch"] == 64 and stats["cpu_user_s"] >= 0
    assert stats["gso"] == (gso == "--gso") and c["send_failed"] == c["no_address"] == 0


@pytest.mark.timeout(30)
def test_program_counts_malformed(program) -> None:
    """Malformed datagrams: counted by reason, printed on SIGUSR1, in --stats-json at SIGTERM."""
    prog = program("--workers", "2", "--job", "4", "--batch", "1")
    assert "hpcdl switch: listening on 127.0.0.1:" in prog.output("listening")
    good = p.encode(p.Header(p.CONTRIBUTION, 4, 0, 0, 0, 0, 3), np.arange(3, dtype=np.int32))
    bad = [b"short", b"\x00" * 24 + good[24:], good[:4] + (5).to_bytes(4, "little") + good[8:], good + b"x"]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for data in bad:
            s.sendto(data, prog.address)
        s.sendto(good, prog.address)
        deadline = time.monotonic() + 10
        while True:  # the counters are read only once all five datagrams were served
            prog.proc.send_signal(signal.SIGUSR1)
            text = prog.output("SIGUSR1")
            if "packets in 5 " in text:
                break
            assert time.monotonic() < deadline, text
            time.sleep(0.1)
    assert "malformed 4 (short 1, length 1, magic 1, job 1)" in text
    assert prog.proc.poll() is None  # SIGUSR1 printed and went on
    c = prog.stop()["counters"]
    assert (c["malformed_short"], c["malformed_magic"], c["malformed_job"], c["malformed_length"]) == (
        1,
        1,
        1,
        1,
    )
    assert c["malformed"] == 4 and c["summed"] == 1 and c["packets_in"] == 5


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpcdl.switch", *args], check=False, capture_output=True,
                          text=True, timeout=20, env=_env())  # fmt: skip


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("args", "says"),
    [
        ((), "--workers"),
        (("--workers", "0"), "--workers: must be in 1 .. 65534 (got 0)"),
        (("--workers", "2", "--payload", "512"), "--payload"),
        (("--workers", "2", "--port", "70000"), "--port"),
        (("--workers", "2", "--batch", "x"), "--batch: must be an integer"),
        (("--workers", "2", "--stats-json", "/nonexistent/dir/s.json"), "--stats-json"),
        (("--workers", "2", "--bind", "no.such.host.invalid"), "--bind"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(args: tuple, says: str) -> None:
    done = _run(*args)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and lines[0].startswith("python -m hpcdl.switch: error:"), (
        lines
    )


@pytest.mark.timeout(30)
def test_port_in_use_exits_2() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as taken:
        taken.bind(("127.0.0.1", 0))
        done = _run("--workers", "2", "--port", str(taken.getsockname()[1]))
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "is in use" in lines[0], lines


@pytest.mark.timeout(30)
def test_parent_pid_gone_ends_the_switch(program) -> None:
    parent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        prog = program("--workers", "2", "--parent-pid", str(parent.pid))
        time.sleep(0.3)
        assert prog.proc.poll() is None  # the parent is alive: it serves on
    finally:
        parent.kill()
        parent.wait()  # reaped: the pid is gone
    assert prog.proc.wait(timeout=10) == 0
    assert f"parent {parent.pid} gone" in prog.out.read_text()
    assert prog.stats.exists()
