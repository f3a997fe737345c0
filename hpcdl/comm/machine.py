"""Where a process runs: the CPU, its cores, the BLAS and its kernel, the MPI library.

Benchmarks put :func:`describe`'s dict beside every row they write (``bench ... --json``) so
that figures from two machines can be told apart. Everything here is read, never measured: it
costs milliseconds.

The BLAS comes from `threadpoolctl <https://github.com/joblib/threadpoolctl>`_ (the library
NumPy loaded, its version, the kernel it chose for this CPU — OpenBLAS's ``architecture``, such as
``Zen`` or ``SkylakeX`` — and its thread count), the CPU from ``/proc/cpuinfo`` (``platform``
elsewhere). In the simulator the "MPI library" is the simulator.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

from hpcdl.comm.contract import Communicator

__all__ = [
    "THREAD_VARIABLES",
    "blas",
    "blas_share",
    "cpu_model",
    "describe",
    "fit_blas_threads",
    "machine_line",
    "mpi_library",
]

#: the environment variables that set a BLAS's thread count: when one is set, the user has chosen
THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS")


def cpu_model(cpuinfo: str | Path = "/proc/cpuinfo") -> str:
    """The CPU: model name and family/model/stepping from ``cpuinfo`` (``platform`` where it cannot
    be read; not the clock, which a CPU changes as it runs)."""
    fields: dict[str, str] = {}
    try:
        for line in Path(cpuinfo).read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())  # the first processor's
    except OSError:
        return platform.processor() or platform.machine() or "unknown"
    name = fields.get("model name", platform.processor() or platform.machine() or "unknown")
    ids = "/".join(fields.get(k, "?") for k in ("cpu family", "model", "stepping"))
    return f"{name} (family/model/stepping {ids})"


def blas() -> dict[str, Any]:
    """NumPy's BLAS: ``library`` (openblas, mkl, blis, ...), ``version``, ``kernel`` (the
    architecture it chose), ``threads``; ``library = "unknown"`` without threadpoolctl."""
    try:
        from threadpoolctl import threadpool_info  # noqa: PLC0415 - optional, read on demand
    except ImportError:
        return {"library": "unknown", "version": "", "kernel": "", "threads": 0}
    for pool in threadpool_info():
        if pool.get("user_api") == "blas":
            return {
                "library": str(pool.get("internal_api", "unknown")),
                "version": str(pool.get("version") or ""),
                "kernel": str(pool.get("architecture") or pool.get("threading_layer") or ""),
                "threads": int(pool.get("num_threads") or 0),
            }
    return {"library": "none", "version": "", "kernel": "", "threads": 0}


def mpi_library(comm: Communicator | None = None) -> str:
    """The MPI library's version line (whitespace collapsed), or the simulator's name."""
    if comm is not None and getattr(comm, "sim_attrs", None) is not None:
        return "hpcdl.sim (virtual ranks)"
    from hpcdl.comm.mpi import library_version  # noqa: PLC0415 - mpi4py on demand

    return " ".join(library_version().split())


def describe(comm: Communicator | None = None, ranks_per_node: int | None = None) -> dict[str, Any]:
    """Where this process runs, as a flat dict for a benchmark row or a run file.

    Args:
        comm: the world the benchmark ran on (its size, and the simulator's name for the
            library); None: this process alone.
        ranks_per_node: the ranks sharing this rank's node (:func:`hpcdl.comm.host_ranks`,
            which is collective, so the caller gathers it); None: not recorded.

    Returns:
        ``cpu``, ``cores``, ``blas``, ``blas_version``, ``blas_kernel``, ``blas_threads``,
        ``mpi``, ``python``, ``numpy``, and with ``comm`` ``ranks`` (and ``ranks_per_node``).
    """
    import numpy as np  # noqa: PLC0415 - keep this module light to import

    b = blas()
    out: dict[str, Any] = {
        "cpu": cpu_model(),
        "cores": os.cpu_count() or 0,
        "blas": b["library"],
        "blas_version": b["version"],
        "blas_kernel": b["kernel"],
        "blas_threads": b["threads"],
        "mpi": mpi_library(comm),
        "python": platform.python_version(),
        "numpy": np.__version__,
    }
    if comm is not None:
        out["ranks"] = comm.Get_size()
    if ranks_per_node is not None:
        out["ranks_per_node"] = ranks_per_node
    return out


def machine_line(info: dict[str, Any]) -> str:
    """A :func:`describe` dict in one line, for a benchmark's output."""
    kernel = f" {info['blas_kernel']}" if info["blas_kernel"] else ""
    threads = info["blas_threads"]
    where = f", {info['ranks']} rank{'s' * (info['ranks'] != 1)}" if "ranks" in info else ""
    node = f" ({info['ranks_per_node']} per node)" if "ranks_per_node" in info else ""
    return (
        f"{info['cpu']}, {info['cores']} cores; {info['blas']} {info['blas_version']}{kernel} "
        f"({threads} thread{'s' * (threads != 1)}); {info['mpi']}{where}{node}"
    )


def blas_share(ranks_on_node: int, cores: int | None = None, bound: int | None = None) -> int:
    """The BLAS threads a rank should use: its share of the node's ``cores``, and no more than the
    cores the launcher bound it to (``bound``, when fewer than the node's); at least 1."""
    cores = cores if cores is not None else os.cpu_count() or 1
    share = max(1, cores // max(1, ranks_on_node))
    if bound is not None and bound < cores:  # never more than its share (ranks bound to one socket)
        return max(1, min(bound, share))
    return share


def fit_blas_threads(comm: Communicator, env: Any = None) -> tuple[int, int] | None:
    """Give each rank's BLAS its share of the node's cores, unless the user chose (collective).

    N ranks on a node whose BLAS each starts one thread per core run N times as many threads
    as cores, and every matrix product fights for them. When none of :data:`THREAD_VARIABLES`
    is set, each rank's BLAS gets :func:`blas_share` threads (threadpoolctl). Nothing happens
    in the simulator (its virtual ranks share one process).

    Args:
        comm: the world.
        env: the environment to read (default ``os.environ``).

    Returns:
        ``(threads before, threads now)`` when the count was changed, else None.
    """
    if getattr(comm, "sim_attrs", None) is not None:
        return None
    from hpcdl.comm.context import host_ranks  # noqa: PLC0415 - collective, MPI on demand

    on_node = len(host_ranks(comm))
    env = os.environ if env is None else env
    if any(env.get(v) for v in THREAD_VARIABLES):
        return None
    try:
        from threadpoolctl import threadpool_limits  # noqa: PLC0415 - optional
    except ImportError:
        return None
    bound = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    threads = blas_share(on_node, bound=bound)
    before = blas()["threads"]
    if before in (0, threads):
        return None
    threadpool_limits(limits=threads, user_api="blas")
    return before, threads
