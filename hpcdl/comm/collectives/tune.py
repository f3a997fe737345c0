"""``auto`` tuned where it runs: the run's own bucket sizes timed once per machine, and cached.

The packaged table (:mod:`~hpcdl.comm.collectives.auto`) was measured on one machine; on
another the fastest algorithm per size may differ. :func:`tuned_table` gives ``auto`` a table
for the message sizes a run will send, made on the machine it runs on:

1. Rank 0 reads the **cache** (``$XDG_CACHE_HOME/hpcdl/auto-tables.json``, else
   ``~/.cache/hpcdl/auto-tables.json``; :func:`default_cache`), a JSON file of entries keyed
   by the CPU model, the MPI library and version, the rank count and the ranks per node
   (:func:`cache_key`). An entry holds the time of every algorithm at every size measured
   there (the fastest of its repetitions).
2. Sizes the entry lacks (all of them with ``mode = "always"``) are **timed** by every rank
   together (:func:`~hpcdl.comm.collectives.timing.time_algorithms`: :data:`REPEAT`
   interleaved repetitions of about :data:`MIN_TIME` seconds, or of one call where a call takes
   longer, per algorithm and size; the fastest repetition is kept), and rank 0 writes them
   into the entry (atomically, holding ``<cache>.lock`` so that jobs calibrating at once keep
   each other's entries; a cache that cannot be written costs a line, not the run).
3. The run's table is :func:`~hpcdl.comm.collectives.auto.table_from_rows` over the run's
   sizes: at each, the fastest algorithm (the previous size's winner kept within 3%).

An entry written by another format of this file, for another set of algorithms, or whose
recorded machine is not its key's (a file copied from elsewhere) is ignored with one line and
replaced. ``mode = "never"`` skips all of this (the packaged or named table is used).

In the simulator nothing is timed: the table is the α-β model's (:func:`analytic_table`), from
the network file's latency and bandwidth (``Communicator.alpha_beta``) and, where every rank
shares a node and the file gives ``intra.memory_GBps``, its memory rate, which prices ``shm``
(``Communicator.memory_beta``): the same in every run.

A run records the table its exchange uses (rank 0's, in the run file; each rank's, in each
checkpoint); a resume takes the checkpoint's, so that the summation order, and the trajectory,
stay those of the first run (a resume on a cache miss still calibrates first, then discards it).
"""

from __future__ import annotations

import datetime
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcdl.cachefile import cache_dir, entry_key, read_entries, update_entry
from hpcdl.comm.collectives.api import ALGORITHMS, NODE_ALGORITHMS, available_algorithms
from hpcdl.comm.collectives.auto import AutoTable, format_segments, ordinary_segments, table_from_rows
from hpcdl.comm.collectives.shm import PLACE_BYTES
from hpcdl.comm.contract import Communicator
from hpcdl.comm.objects import on_root
from hpcdl.errors import HpcdlError, NodeMemoryError

__all__ = [
    "CACHE_FORMAT",
    "KEY_FIELDS",
    "MIN_TIME",
    "MODES",
    "REPEAT",
    "Tuning",
    "analytic_table",
    "analytic_time",
    "cache_key",
    "default_cache",
    "tuned_table",
]

#: ``exchange.auto_calibrate``: time on a cache miss, never (the packaged or named table), always
MODES = ("first", "never", "always")
#: version of the cache file's layout
CACHE_FORMAT = 1
#: what a cache entry is keyed by (:func:`hpcdl.comm.machine.describe`'s fields)
KEY_FIELDS = ("cpu", "mpi", "ranks", "ranks_per_node")
#: interleaved repetitions per size in a run's calibration (the fastest is kept: on a shared
#: machine, noise only ever adds time, and a median of few repetitions still picked a 2.5x slower
#: algorithm in one of three calibrations here)
REPEAT = 5
#: seconds per algorithm and repetition in a run's calibration
MIN_TIME = 0.005
#: the simulator's MPI allreduce: recursive doubling up to this many bytes, else Rabenseifner
_SHORT = 2048


@dataclass(frozen=True)
class Tuning:
    """What :func:`tuned_table` decided, the same on every rank.

    Attributes:
        table: the table ``auto`` picks from.
        source: ``"cache"`` (every size found), ``"calibrated"`` (some timed now),
            ``"analytic"`` (the simulator's α-β model).
        seconds: wall time of the calibration (0 when nothing was timed).
        timed: the sizes timed now, in bytes.
        lines: what to tell the user (a stale cache, the choice, the time it took); also the
            table's ``meta["notes"]``, which a run file records.
    """

    table: AutoTable
    source: str
    seconds: float = 0.0
    timed: tuple[int, ...] = ()
    lines: tuple[str, ...] = ()


def default_cache() -> Path:
    """``$XDG_CACHE_HOME/hpcdl/auto-tables.json`` (``~/.cache`` when the variable is unset or empty)."""
    return cache_dir() / "auto-tables.json"


def cache_key(machine: Mapping[str, Any]) -> str:
    """The cache entry of a machine (:func:`hpcdl.comm.machine.describe` with ``ranks`` and
    ``ranks_per_node``): ``cpu=... | mpi=... | ranks=2 | ranks_per_node=2``."""
    return entry_key({k: machine.get(k) for k in KEY_FIELDS})


def analytic_time(
    algorithm: str, nbytes: int, ranks: int, alpha: float, beta: float, gamma: float | None = None
) -> float:
    """Seconds an allreduce of ``nbytes`` over ``ranks`` takes under the α-β model.

    ring ``2 (p-1) α + 2 (p-1)/p n β``; recursive doubling ``log2(q) (α + n β)`` and
    Rabenseifner ``2 log2(q) α + 2 (q-1)/q n β`` among the ``q`` (a power of two) ranks
    left after folding, plus ``2 (α + n β)`` when ``p > q`` (the fold, as MPICH's); ``mpi``
    as the simulator runs it (doubling for short messages, else Rabenseifner). The simulator
    agrees exactly for the ring and at powers of two; folded, it adds the fold's incast (the
    unfolded ranks' first rounds reach a rank still receiving its partner's vector), which the
    model leaves out: at most a vector per round.

    ``shm`` (node memory, ``gamma`` seconds per byte read or written:
    :meth:`hpcdl.sim.network.Network.memory_beta`): two barriers of ``ceil(log2 p)`` rounds,
    the first's messages of :data:`~hpcdl.comm.collectives.shm.PLACE_BYTES`, and a pass that
    reads and writes ``2 n`` bytes: ``ceil(log2 p) (2 α + 40 β) + 2 n γ``, as the simulator
    charges it (exactly, when ``p`` divides the vector).

    Without ``gamma`` the reductions cost nothing. With it, so that the message algorithms
    and ``shm`` are priced alike, each byte a message algorithm reduces costs ``3 γ`` (two
    read, one written): ``(p-1)/p n`` bytes for the ring, ``(q-1)/q n`` for Rabenseifner,
    ``log2(q) n`` for doubling, and ``n`` more for a fold. The simulator measures those
    reductions as compute (on the machine it runs on), so this part is an estimate.

    Raises:
        ValueError: an algorithm without a model (``shm`` without ``gamma``).
    """
    p = ranks
    if p < 2:
        return 0.0
    q = 1 << (p.bit_length() - 1)
    steps = q.bit_length() - 1
    reduce = 3 * nbytes * gamma if gamma is not None else 0.0  # a whole vector reduced, in memory
    fold = 2 * (alpha + nbytes * beta) + reduce if p > q else 0.0
    if algorithm == "mpi":
        short = nbytes <= _SHORT or nbytes // 4 < q
        algorithm = "doubling" if short else "rabenseifner"
    if algorithm == "ring":
        return 2 * (p - 1) * alpha + (p - 1) / p * (2 * nbytes * beta + reduce)
    if algorithm == "doubling":
        return steps * (alpha + nbytes * beta + reduce) + fold
    if algorithm == "rabenseifner":
        return 2 * steps * alpha + (q - 1) / q * (2 * nbytes * beta + reduce) + fold
    if algorithm == "shm" and gamma is not None:
        rounds = (p - 1).bit_length()
        return rounds * (2 * alpha + PLACE_BYTES * beta) + 2 * nbytes * gamma
    if algorithm == "shm":
        raise ValueError("the α-β model prices allreduce 'shm' only with gamma, the node's memory rate")
    raise ValueError(f"no α-β model for allreduce algorithm {algorithm!r}")


def analytic_table(
    sizes: Sequence[int],
    ranks: int,
    alpha: float,
    beta: float,
    algorithms: Sequence[str] = ALGORITHMS,
    gamma: float | None = None,
) -> AutoTable:
    """The table of the α-β model at ``sizes`` (the fastest of :func:`analytic_time` at each)."""
    rows = [
        {
            "algorithm": a,
            "size_bytes": n,
            "ranks": ranks,
            "time_s": analytic_time(a, n, ranks, alpha, beta, gamma),
        }
        for n in sizes
        for a in algorithms
    ]
    meta = {"source": "analytic", "alpha_s": alpha, "beta_s_per_byte": beta, "sizes": list(sizes)}
    if gamma is not None:
        meta["gamma_s_per_byte"] = gamma
    ordinary = ordinary_segments(rows)
    return AutoTable(
        {ranks: table_from_rows(rows)},
        {ranks: meta},
        note="the simulator's alpha-beta model",
        ordinary={} if ordinary is None else {ranks: ordinary},
    )


def tuned_table(
    comm: Communicator,
    sizes: Sequence[int],
    *,
    mode: str = "first",
    cache: str | os.PathLike[str] | None = None,
    algorithms: Sequence[str] | None = None,
    repeat: int = REPEAT,
    min_time: float = MIN_TIME,
) -> Tuning:
    """The table ``auto`` should use for messages of ``sizes`` bytes on ``comm`` (collective; module
    docstring). Call it only where it is worth it: 2 ranks or more, ``mode`` not ``"never"``.

    Args:
        comm: the ranks that will run the allreduces.
        sizes: the message sizes in bytes (a run's bucket sizes).
        mode: ``"first"`` (time what the cache lacks) or ``"always"`` (time every size again).
        cache: the cache file (None: :func:`default_cache`).
        algorithms: the algorithms to choose among (None: :func:`available_algorithms`).
        repeat: interleaved repetitions per size.
        min_time: seconds per algorithm and repetition.
    """
    from hpcdl.comm import wtime
    from hpcdl.comm.context import host_ranks

    if mode not in ("first", "always"):
        raise ValueError(f"tuned_table's mode is first or always (got {mode!r}); never: do not call it")
    sizes = tuple(sorted({max(int(n) // 4, 1) * 4 for n in sizes if n > 0}))  # as timed: whole float32s
    ranks = comm.Get_size()
    alpha_beta = getattr(comm, "alpha_beta", None)
    if alpha_beta is not None:  # the simulator: its network's model, nothing timed
        alpha, beta = alpha_beta(ranks)
        memory_beta = getattr(comm, "memory_beta", None)
        gamma = memory_beta() if memory_beta is not None else None
        algorithms = available_algorithms(comm) if algorithms is None else tuple(algorithms)
        table = analytic_table(sizes, ranks, alpha, beta, algorithms, gamma)
        return Tuning(table, "analytic")  # recorded in the run file; nothing to say per run
    per_node = len(host_ranks(comm))
    path = Path(cache) if cache else default_cache()
    algorithms = available_algorithms(comm) if algorithms is None else tuple(algorithms)
    found = on_root(comm, lambda: _lookup(comm, path, per_node, algorithms, sizes, mode))
    entry, missing, lines = found["entry"], tuple(found["missing"]), list(found["lines"])
    seconds, cached = 0.0, True
    if missing:
        from hpcdl.comm.collectives.timing import time_algorithms

        t0 = wtime()
        try:
            rows = time_algorithms(comm, missing, algorithms, repeat, min_time)
        except NodeMemoryError as err:  # on every rank, before anything was timed
            without = tuple(a for a in algorithms if a not in NODE_ALGORITHMS)
            if without == algorithms:
                raise
            # this run chooses among the others; the cache keeps its entry for all of them, to be
            # completed by a run that has the room
            algorithms, cached = without, False
            lines.append(f"auto leaves out {', '.join(NODE_ALGORITHMS)} in this run: {err}")
            rows = time_algorithms(comm, missing, algorithms, repeat, min_time)
        seconds = float(comm.bcast(wtime() - t0, root=0))
        for r in rows:
            entry["times"].setdefault(str(r["size_bytes"]), {})[r["algorithm"]] = r["min_s"]
        if cached:
            stored, entry["date"] = on_root(comm, lambda: _store(path, found["key"], entry))
            lines += stored
            cached = not stored
    rows = [
        {"algorithm": a, "size_bytes": n, "ranks": ranks, "time_s": entry["times"][str(n)][a]}
        for n in sizes
        for a in algorithms
    ]
    meta: dict[str, Any] = {
        "source": "calibrated" if missing else "cache",
        "date": entry["date"],
        "machine": entry["machine"],
        "sizes": list(sizes),
        "calibration_s": seconds,
        "repeat": repeat,
        "min_time_s": min_time,
    }
    segments = table_from_rows(rows)
    ordinary = ordinary_segments(rows)
    choice = format_segments(segments)
    if ordinary is not None and ordinary != segments:
        choice += f" (in ordinary memory: {format_segments(ordinary)})"
    if missing:
        lines.append(
            f"auto calibrated {len(missing)} bucket size{'s' * (len(missing) > 1)} at {ranks} ranks in "
            f"{seconds:.2f} s: {choice}; {f'cached in {path}' if cached else 'not cached'} "
            "(exchange.auto_calibrate = never skips this)"
        )
    else:
        lines.append(f"auto from {path} (calibrated {entry['date']}): {choice}")
    meta["notes"] = lines
    table = AutoTable(
        {ranks: segments},
        {ranks: meta},
        note="calibrated where it ran",
        ordinary={} if ordinary is None else {ranks: ordinary},
    )
    return Tuning(table, meta["source"], seconds, missing, tuple(lines))


# -- helpers ---------------------------------------------------------------------------------


def _lookup(
    comm: Communicator,
    path: Path,
    per_node: int,
    algorithms: tuple[str, ...],
    sizes: tuple[int, ...],
    mode: str,
) -> dict[str, Any]:
    """Rank 0: this machine's entry in the cache (a fresh one when there is none, or a bad one)
    and the sizes it lacks."""
    from hpcdl.comm.machine import describe

    info = describe(comm, per_node)
    machine = {k: info[k] for k in KEY_FIELDS}
    key = cache_key(machine)
    fresh = {"machine": machine, "algorithms": list(algorithms), "date": "", "times": {}}
    lines: list[str] = []
    entries, why = _read(path)
    if why:
        lines.append(f"auto: cache {path} ignored ({why}); it will be rewritten")
    entry = entries.get(key)
    if entry is not None:
        stale = _stale(entry, machine, algorithms)
        if stale:
            lines.append(f"auto: cache entry for this machine in {path} ignored ({stale}); calibrating anew")
            entry = None
    if entry is None:
        entry = fresh
    have = entry["times"]
    missing = [n for n in sizes if mode == "always" or not all(a in have.get(str(n), {}) for a in algorithms)]
    return {"key": key, "entry": entry, "missing": missing, "lines": lines}


def _read(path: Path) -> tuple[dict[str, Any], str]:
    """The cache's entries, and why it was not usable ("" if it was, or is absent)."""
    return read_entries(path, CACHE_FORMAT, "an auto cache")


def _stale(entry: Any, machine: Mapping[str, Any], algorithms: tuple[str, ...]) -> str:
    """Why a cache entry cannot be used here ("" if it can)."""
    if not isinstance(entry, dict) or not isinstance(entry.get("times"), dict):
        return "damaged: no times"
    timed = entry.get("algorithms")
    if not isinstance(timed, list) or not all(isinstance(a, str) for a in timed):
        return "damaged: no list of algorithms"
    if entry.get("machine") != dict(machine):
        return "recorded for another machine: copied from elsewhere?"
    if sorted(timed) != sorted(algorithms):
        return f"timed {', '.join(timed)}; this hpcdl has {', '.join(algorithms)}"
    if not isinstance(entry.get("date"), str):
        return "damaged: no date"
    for per in entry["times"].values():
        if not isinstance(per, dict) or not all(
            isinstance(t, int | float) and math.isfinite(t) and t > 0 for t in per.values()
        ):
            return "damaged: a time is not a positive number"
    return ""


def _store(path: Path, key: str, entry: Mapping[str, Any]) -> tuple[list[str], str]:
    """Rank 0: ``entry`` written into the cache under ``key`` (other entries kept), dated now; a
    line if it cannot be, and the date (every rank's table carries rank 0's).

    Jobs that calibrate on one machine at once share the file: each reads, adds its entry
    and replaces it while holding a lock on ``<cache>.lock`` (``flock``; a file system
    without it writes unlocked), so that none loses another's entry, nor the sizes another
    job of the same key timed meanwhile."""
    date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    machine, timed = entry.get("machine"), entry.get("algorithms")
    same = isinstance(machine, dict) and isinstance(timed, list)

    def merged(old: Any) -> dict[str, Any]:
        times = dict(entry["times"])
        if same and not _stale(old, machine, tuple(timed)):
            times = {**old["times"], **times}  # a job of this key that timed other sizes meanwhile
        return {**entry, "times": times, "date": date}

    try:
        update_entry(path, key, merged, CACHE_FORMAT, what="the auto cache")
    except (OSError, HpcdlError) as err:
        why = f"auto: the calibration was not cached ({err}); set exchange.auto_cache to a writable file"
        return [why], date
    return [], date
