"""Timing the allreduce algorithms against each other: what ``auto``'s table is made from.

:func:`time_algorithms` is the measurement behind ``python -m hpcdl.bench allreduce`` (and its
``--calibrate``); it lives with the collectives so that a run can time the sizes of its own
buckets on the machine it runs on, in MPI and in the simulator alike (collective, no threads,
the world's clock).
"""

from __future__ import annotations

import math
import statistics
from typing import Any

import numpy as np

from hpcdl.comm import MAX, wtime
from hpcdl.comm.collectives.api import ALGORITHMS, NODE_ALGORITHMS, Collectives
from hpcdl.comm.collectives.auto import AutoTable
from hpcdl.comm.contract import Communicator
from hpcdl.errors import ConfigError

__all__ = ["calls_for", "time_algorithms", "time_per_call"]


def _caller(coll: Collectives, send: Any, recv: Any, algorithm: str, scale: float | None = None) -> Any:
    return lambda: coll.Allreduce(send, recv, algorithm=algorithm, scale=scale)


def time_per_call(comm: Communicator, call: Any, iters: int) -> float:
    """Seconds per call of ``call`` over ``iters`` calls after a barrier, the max over ranks."""
    comm.Barrier()
    t0 = wtime()
    for _ in range(iters):
        call()
    return comm.allreduce((wtime() - t0) / iters, op=MAX)


def calls_for(comm: Communicator, call: Any, min_time: float) -> int:
    """How many calls of ``call`` take about ``min_time`` seconds (collective: the same on every
    rank): timed over 1, 4, 16, ... calls until that takes a quarter of ``min_time``."""
    k = 1
    while (t := time_per_call(comm, call, k)) * k < min_time / 4:  # the same t on every rank
        k *= 4
    return max(1, math.ceil(min_time / t))


def time_algorithms(
    comm: Communicator,
    sizes: tuple[int, ...],
    algorithms: tuple[str, ...] = (*ALGORITHMS, "auto"),
    repeat: int = 5,
    min_time: float = 0.02,
    dtype: str = "float32",
    auto: AutoTable | None = None,
) -> list[dict[str, Any]]:
    """Allreduce time of each algorithm at each of ``sizes`` (bytes), as medians of interleaved
    repetitions; collective.

    For each size, each algorithm is run once to warm up, then timed over 1, 4, 16, ...
    calls until that takes a quarter of ``min_time``, which sets its ``iters`` (so that a
    measurement takes about ``min_time``); then each repetition times
    ``iters`` calls of every algorithm in turn, after a barrier, taking the slowest rank's
    time. Buffers are out of place (``sendbuf`` is not ``recvbuf``); with ``"shm"`` among
    ``algorithms``, every algorithm runs in place and takes the mean (``scale = 1 / size``),
    as the bucketed exchange runs them: the node algorithms (and ``auto`` where it picks one)
    on node memory, the others on ordinary memory.

    Args:
        auto: the table ``auto`` picks from (``None``: the packaged default); the same on
            every rank.

    Returns:
        One row per (size, algorithm): ``algorithm``, ``picked`` (the algorithm that ran:
        ``auto``'s choice, else ``algorithm``), ``size_bytes``, ``ranks``, ``time_s``
        (median), ``min_s`` (the fastest repetition), ``iqr_s``, ``algbw_GBps`` (size /
        time), ``busbw_GBps`` (algbw · 2 (n - 1) / n, nccl-tests' definition),
        ``time_vs_mpi``, ``iters``, ``repeat``.
    """
    size_n = comm.Get_size()
    item = np.dtype(dtype).itemsize
    rows: list[dict[str, Any]] = []
    with Collectives(comm, auto=auto) as coll:
        block = None  # node memory for the largest size, each size at its start
        if set(algorithms) & set(NODE_ALGORITHMS):
            block = coll.node_empty(max(max(nbytes // item, 1) for nbytes in sizes), dtype)
            if block is None:
                raise ConfigError(
                    f"{', '.join(NODE_ALGORITHMS)} runs in memory the ranks of one node share: these "
                    f"{size_n} ranks are not all on one node (leave it out of --algorithms)"
                )
        for nbytes in sizes:
            n = max(nbytes // item, 1)
            send = np.random.default_rng([0, comm.Get_rank()]).standard_normal(n).astype(dtype)
            recv = np.empty_like(send)
            if block is None:
                calls = {a: _caller(coll, send, recv, a) for a in algorithms}
            else:  # in place, taking the mean, as the exchange runs them: a node algorithm (and auto's
                # pick of one) on node memory, the others on ordinary memory, where the exchange keeps
                # their buckets (MPICH was up to 1.6x slower on a shared window's pages here)
                node = block[:n]
                node[...] = send
                recv[...] = send
                calls = {
                    a: _caller(coll, node, node, a, 1.0 / size_n)
                    if _picked(coll, a, n * item, size_n, True) in NODE_ALGORITHMS
                    else _caller(coll, recv, recv, a, 1.0 / size_n)
                    for a in algorithms
                }
            iters = {}
            for name, call in calls.items():
                call()
                iters[name] = calls_for(comm, call, min_time)
            times: dict[str, list[float]] = {a: [] for a in algorithms}
            for _ in range(repeat):
                for name, call in calls.items():
                    times[name].append(time_per_call(comm, call, iters[name]))
            for name, ts in times.items():
                t = statistics.median(ts)
                q1, q3 = np.percentile(ts, [25, 75])
                algbw = n * item / t / 1e9
                rows.append(
                    {
                        "algorithm": name,
                        "picked": _picked(coll, name, n * item, size_n, block is not None),
                        "size_bytes": n * item,
                        "ranks": size_n,
                        "time_s": t,
                        "min_s": min(ts),
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


def _picked(coll: Collectives, algorithm: str, nbytes: int, ranks: int, node: bool) -> str:
    """The algorithm that ran: ``auto``'s choice from its table (for ordinary memory where the
    buffer is, :meth:`~hpcdl.comm.collectives.auto.AutoTable.segments_for`), else ``algorithm``."""
    if algorithm != "auto":
        return algorithm
    return coll.auto.choose(nbytes, ranks, node)
