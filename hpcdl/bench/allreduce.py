"""``bench allreduce``: time and bus bandwidth of each allreduce algorithm beside MPI's own."""

from __future__ import annotations

import math
import statistics
from typing import Any

import numpy as np

from hpcdl.comm import MAX, world, wtime
from hpcdl.comm.collectives import ALGORITHMS, Collectives
from hpcdl.comm.contract import Communicator
from hpcdl.errors import ConfigError

__all__ = ["DEFAULT_SIZES", "add_parser", "bench_allreduce", "run"]

#: 4 KB to 64 MB, powers of 4
DEFAULT_SIZES = tuple(4096 * 4**k for k in range(8))
_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3}


def parse_size(text: str) -> int:
    """Bytes from ``4096``, ``4K``, ``16M``, ``1G`` (binary units; ``B``/``iB`` optional)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = t[-1:] if t[-1:] in _UNITS else ""
    try:
        value = int(t[: len(t) - len(unit)]) * _UNITS[unit]
    except ValueError:
        raise ConfigError(f"--sizes takes byte counts such as 4096, 64K or 16M (got {text!r})") from None
    if value <= 0:
        raise ConfigError(f"--sizes must be positive (got {text!r})")
    return value


def _caller(coll: Collectives, send: Any, recv: Any, algorithm: str) -> Any:
    return lambda: coll.Allreduce(send, recv, algorithm=algorithm)


def _time_per_call(comm: Communicator, call: Any, iters: int) -> float:
    """Seconds per call of ``call`` over ``iters`` calls after a barrier, the max over ranks."""
    comm.Barrier()
    t0 = wtime()
    for _ in range(iters):
        call()
    return comm.allreduce((wtime() - t0) / iters, op=MAX)


def bench_allreduce(
    comm: Communicator,
    sizes: tuple[int, ...] = DEFAULT_SIZES,
    algorithms: tuple[str, ...] = (*ALGORITHMS, "auto"),
    repeat: int = 5,
    min_time: float = 0.02,
    dtype: str = "float32",
) -> list[dict[str, Any]]:
    """Allreduce time of each algorithm at each size, as medians of interleaved repetitions.

    For each size, each algorithm is run once to warm up, then timed over 1, 4, 16, ...
    calls until that takes a quarter of ``min_time``, which sets its ``iters`` (so that a
    measurement takes about ``min_time``); then each repetition times
    ``iters`` calls of every algorithm in turn, after a barrier, taking the slowest rank's
    time. Buffers are out of place (``sendbuf`` is not ``recvbuf``).

    Returns:
        One row per (size, algorithm): ``algorithm``, ``size_bytes``, ``ranks``, ``time_s``
        (median), ``iqr_s``, ``algbw_GBps`` (size / time), ``busbw_GBps`` (algbw
        · 2 (n - 1) / n, nccl-tests' definition), ``time_vs_mpi``, ``iters``, ``repeat``.
    """
    size_n = comm.Get_size()
    item = np.dtype(dtype).itemsize
    rows: list[dict[str, Any]] = []
    with Collectives(comm) as coll:
        for nbytes in sizes:
            n = max(nbytes // item, 1)
            send = np.random.default_rng([0, comm.Get_rank()]).standard_normal(n).astype(dtype)
            recv = np.empty_like(send)
            calls = {a: _caller(coll, send, recv, a) for a in algorithms}
            iters = {}
            for name, call in calls.items():
                call()
                k = 1
                while (t := _time_per_call(comm, call, k)) * k < min_time / 4:  # same t on every rank
                    k *= 4
                iters[name] = max(1, math.ceil(min_time / t))
            times: dict[str, list[float]] = {a: [] for a in algorithms}
            for _ in range(repeat):
                for name, call in calls.items():
                    times[name].append(_time_per_call(comm, call, iters[name]))
            for name, ts in times.items():
                t = statistics.median(ts)
                q1, q3 = np.percentile(ts, [25, 75])
                algbw = n * item / t / 1e9
                rows.append(
                    {
                        "algorithm": name,
                        "size_bytes": n * item,
                        "ranks": size_n,
                        "time_s": t,
                        "iqr_s": float(q3 - q1),
                        "algbw_GBps": algbw,
                        "busbw_GBps": algbw * 2 * (size_n - 1) / size_n,
                        "iters": iters[name],
                        "repeat": repeat,
                    }
                )
            ref = statistics.median(times["mpi"]) if "mpi" in times else None
            for row in rows[-len(times) :]:
                row["time_vs_mpi"] = row["time_s"] / ref if ref else None
    return rows


def _fmt_size(nbytes: int) -> str:
    for unit, scale in (("G", 1024**3), ("M", 1024**2), ("K", 1024)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)


def print_rows(rows: list[dict[str, Any]]) -> None:
    """The table: one line per size and algorithm, with the time ratio to ``mpi``."""
    r0 = rows[0]
    print(
        f"bench allreduce: {r0['ranks']} ranks, median of {r0['repeat']} interleaved repetitions, "
        "out of place; time/mpi < 1 is faster than MPI's Allreduce"
    )
    print(
        f"{'size':>6} {'algorithm':<13}{'time us':>11}{'iqr us':>9}{'algbw GB/s':>12}"
        f"{'busbw GB/s':>12}{'time/mpi':>10}{'iters':>7}"
    )
    for r in rows:
        ratio = f"{r['time_vs_mpi']:.2f}" if r.get("time_vs_mpi") is not None else "-"
        print(
            f"{_fmt_size(r['size_bytes']):>6} {r['algorithm']:<13}{1e6 * r['time_s']:>11.1f}"
            f"{1e6 * r['iqr_s']:>9.1f}{r['algbw_GBps']:>12.3f}{r['busbw_GBps']:>12.3f}"
            f"{ratio:>10}{r['iters']:>7}"
        )


def add_parser(sub: Any) -> None:
    """Register ``allreduce`` and its options on the ``bench`` subparsers."""
    p = sub.add_parser("allreduce", help="allreduce time and bus bandwidth per algorithm, beside MPI's")
    sizes_help = "message sizes: 4K, 16M, ... (default 4K to 64M, powers of 4)"
    p.add_argument("--sizes", nargs="+", type=parse_size, default=list(DEFAULT_SIZES), help=sizes_help)
    p.add_argument("--repeat", type=int, default=5, help="interleaved repetitions (median reported)")
    names = [*ALGORITHMS, "auto"]
    p.add_argument("--algorithms", nargs="+", choices=names, default=names, help="algorithms to time")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--min-time", type=float, default=0.02, help="seconds per measurement, at least")


def run(args: Any) -> list[dict[str, Any]]:
    """Run ``bench allreduce`` with parsed ``args``; prints the table on rank 0 and returns the rows."""
    if args.repeat < 1 or args.min_time <= 0:
        raise ConfigError("--repeat must be a positive integer and --min-time a positive number of seconds")
    comm = world()
    rows = bench_allreduce(
        comm, tuple(args.sizes), tuple(dict.fromkeys(args.algorithms)), args.repeat, args.min_time, args.dtype
    )
    if comm.Get_rank() == 0:
        print_rows(rows)
    return rows
