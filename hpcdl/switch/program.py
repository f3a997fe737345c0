"""``python -m hpcdl.switch``: the aggregation switch as a UDP program around the Cython packet loop.

The program binds one UDP socket (loopback unless ``--bind`` says otherwise), prints one
``listening on HOST:PORT`` line, optionally writes ``HOST:PORT`` into ``--ready-file``
(atomically) for a launcher to wait on, and serves one job with
:class:`hpcdl._ext.switchloop.SwitchLoop` — the slot rules of :class:`~hpcdl.switch.SwitchState`
in C, ``recvmmsg``/``sendmmsg`` ``--batch`` datagrams per system call, without the GIL, a
worker's results of one batch sent as one UDP GSO message (``--no-gso``: one entry each). The
loop returns to Python every :data:`SERVE_MS` milliseconds (or at a signal) to handle
SIGINT/SIGTERM (print the counters, write ``--stats-json``, exit 0), SIGUSR1 (print the
counters, go on) and ``--parent-pid`` (exit once that process is gone). A usage error or a
port in use prints one line and exits 2.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import resource
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

__all__ = ["main", "build_parser", "DEFAULT_SLOTS", "SERVE_MS"]

PROG = "python -m hpcdl.switch"
#: slots by default: with 1,024-byte payloads, 256 KiB of chunks in flight per worker, about the
#: bandwidth-delay product of 10 Gb/s at a 200 µs round trip (the switch holds 2 sets x 256 slots
#: x 256 int64 sums = 1 MiB); fewer slots leave the loop's batches small
DEFAULT_SLOTS = 256
#: the longest the C loop serves before Python checks its signals and ``--parent-pid``
SERVE_MS = 100.0
#: how often ``--parent-pid`` is checked, seconds
PARENT_CHECK_S = 0.15
#: the socket buffers asked for (the kernel caps them at net.core.rmem_max / wmem_max)
SOCKET_BUFFER = 4 * 2**20


class UsageError(Exception):
    """A bad argument or an environment the switch cannot run in: one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage block), exit status 2."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see {PROG} --help)")


def _ranged(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an integer in ``low .. high``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer (got {text!r})") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be in {low} .. {high} (got {value})")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m hpcdl.switch``."""
    parser = _Parser(
        prog=PROG,
        description="The in-network aggregation switch (SwitchML-style) as a UDP program: it sums "
        "the int32 chunks of W workers of one job and sends each sum back to every worker.",
    )
    parser.add_argument(
        "--workers",
        type=_ranged(1, 0xFFFE),
        required=True,
        metavar="W",
        help="the workers of the job: the contributions each chunk needs",
    )
    parser.add_argument(
        "--port",
        type=_ranged(0, 0xFFFF),
        default=0,
        help="UDP port to listen on; 0 (default) picks a free one",
    )
    parser.add_argument(
        "--bind",
        default="127.0.0.1",
        metavar="HOST",
        help="address to bind (default 127.0.0.1, loopback only)",
    )
    parser.add_argument(
        "--slots",
        type=_ranged(1, 0xFFFF),
        default=DEFAULT_SLOTS,
        metavar="K",
        help=f"switch slots (default {DEFAULT_SLOTS}); workers use at most this window",
    )
    parser.add_argument(
        "--payload",
        type=int,
        choices=(256, 1024),
        default=1024,
        help="payload bytes per datagram (default 1024: 256 int32 per chunk)",
    )
    parser.add_argument(
        "--job",
        type=_ranged(0, 0xFFFFFFFF),
        default=1,
        help="the job served (default 1); other jobs' datagrams count as malformed_job",
    )
    parser.add_argument(
        "--batch",
        type=_ranged(1, 1024),
        default=64,
        help="datagrams per recvmmsg call (default 64; 1: one per system call)",
    )
    parser.add_argument(
        "--gso",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send each worker's results of one batch as one UDP_SEGMENT message (default on; "
        "--no-gso: one sendmmsg entry per datagram)",
    )
    parser.add_argument(
        "--stats-json",
        type=Path,
        default=None,
        metavar="FILE",
        help="write the counters, rates and CPU time as JSON at exit",
    )
    parser.add_argument(
        "--ready-file",
        type=Path,
        default=None,
        metavar="FILE",
        help="once listening, write HOST:PORT into FILE (atomically)",
    )
    parser.add_argument(
        "--parent-pid",
        type=_ranged(1, 2**31 - 1),
        default=None,
        metavar="PID",
        help="exit when process PID is gone (a switch spawned by a job never outlives it)",
    )
    return parser


def _write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path``, then rename it over ``path``."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def _check_dir(path: Path | None, option: str) -> None:
    if path is not None and not os.access(path.parent if str(path.parent) else ".", os.W_OK):
        raise UsageError(
            f"{option} {path}: its directory does not exist or is not writable; pick another path"
        )


def _bind(host: str, port: int) -> socket.socket:
    """A non-blocking UDP socket bound to ``host:port``, with large buffers."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except socket.gaierror as err:
        raise UsageError(
            f"--bind {host}: not an address of this machine ({err.strerror}); use an IP such as 127.0.0.1"
        ) from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_DGRAM)
    for option in (socket.SO_RCVBUF, socket.SO_SNDBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER)
    try:
        sock.bind(address)
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            raise UsageError(
                f"UDP port {port} on {host} is in use: pick another --port, or 0 for a free one"
            ) from None
        raise UsageError(
            f"cannot bind {host}:{port} ({err.strerror}): pick another --bind or --port"
        ) from None
    sock.setblocking(False)
    return sock


def _parent_gone(pid: int, was_parent: bool) -> bool:
    """Process ``pid`` has exited (or, being our parent, has left us to another parent)."""
    if was_parent and os.getppid() != pid:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # exists, owned by another user
        return False
    return False


def _cpu() -> tuple[float, float]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime, usage.ru_stime


def stats(loop: Any, address: str, started: float, cpu0: tuple[float, float]) -> dict[str, Any]:
    """The counters and the figures derived from them (rates over the run, CPU time)."""
    counters = loop.counters()
    elapsed = time.monotonic() - started
    user, system = _cpu()
    active = max(0.0, (loop.last_ms - loop.first_ms) / 1e3)  # first to last datagram served
    per_s = lambda n: n / active if active > 0 else 0.0  # noqa: E731
    return {
        "address": address,
        "workers": loop.workers,
        "slots": loop.slots,
        "payload": loop.payload,
        "job": loop.job,
        "batch": loop.batch,
        "gso": bool(loop.gso),
        "elapsed_s": elapsed,
        "active_s": active,
        "packets_per_s_in": per_s(counters["packets_in"]),
        "packets_per_s_out": per_s(counters["packets_out"]),
        "packets_per_s": per_s(counters["packets_in"] + counters["packets_out"]),
        "cpu_user_s": user,
        "cpu_sys_s": system,
        "serve_cpu_s": (user - cpu0[0]) + (system - cpu0[1]),  # since listening: the loop's own
        "counters": counters,
    }


def _print_counters(figures: dict[str, Any], why: str) -> None:
    c = figures["counters"]
    dropped = {k: v for k, v in c.items() if k.startswith("malformed_") and v}
    lines = [
        f"hpcdl switch: counters ({why}, {figures['elapsed_s']:.1f} s, "
        f"{figures['packets_per_s']:,.0f} packets/s in+out while active)",
        f"  packets in {c['packets_in']} ({c['bytes_in']} bytes), "
        f"out {c['packets_out']} ({c['bytes_out']} bytes)",
        f"  summed {c['summed']}, completed {c['completed']} (exponent rounds {c['exponent_rounds']}), "
        f"duplicates {c['duplicates']}, retransmitted results {c['retransmitted_results']}",
        f"  stale {c['stale']}, mismatch {c['mismatch']}, not contribution {c['not_contribution']}, "
        f"overflow {c['overflow']}",
        f"  malformed {c['malformed']}"
        + (f" ({', '.join(f'{k[10:]} {v}' for k, v in dropped.items())})" if dropped else ""),
        f"  system calls: recv {c['recv_calls']}, send {c['send_calls']}; send failed {c['send_failed']}, "
        f"no address {c['no_address']}; GSO messages {c['gso_messages']}",
    ]
    print("\n".join(lines), flush=True)


def main(argv: list[str]) -> int:
    """Run the switch until SIGINT/SIGTERM or ``--parent-pid`` ends; returns the exit status."""
    try:
        return _run(argv)
    except UsageError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2


def _run(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    _check_dir(args.stats_json, "--stats-json")
    _check_dir(args.ready_file, "--ready-file")
    if args.slots < 1 or args.workers < 1:
        raise UsageError("--workers and --slots must be positive")
    try:
        from hpcdl._ext.switchloop import SwitchLoop
    except ImportError:
        raise UsageError(
            "the switch's packet loop (hpcdl._ext.switchloop) is not built: run pip install -e ."
        ) from None
    loop = SwitchLoop(args.workers, args.slots, args.payload, args.job, args.batch, args.gso)
    sock = _bind(args.bind, args.port)
    host, port = sock.getsockname()[:2]
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    requests = {"stop": None, "print": False}

    def stop(signum: int, _frame: Any) -> None:
        requests["stop"] = signal.Signals(signum).name

    def show(_signum: int, _frame: Any) -> None:
        requests["print"] = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGUSR1, show)
    started, cpu0 = time.monotonic(), _cpu()
    was_parent = args.parent_pid is not None and os.getppid() == args.parent_pid
    print(
        f"hpcdl switch: listening on {address} (workers {args.workers}, slots {args.slots}, "
        f"payload {args.payload}, job {args.job}, batch {args.batch}{', gso' if loop.gso else ''})",
        flush=True,
    )
    if args.ready_file is not None:
        _write_atomic(args.ready_file, address)
    checked = time.monotonic()
    with sock:
        while requests["stop"] is None:
            loop.serve(sock.fileno(), SERVE_MS)
            if requests["print"]:
                requests["print"] = False
                _print_counters(stats(loop, address, started, cpu0), "SIGUSR1")
            if args.parent_pid is not None and time.monotonic() - checked >= PARENT_CHECK_S:
                checked = time.monotonic()
                if _parent_gone(args.parent_pid, was_parent):
                    requests["stop"] = f"parent {args.parent_pid} gone"
    figures = stats(loop, address, started, cpu0)
    _print_counters(figures, str(requests["stop"]))
    if args.stats_json is not None:
        try:
            _write_atomic(args.stats_json, json.dumps(figures, indent=1) + "\n")
        except OSError as err:
            print(
                f"{PROG}: error: cannot write --stats-json {args.stats_json} ({err.strerror}); "
                "pick another path",
                file=sys.stderr,
            )
            return 2
    return 0
