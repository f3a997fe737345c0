"""``bench switch``: packets/s and CPU per packet of ``python -m hpcdl.switch``, batched vs one per call.

For each repetition, worker count W and ``--batch`` setting, the switch program is started
as a subprocess on loopback (``--port 0 --ready-file``, ``--parent-pid`` this process) and a
load generator in this process (:func:`hpcdl._ext.switchloop.generate`: W emulated workers,
each on its own UDP socket, a window of chunks in flight, the next chunk of a slot sent when
its result arrives, ``recvmmsg`` batches, each worker's contributions of one call sent as one
UDP GSO message so that the load costs less CPU than the switch) drives it for ``--seconds``. The
switch's own ``--stats-json`` gives its counters, packets per second in + out between its
first and last datagram, and its CPU seconds (``getrusage`` user + sys since it listened).
Figures are medians over ``--repeat`` interleaved repetitions; the reference beside each is
the same switch with ``--batch 1`` (one datagram per system call) and with ``--no-gso`` (a
``sendmmsg`` entry per datagram, no UDP segmentation offload), and, without sockets,
:class:`~hpcdl.switch.SwitchState` (Python) and ``SwitchLoop.receive`` (Cython) in process.
"""

from __future__ import annotations

import datetime
import json
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from hpcdl.atomic import check_writable, write_text_atomic
from hpcdl.comm import world
from hpcdl.comm.machine import cpu_model
from hpcdl.driver.cli import positive_float, positive_int
from hpcdl.errors import ConfigError
from hpcdl.sim.network import PRESETS, load_network, network_toml, parse_network
from hpcdl.switch import SwitchState
from hpcdl.switch import protocol as p

__all__ = ["add_parser", "bench_switch", "run"]

#: the issue's target: packets per second in + out at 2 workers
TARGET_PPS = 500_000
JOB = 1
_READY_TIMEOUT_S = 30.0


def _loop_class() -> Any:
    try:
        from hpcdl._ext.switchloop import SwitchLoop, generate
    except ImportError:
        raise ConfigError(
            "bench switch needs the packet loop hpcdl._ext.switchloop: run pip install -e ."
        ) from None
    return SwitchLoop, generate


def _start_switch(
    workers: int, slots: int, payload: int, batch: int, gso: bool, tmp: Path
) -> tuple[subprocess.Popen, str, Path]:
    """Start the switch program; wait for its ready file. Returns (process, HOST:PORT, stats path)."""
    ready, stats = tmp / "ready", tmp / "stats.json"
    for f in (ready, stats):
        f.unlink(missing_ok=True)
    command = [
        sys.executable,
        "-m",
        "hpcdl.switch",
        "--workers",
        str(workers),
        "--port",
        "0",
        "--slots",
        str(slots),
        "--payload",
        str(payload),
        "--job",
        str(JOB),
        "--batch",
        str(batch),
        "--gso" if gso else "--no-gso",
        "--ready-file",
        str(ready),
        "--stats-json",
        str(stats),
        "--parent-pid",
        str(os.getpid()),
    ]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + _READY_TIMEOUT_S
    while not ready.exists():
        if proc.poll() is not None:
            raise ConfigError(f"the switch program exited ({proc.returncode}): {proc.stderr.read().strip()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise ConfigError(
                f"the switch program was not listening after {_READY_TIMEOUT_S:.0f} s: "
                "is the machine overloaded?"
            )
        time.sleep(0.01)
    return proc, ready.read_text().strip(), stats


def _one(
    workers: int, slots: int, payload: int, batch: int, gso: bool, window: int, seconds: float, tmp: Path
) -> dict[str, Any]:
    """One switch process under ``seconds`` of generated load: its stats and the generator's."""
    _, generate = _loop_class()
    proc, address, stats_path = _start_switch(workers, slots, payload, batch, gso, tmp)
    host, port = address.rsplit(":", 1)
    socks = []
    try:
        for _ in range(workers):
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * 2**20)
            s.connect((host, int(port)))
            s.setblocking(False)
            socks.append(s)
        before = resource.getrusage(resource.RUSAGE_SELF)
        load = generate(
            [s.fileno() for s in socks],
            workers,
            slots,
            payload,
            JOB,
            seconds * 1e3,
            window=window,
            batch=64,
            gso=True,
        )
        after = resource.getrusage(resource.RUSAGE_SELF)
        load["cpu_s"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    finally:
        for s in socks:
            s.close()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.returncode != 0 or not stats_path.exists():
        raise ConfigError(f"the switch program failed ({proc.returncode}): {proc.stderr.read().strip()}")
    stats = json.loads(stats_path.read_text())
    return {"switch": stats, "load": load}


def _in_process(workers: int, slots: int, payload: int, seconds: float) -> dict[str, float]:
    """Datagrams per second through SwitchState.receive and SwitchLoop.receive, no sockets."""
    switch_loop, _ = _loop_class()
    elements = payload // 4
    rounds = 8
    packets = [
        p.encode(
            p.Header(p.CONTRIBUTION, JOB, w, s, r, s * elements, elements), np.full(elements, w + 1, np.int32)
        )
        for r in range(rounds)
        for s in range(slots)
        for w in range(workers)
    ]
    rates = {}
    for name, make in (
        ("python", lambda: SwitchState(workers, slots, payload, JOB)),
        ("cython", lambda: switch_loop(workers, slots, payload, JOB)),
    ):
        done, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            state = make()  # fresh: the uses run 0 .. rounds-1 again
            for data in packets:
                state.receive(data)
            done += len(packets)
        rates[name] = done / (time.perf_counter() - t0)
    return rates


def bench_switch(
    workers: list[int],
    batches: list[int],
    payload: int = 1024,
    slots: int = 256,
    window: int = 256,
    seconds: float = 2.0,
    repeat: int = 3,
) -> list[dict[str, Any]]:
    """Median packets/s (in + out) and CPU µs per packet of the switch per (W, batch, GSO).

    Each batch above 1 runs with GSO sends (the default) and without (``--no-gso``, plain
    ``sendmmsg`` of one entry per datagram); batch 1 without (one datagram, nothing to coalesce).

    Args:
        workers: the W settings.
        batches: the ``--batch`` settings (1 is the one-datagram-per-call reference).
        payload: payload bytes per datagram.
        slots: the switch's slots.
        window: chunks in flight per emulated worker (at most ``slots``).
        seconds: generated load per measurement.
        repeat: interleaved repetitions (medians reported).

    Returns:
        One row per (W, batch, GSO).
    """
    settings = [(b, g) for b in batches for g in ((True, False) if b > 1 else (False,))]
    samples: dict[tuple[int, int, bool], list[dict[str, Any]]] = {
        (w, b, g): [] for w in workers for b, g in settings
    }
    with tempfile.TemporaryDirectory(prefix="hpcdl-bench-switch-") as tmp:
        for _ in range(repeat):
            for w in workers:
                for b, g in settings:
                    samples[w, b, g].append(_one(w, slots, payload, b, g, window, seconds, Path(tmp)))
    reference = _in_process(min(workers), slots, payload, min(seconds, 1.0))
    machine = cpu_model()
    rows = []
    for (w, b, g), runs in samples.items():
        counters = [r["switch"]["counters"] for r in runs]
        total = [c["packets_in"] + c["packets_out"] for c in counters]
        pps = [r["switch"]["packets_per_s"] for r in runs]
        cpu_us = [r["switch"]["serve_cpu_s"] / n * 1e6 if n else float("nan") for r, n in zip(runs, total)]
        # per datagram received, the answers it causes included: what the simulator's [switch] charges
        cpu_us_in = [
            r["switch"]["serve_cpu_s"] / c["packets_in"] * 1e6 if c["packets_in"] else float("nan")
            for r, c in zip(runs, counters)
        ]
        rows.append(
            {
                "workers": w,
                "batch": b,
                "gso": g,
                "payload": payload,
                "slots": slots,
                "window": window,
                "seconds": seconds,
                "repeat": repeat,
                "packets_per_s": statistics.median(pps),
                "packets_per_s_in": statistics.median(r["switch"]["packets_per_s_in"] for r in runs),
                "packets_per_s_out": statistics.median(r["switch"]["packets_per_s_out"] for r in runs),
                "cpu_us_per_packet": statistics.median(cpu_us),
                "cpu_us_per_packet_in": statistics.median(cpu_us_in),
                "recv_batch": statistics.median(c["packets_in"] / max(1, c["recv_calls"]) for c in counters),
                "switch_cpu_share": statistics.median(
                    r["switch"]["serve_cpu_s"] / max(1e-9, r["switch"]["active_s"]) for r in runs
                ),
                "load_cpu_share": statistics.median(r["load"]["cpu_s"] / r["load"]["seconds"] for r in runs),
                "retransmissions": statistics.median(r["load"]["retransmissions"] for r in runs),
                "bad_results": sum(r["load"]["bad"] for r in runs),
                "send_failed": sum(c["send_failed"] for c in counters),
                "samples_packets_per_s": pps,
                "reference_python_receive_per_s": reference["python"],
                "reference_cython_receive_per_s": reference["cython"],
                "target_packets_per_s": TARGET_PPS,
                "cpu": machine,
                "cores": os.cpu_count(),
            }
        )
    for row in rows:
        one = [r for r in rows if r["workers"] == row["workers"] and r["batch"] == 1]
        row["gain_over_batch_1"] = row["packets_per_s"] / one[0]["packets_per_s"] if one else None
    return rows


def print_rows(rows: list[dict[str, Any]]) -> None:
    """The table, the references, the target and the machine."""
    r0 = rows[0]
    print(
        f"bench switch: python -m hpcdl.switch on loopback, payload {r0['payload']} B, slots {r0['slots']}, "
        f"window {r0['window']} per worker, {r0['seconds']:g} s per run, median of {r0['repeat']} "
        f"interleaved repetitions"
    )
    print(
        f"{'workers':>7}{'batch':>6}{'gso':>5}{'pkt/s in+out':>14}{'in':>10}{'out':>10}{'CPU us/pkt':>11}"
        f"{'recv batch':>11}{'switch CPU':>11}{'load CPU':>9}{'vs batch 1':>11}{'retrans':>8}"
    )
    for r in rows:
        gain = f"{r['gain_over_batch_1']:.2f}x" if r["gain_over_batch_1"] else "-"
        gso = "on" if r["gso"] else "off"
        print(
            f"{r['workers']:>7}{r['batch']:>6}{gso:>5}{r['packets_per_s']:>14,.0f}{r['packets_per_s_in']:>10,.0f}"
            f"{r['packets_per_s_out']:>10,.0f}{r['cpu_us_per_packet']:>11.2f}{r['recv_batch']:>11.1f}"
            f"{r['switch_cpu_share']:>11.0%}{r['load_cpu_share']:>9.0%}{gain:>11}{r['retransmissions']:>8.0f}"
        )
    print(
        f"reference, in process without sockets ({min(r['workers'] for r in rows)} workers): "
        f"SwitchState.receive {r0['reference_python_receive_per_s']:,.0f} datagrams/s (Python), "
        f"SwitchLoop.receive {r0['reference_cython_receive_per_s']:,.0f} (Cython, a Python call each)"
    )
    best = max((r["packets_per_s"] for r in rows if r["workers"] == 2), default=0.0)
    verdict = "met" if best >= TARGET_PPS else "missed"
    print(
        f"target {TARGET_PPS:,} packets/s in+out at 2 workers: {verdict} (best {best:,.0f}); "
        f"CPU us/pkt = switch user+sys CPU / packets in+out; machine: {r0['cpu']}, {r0['cores']} cores "
        f"(the switch and the load generator share them; switch/load CPU: the share of one core each used)"
    )
    if any(r["bad_results"] for r in rows):
        print("warning: the load generator received results with wrong sums", file=sys.stderr)


def add_parser(sub: Any) -> None:
    """Register ``switch`` and its options on the ``bench`` subparsers."""
    q = sub.add_parser(
        "switch",
        help="packets/s and CPU per packet of the switch program, batched vs one datagram per call",
        description="Packets per second in + out and CPU microseconds per packet of python -m hpcdl.switch "
        "on loopback under a load generator emulating W workers, for each --batch setting.",
    )
    q.add_argument(
        "--workers",
        type=positive_int,
        nargs="+",
        default=[2, 4],
        metavar="W",
        help="worker counts to emulate",
    )
    q.add_argument(
        "--batches",
        type=positive_int,
        nargs="+",
        default=[64, 1],
        metavar="B",
        help="the switch's --batch settings (1: one datagram per call, the reference; "
        "above 1: with and without GSO)",
    )
    q.add_argument(
        "--payload", type=int, choices=(256, 1024), default=1024, help="payload bytes per datagram"
    )
    q.add_argument("--slots", type=positive_int, default=256, help="the switch's slots")
    q.add_argument(
        "--window",
        type=positive_int,
        default=None,
        help="chunks in flight per emulated worker (default: all slots)",
    )
    q.add_argument("--seconds", type=positive_float, default=2.0, help="seconds of load per measurement")
    q.add_argument(
        "--repeat", type=positive_int, default=3, help="interleaved repetitions; medians are reported"
    )
    q.add_argument(
        "--calibrate",
        type=Path,
        default=None,
        metavar="DIR",
        help="also write the simulator's network files DIR/<base>-switch.toml and DIR/<base>-host.toml: "
        "--base with a [switch] section whose per_packet_us is the measured CPU per datagram received "
        "(the batched loop's for the switch, the one-datagram loop's for the host) (default: none written)",
    )
    q.add_argument(
        "--base",
        default="eth40g",
        metavar="PRESET|FILE",
        help="with --calibrate: the network the switch rank is added to (default: eth40g)",
    )


def run(args: Any) -> list[dict[str, Any]]:
    """Run ``bench switch`` with parsed ``args``; prints the table and returns the rows."""
    if world().Get_size() > 1:
        raise ConfigError(
            "bench switch runs in one process (it starts the switch itself): run it without mpiexec"
        )
    window = args.slots if args.window is None else args.window
    if window > args.slots:
        raise ConfigError(f"--window must be at most --slots ({window} > {args.slots})")
    if max(args.workers) >= 0xFFFF or max(args.batches) > 1024:
        raise ConfigError("--workers must be below 65535 and --batches at most 1024")
    if args.calibrate is not None:
        if 1 not in args.batches or max(args.batches) == 1:
            raise ConfigError(
                "--calibrate needs --batches with 1 (the host's loop) and one above 1 (the switch's)"
            )
        load_network(args.base)  # a bad base fails before measuring
        check_writable(args.calibrate / "probe.toml", what="the network files")
    rows = bench_switch(
        args.workers, args.batches, args.payload, args.slots, window, args.seconds, args.repeat
    )
    print_rows(rows)
    if args.calibrate is not None:
        write_networks(rows, args.base, args.calibrate)
    return rows


def write_networks(rows: list[dict[str, Any]], base: str, out: Path) -> list[Path]:
    """The base network with a switch rank of the measured per-datagram cost, as a switch and as a host.

    The switch file's cost is the batched loop's (the largest batch, GSO on) at the fewest workers
    measured; the host file's the one-datagram-per-call loop's. Both are CPU microseconds of the
    switch program per datagram received, the sends it answers with included: the simulator
    charges its ``[switch]`` rank per message received; one core serves them (``serial``).
    """
    w = min(r["workers"] for r in rows)
    mine = [r for r in rows if r["workers"] == w]
    batched = max((r for r in mine if r["batch"] > 1), key=lambda r: (r["batch"], r["gso"]))
    single = next(r for r in mine if r["batch"] == 1)
    if base in PRESETS:
        text = resources.files("hpcdl.sim").joinpath("networks", f"{base}.toml").read_text("utf-8")
        name = base
    else:
        text, name = Path(base).read_text(encoding="utf-8"), Path(base).stem
    data = tomllib.loads(text)
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    written = []
    for mode, row in (("switch", batched), ("host", single)):
        loop = f"batch {row['batch']}{', GSO' if row['gso'] else ''}"
        section: dict[str, Any] = {
            "rank": -1,
            "mode": mode,
            "per_packet_us": round(row["cpu_us_per_packet_in"], 4),
        }
        if mode == "switch":
            section["processing"] = "serial"  # a software switch: one core serves every port
        table = {**{k: v for k, v in data.items() if k != "switch"}, "switch": section}
        table["name"] = f"{name}-{mode}"
        table["source"] = (
            f"{data.get('source', name)} [switch]: per_packet_us measured by python -m hpcdl.bench switch "
            f"--calibrate on {date} ({row['cpu']}): the switch program's CPU per datagram received, "
            f"{loop}, {w} workers, payload {row['payload']} B, median of {row['repeat']}"
        )
        path = out / f"{name}-{mode}.toml"
        comments = [f"written by `python -m hpcdl.bench switch --calibrate {out}` on {date}; "
                    f"load it with --network {path}"]  # fmt: skip
        parse_network(table, path.stem, where=f"network file {path}")  # what we write must load
        write_text_atomic(path, network_toml(table, comments), what="the network file")
        load_network(path)
        print(f"network written to {path}: [switch] mode {mode}, per_packet_us {section['per_packet_us']}")
        written.append(path)
    return written
