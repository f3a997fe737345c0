"""A node's compute contention for ``bench calibrate``: kernels timed alone and on k ranks at once.

The simulator runs its virtual ranks one at a time, each alone on a core, so ``measured``
compute misses what real ranks sharing a node cost each other (memory bandwidth, the
shared cache). ``bench calibrate`` measures it on rank 0's host: each kernel is timed on
rank 0 alone (the other ranks wait, asleep between polls so that they leave the cores and
the memory alone) and on the first ``k`` ranks of the host at once, for ``k`` = 2, 4, 8,
... and every rank of the host. The slow-down at ``k`` is the median time at once over
the median time alone; the network file's ``compute.contention`` is the slow-down of the
:data:`FACTOR_KERNEL`, linear between the measured ``k``, never below 1.

Kernels (:func:`kernels`):

* ``step``: hpcdl's own training step (mlp32 at batch 128: forward, backward, SGD with
  momentum): the GEMMs and the streaming updates of what ``measured`` compute times. Its
  slow-down is the one written.
* ``matmul``: 20 products of 256 x 256 float32 matrices: compute-bound, in cache.
* ``triad``: ``a = b + s c`` on float64 arrays of 16 MiB, four times: memory-bound
  (STREAM's triad). ``matmul`` and ``triad`` bound what a model can see (printed and
  written as comments beside the factor).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from hpcdl.comm import Communicator, on_root, sleep, subcomm, wtime

__all__ = ["FACTOR_KERNEL", "KERNELS", "factors", "idle_barrier", "kernels", "levels", "measure"]

#: the kernels, in the order they are timed
KERNELS: tuple[str, ...] = ("step", "matmul", "triad")
#: the kernel whose slow-down becomes the network file's ``compute.contention``
FACTOR_KERNEL = "step"
#: float64 elements of each triad array (16 MiB: three of them are past most last-level caches)
TRIAD_ELEMENTS = 2 << 20
_TAG = 78


def kernels() -> dict[str, Callable[[], None]]:
    """The kernels of the module docstring, each a call that takes a few to tens of milliseconds."""
    from hpcdl.bench.step import _hpcdl_stepper

    _, step, _ = _hpcdl_stepper("mlp32", 128, (1, 28, 28), 10, 0)
    rng = np.random.default_rng(0)
    m1, m2 = (rng.standard_normal((256, 256), dtype=np.float32) for _ in range(2))
    m3 = np.empty_like(m1)
    a, b, c = np.zeros(TRIAD_ELEMENTS), np.ones(TRIAD_ELEMENTS), np.full(TRIAD_ELEMENTS, 2.0)

    def matmul() -> None:
        for _ in range(20):
            np.matmul(m1, m2, out=m3)

    def triad() -> None:
        for _ in range(4):
            np.multiply(c, 3.0, out=a)
            np.add(a, b, out=a)

    return {"step": step, "matmul": matmul, "triad": triad}


def levels(ranks: int) -> list[int]:
    """The numbers of ranks timed at once on a host of ``ranks``: 1, 2, 4, ... and ``ranks``."""
    out, k = [], 1
    while k < ranks:
        out.append(k)
        k *= 2
    return [*out, ranks]


def factors(slowdown: dict[int, float], ranks: int) -> list[float]:
    """``compute.contention`` for 1 to ``ranks`` ranks on a node from the slow-downs measured at some counts.

    Linear between the measured counts; each entry at least 1 (a node's ranks do not speed
    each other up: a figure below 1 is noise) and rounded to 3 decimals; entry 0 is 1.

    Args:
        slowdown: measured slow-down by ranks at once (1 must be there).
        ranks: the ranks of the node.
    """
    ks = sorted(slowdown)
    out = []
    for k in range(1, ranks + 1):
        hi = next(j for j in ks if j >= k)
        lo = max(j for j in ks if j <= k)
        f = slowdown[lo] if hi == lo else slowdown[lo] + (slowdown[hi] - slowdown[lo]) * (k - lo) / (hi - lo)
        out.append(1.0 if k == 1 else round(max(1.0, f), 3))
    return out


def idle_barrier(comm: Communicator, poll_s: float = 1e-3) -> None:
    """A barrier whose ranks sleep between polls: waiting ranks leave the cores and the memory alone.

    (MPI's own barrier spins: the waiting ranks would compete with the one being timed.)
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    token = np.zeros(1, dtype=np.uint8)
    if rank == 0:
        pending = [comm.Irecv(np.zeros(1, dtype=np.uint8), r, _TAG) for r in range(1, size)]
        while pending:
            pending = [r for r in pending if not r.Test()]
            if pending:
                sleep(poll_s)
        for r in range(1, size):
            comm.Send(token, r, _TAG)
    else:
        comm.Send(token, 0, _TAG)
        req = comm.Irecv(token, 0, _TAG)
        while not req.Test():
            sleep(poll_s)


def measure(comm: Communicator, host: Sequence[int], repeat: int) -> list[dict[str, Any]]:
    """Time every kernel alone and with ``k`` of the ``host`` ranks at once (collective over ``comm``).

    Args:
        comm: the world.
        host: the ranks of rank 0's host, rank 0 first.
        repeat: samples per kernel and count (interleaved; the median is used).

    Returns:
        One row per (kernel, ranks at once), the same on every rank: ``kernel``,
        ``ranks_at_once``, ``median_s``, ``min_s``, ``max_s``, ``samples`` (at once: one per
        rank per repetition), ``slowdown`` (median over the median alone), ``cpu_share``
        (median of the samples' CPU time over their wall time: below 1, the ranks shared
        their cores with something else).
    """
    rank = comm.Get_rank()
    host = list(host)
    ks = levels(len(host))
    subs = {k: subcomm(comm, host[:k]) for k in ks if rank in host[:k]}  # only the members call
    calls = kernels() if rank in host else {}
    for call in calls.values():  # warm-up: first touches, BLAS buffers
        call()
    # (seconds, CPU seconds of the rank's thread) per sample: a CPU share below 1 says the
    # rank was not alone on its core (another job), which no contention figure survives
    samples: dict[tuple[str, int], list[tuple[float, float]]] = {(n, k): [] for n in KERNELS for k in ks}
    for _ in range(repeat):
        for name in KERNELS:
            for k in ks:
                idle_barrier(comm)
                if k in subs:
                    subs[k].Barrier()  # the k ranks start together
                    t0, c0 = wtime(), time.thread_time()
                    calls[name]()
                    samples[name, k].append((wtime() - t0, time.thread_time() - c0))
    idle_barrier(comm)
    for sub in subs.values():
        sub.Free()
    gathered = comm.gather(samples, root=0)

    def rows() -> list[dict[str, Any]]:
        out = []
        for name in KERNELS:
            alone = statistics.median(t for t, _ in gathered[0][name, 1])
            for k in ks:
                both = [s for part in gathered for s in part[name, k]]
                ts = [t for t, _ in both]
                out.append(
                    {
                        "kernel": name,
                        "ranks_at_once": k,
                        "median_s": statistics.median(ts),
                        "min_s": min(ts),
                        "max_s": max(ts),
                        "samples": len(ts),
                        "slowdown": statistics.median(ts) / alone if alone > 0 else 1.0,  # 0: --compute none
                        "cpu_share": statistics.median(min(1.0, c / t) if t > 0 else 1.0 for t, c in both),
                    }
                )
        return out

    return on_root(comm, rows)
