"""``bench allreduce``: time and bus bandwidth of each allreduce algorithm beside MPI's own.

With ``--calibrate --table FILE`` it also measures which algorithm ``auto`` should pick:
the segments found for this rank count replace that rank count's in ``FILE`` (others kept),
which ``exchange.auto_table`` or ``--table`` then names.
"""

from __future__ import annotations

import datetime
import json
import socket
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import hpcdl
from hpcdl.atomic import check_writable
from hpcdl.comm import on_root, world
from hpcdl.comm.collectives import ALGORITHMS, NODE_ALGORITHMS, AutoTable, available_algorithms
from hpcdl.comm.collectives.auto import (
    TOLERANCE,
    format_bytes,
    format_segments,
    load_table_bcast,
    merge,
    ordinary_segments,
    save_table,
    table_from_rows,
    winners,
)
from hpcdl.comm.collectives.timing import time_algorithms
from hpcdl.comm.collectives.tune import tuned_table
from hpcdl.comm.contract import Communicator
from hpcdl.driver.cli import nonnegative_float, parse_size, positive_float, positive_int
from hpcdl.errors import ConfigError, file_error

__all__ = ["CALIBRATION_SIZES", "DEFAULT_SIZES", "add_parser", "calibrate", "run"]

#: 4 KB to 64 MB, powers of 4
DEFAULT_SIZES = tuple(4096 * 4**k for k in range(8))
#: 4 KB to 64 MB, powers of 2: ``--calibrate`` without ``--sizes``
CALIBRATION_SIZES = tuple(4096 * 2**k for k in range(15))
_TABLE_WHAT = "the auto table"


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
        f"{'size':>6} {'algorithm':<18}{'time us':>11}{'iqr us':>9}{'algbw GB/s':>12}"
        f"{'busbw GB/s':>12}{'time/mpi':>10}{'iters':>7}"
    )
    for r in rows:
        ratio = f"{r['time_vs_mpi']:.2f}" if r.get("time_vs_mpi") is not None else "-"
        name = r["algorithm"] if r["picked"] == r["algorithm"] else f"{r['algorithm']}={r['picked']}"
        print(
            f"{_fmt_size(r['size_bytes']):>6} {name:<18}{1e6 * r['time_s']:>11.1f}"
            f"{1e6 * r['iqr_s']:>9.1f}{r['algbw_GBps']:>12.3f}{r['busbw_GBps']:>12.3f}"
            f"{ratio:>10}{r['iters']:>7}"
        )


def calibrate(
    comm: Communicator,
    table_path: str,
    sizes: tuple[int, ...] = CALIBRATION_SIZES,
    algorithms: tuple[str, ...] = tuple(ALGORITHMS),
    repeat: int = 5,
    min_time: float = 0.02,
    dtype: str = "float32",
    tolerance: float = TOLERANCE,
    runs: int = 1,
    also: Sequence[Mapping[str, Any]] = (),
) -> tuple[list[dict[str, Any]], AutoTable]:
    """Time ``algorithms`` and store the segments ``auto`` should use at this rank count (collective).

    With ``runs > 1`` every size is measured in ``runs`` separate passes, and ``also``
    adds rows of earlier jobs (``--json`` files) of the same rank count: the choice per
    size is the one whose worst ratio to the fastest over all passes is lowest
    (:func:`~hpcdl.comm.collectives.auto.winners`).

    The table at ``table_path`` (an empty one if the file does not exist) is read on rank
    0 first, so that a damaged file stops the run before the timing; the segments of
    :func:`~hpcdl.comm.collectives.auto.table_from_rows` replace this rank count's, with
    their provenance (date, MPI library, host, settings, per-size winners and median
    times in microseconds), and rank 0 writes the file atomically. Prints the rows, the
    segments and the file written on rank 0.

    Returns:
        The rows of :func:`~hpcdl.comm.collectives.timing.time_algorithms` and the merged table
        (the same on every rank).

    Raises:
        ConfigError: one rank, or a damaged table file.
        FileError: the table cannot be written: checked before the timing, and again when
            it is written (on every rank; the file there is kept as it was).
    """
    ranks = comm.Get_size()
    if ranks < 2:
        raise ConfigError(
            "--calibrate measures a rank count of 2 or more: run it under mpiexec -n N "
            "(once per rank count the runs will use)"
        )
    existing = load_table_bcast(comm, table_path, missing_ok=True)
    on_root(comm, lambda: check_writable(table_path, what=_TABLE_WHAT))
    rows: list[dict[str, Any]] = []
    for run in range(runs):  # passes over every size at different times: the machine drifts
        for row in time_algorithms(comm, sizes, algorithms, repeat, min_time, dtype):
            rows.append({**row, "run": run})
    earlier = [{**r, "run": runs + int(r.get("run", 0))} for r in also if r.get("ranks") == ranks]
    segments = table_from_rows([*rows, *earlier], tolerance)
    ordinary = ordinary_segments([*rows, *earlier], tolerance)
    meta = _provenance(comm, [*rows, *earlier], tolerance, dtype=dtype, min_time=min_time)
    table = merge(existing, ranks, segments, meta, ordinary)

    def report() -> None:
        print_rows(rows)
        print(f"auto at {ranks} ranks (previous winner kept within {100 * tolerance:g}% of the fastest):")
        low: int | None = 0
        for below, name in segments:
            print(f"  {format_bytes(low):>8} <= size < {format_bytes(below):<8} {name}")
            low = below
        if ordinary is not None:
            print(f"  in ordinary memory: {format_segments(ordinary)}")
        save_table(table, table_path)
        kept = [r for r in table.segments if r != ranks]
        others = f"; kept {', '.join(map(str, kept))} ranks from before" if kept else ""
        print(f"auto table for {ranks} ranks written to {table_path}{others}")

    on_root(comm, report)
    return rows, table


def _provenance(
    comm: Communicator, rows: list[dict[str, Any]], tolerance: float, *, dtype: str, min_time: float
) -> dict[str, Any]:
    """What a calibration records beside its segments."""
    try:
        from hpcdl.comm.mpi import library_version

        library = " ".join(library_version().split())
    except ImportError:  # pragma: no cover  (mpi4py is a dependency)
        library = ""
    hosts = comm.allgather(socket.gethostname())
    medians: dict[str, dict[str, float]] = {}
    for r in rows:
        medians.setdefault(str(r["size_bytes"]), {})[r["algorithm"]] = round(1e6 * r["time_s"], 2)
    r0 = rows[0]
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "mpi_library": library,
        "host": hosts[0],
        "nodes": len(set(hosts)),
        "hpcdl_version": hpcdl.__version__,
        "repeat": r0["repeat"],
        "min_time_s": min_time,
        "dtype": dtype,
        "sizes": sorted({r["size_bytes"] for r in rows}),
        "algorithms": list(dict.fromkeys(r["algorithm"] for r in rows)),
        "tolerance": tolerance,
        "winners": [[size, name, round(ratio, 4)] for size, name, ratio in winners(rows, tolerance)],
        "median_us": medians,
    }


def add_parser(sub: Any) -> None:
    """Register ``allreduce`` and its options on the ``bench`` subparsers."""
    p = sub.add_parser(
        "allreduce",
        help="allreduce time and bus bandwidth per algorithm, beside MPI's",
        description="Time and bus bandwidth of each allreduce algorithm beside MPI's own (under mpiexec); "
        "with --calibrate, the table auto picks from.",
    )
    sizes_help = (
        "message sizes in bytes: 4096, 4K, 16M, ... (default: 4K to 64M in powers of 4; "
        "with --calibrate, in powers of 2)"
    )
    p.add_argument("--sizes", nargs="+", type=parse_size, default=None, metavar="SIZE", help=sizes_help)
    p.add_argument(
        "--repeat", type=positive_int, default=5, help="interleaved repetitions; the median is reported"
    )
    names = [*ALGORITHMS, *NODE_ALGORITHMS, "auto"]
    p.add_argument(
        "--algorithms",
        nargs="+",
        choices=names,
        default=None,
        metavar="NAME",
        help=f"algorithms to time: {', '.join(names)} (default: all; shm when every rank shares one node); "
        "mpi: the library's own Allreduce; shm: in node memory",
    )
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32", help="element type")
    p.add_argument("--min-time", type=positive_float, default=0.02, help="seconds per measurement, at least")
    p.add_argument(
        "--table",
        default=None,
        metavar="PATH",
        help="the JSON table auto picks from; with --calibrate, the file to create or update "
        "(default: calibrated here at --sizes, as a run's auto is: --auto-calibrate)",
    )
    p.add_argument(
        "--auto-calibrate",
        choices=("first", "always", "never"),
        default="first",
        help="without --table: auto's table timed at --sizes on this machine as a run's is (first: "
        "what the cache lacks; always: all again) or the packaged table (never); the cache is "
        "--auto-cache",
    )
    p.add_argument(
        "--auto-cache",
        default=None,
        metavar="PATH",
        help="the calibration cache (default: $XDG_CACHE_HOME/hpcdl/auto-tables.json, as a run's)",
    )
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="find the fastest algorithm per size at this rank count and store it in --table",
    )
    p.add_argument("--runs", type=int, default=1, help="with --calibrate: passes over all sizes in this job")
    p.add_argument(
        "--also",
        nargs="+",
        default=[],
        metavar="ROWS.json",
        help="with --calibrate: also weigh these earlier --json outputs (their rows of this rank count; "
        "default: none)",
    )
    p.add_argument(
        "--tolerance",
        type=nonnegative_float,
        default=TOLERANCE,
        help="with --calibrate: keep the previous size's winner while it is within this fraction of the "
        "fastest",
    )


def run(args: Any) -> list[dict[str, Any]]:
    """Run ``bench allreduce`` with parsed ``args``; prints the table on rank 0 and returns the rows."""
    comm = world()
    chosen = args.algorithms or [*available_algorithms(comm), "auto"]
    algorithms = tuple(dict.fromkeys(chosen))
    if args.calibrate:
        if not args.table:
            raise ConfigError(
                "--calibrate needs --table PATH: the JSON table to create or update "
                "(then name it in exchange.auto_table)"
            )
        timed = tuple(a for a in algorithms if a != "auto")
        if not timed:
            raise ConfigError("--calibrate needs at least one algorithm besides auto in --algorithms")
        if args.runs < 1:
            raise ConfigError(f"--runs must be a positive integer (got {args.runs})")
        sizes = tuple(args.sizes or CALIBRATION_SIZES)
        also = on_root(comm, lambda: _read_rows(args.also))
        rows, _ = calibrate(
            comm, args.table, sizes, timed, args.repeat, args.min_time, args.dtype, args.tolerance,
            args.runs, also,
        )  # fmt: skip
        return rows
    sizes = tuple(args.sizes or DEFAULT_SIZES)
    source, lines = "file" if args.table else "packaged", ()
    if args.table or args.auto_calibrate == "never" or comm.Get_size() < 2 or "auto" not in algorithms:
        table = load_table_bcast(comm, args.table)  # every rank the same, before any timing
        seconds = 0.0
    else:  # as a run does: the machine's own, cached
        tuning = tuned_table(comm, sizes, mode=args.auto_calibrate, cache=args.auto_cache)
        table, source, seconds, lines = tuning.table, tuning.source, tuning.seconds, tuning.lines
    rows = time_algorithms(comm, sizes, algorithms, args.repeat, args.min_time, args.dtype, table)
    for r in rows:
        r["auto_table"], r["calibration_s"] = source, seconds
    if comm.Get_rank() == 0:
        for line in lines:
            print(line)
        print_rows(rows)
        summary = auto_summary(rows)
        if summary:
            print(summary)
    return rows


def auto_summary(rows: Sequence[Mapping[str, Any]], from_bytes: int = 65536) -> str:
    """``auto``'s time over the fastest algorithm's at each size, worst from ``from_bytes`` up and
    at any size, with where its table came from, in a line ("" without auto's rows)."""
    ratios = []
    for size in sorted({r["size_bytes"] for r in rows}):
        at = [r for r in rows if r["size_bytes"] == size]
        auto = next((r for r in at if r["algorithm"] == "auto"), None)
        best = min((r for r in at if r["algorithm"] != "auto"), key=lambda r: r["time_s"], default=None)
        if auto is not None and best is not None:
            ratios.append((auto["time_s"] / best["time_s"], size, best["algorithm"]))
    if not ratios:
        return ""
    big = [x for x in ratios if x[1] >= from_bytes]
    worst = max(big or ratios)
    r0 = next(r for r in rows if r["algorithm"] == "auto")
    table = {"file": "--table", "packaged": "the packaged table"}.get(r0["auto_table"], "its own calibration")
    took = f" ({r0['calibration_s']:.2f} s)" if r0["auto_table"] == "calibrated" else ""
    where = f"from {format_bytes(from_bytes)} up" if big else "at the sizes timed"
    return (
        f"auto ({table}{took}) over the fastest algorithm per size: worst {worst[0]:.2f}x {where} "
        f"(at {format_bytes(worst[1])}, where {worst[2]} is fastest), {max(ratios)[0]:.2f}x at any size"
    )


def _read_rows(paths: Sequence[str]) -> list[dict[str, Any]]:
    """The rows of earlier ``--json`` outputs, each file a run of its own.

    Raises:
        ConfigError: a file is not the output of ``bench allreduce --json``.
        FileError: a file cannot be read.
    """
    rows: list[dict[str, Any]] = []
    for k, path in enumerate(paths):
        try:
            data = json.loads(Path(path).read_text())
            if not isinstance(data, list) or not all(isinstance(r, dict) and "time_s" in r for r in data):
                raise ValueError("not a list of bench allreduce rows")
        except OSError as err:
            raise file_error(path, err, what="the --also rows", verb="read") from None
        except ValueError as err:
            raise ConfigError(
                f"--also {path}: cannot use it ({err}): give the --json output of bench allreduce"
            ) from None
        base = 1000 * (k + 1)  # keep each file's passes apart from the others'
        rows.extend({**r, "run": base + int(r.get("run", 0))} for r in data)
    return rows
