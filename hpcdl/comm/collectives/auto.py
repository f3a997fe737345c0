"""``auto``: the allreduce algorithm for a message size, from thresholds measured here.

The default threshold comes from ``python -m hpcdl.bench allreduce --repeat 5`` at
``mpiexec -n 2`` on the development machine (2 cores, MPICH 5.0.2, shared memory;
2026-11-22): MPI's own allreduce was fastest from 4 KB to 64 KB (hpcdl's best,
recursive doubling, took 1.03-2.03x its time there); at 256 KB all were within 8%; from
1 MB up, ring and Rabenseifner beat it (0.39-0.80x its time). Re-measure on another
system and set ``exchange.auto_threshold_kb`` (stored in checkpoints).
"""

from __future__ import annotations

__all__ = ["DEFAULT_THRESHOLD_BYTES", "SMALL", "LARGE", "choose"]

#: below this many bytes, ``auto`` takes the small-message algorithm
DEFAULT_THRESHOLD_BYTES = 512 * 1024
#: latency-bound messages: the library's own (MPICH switches among its algorithms itself)
SMALL = "mpi"
#: bandwidth-bound messages: the ring (bandwidth-optimal at any rank count)
LARGE = "ring"


def choose(nbytes: int, threshold_bytes: int = DEFAULT_THRESHOLD_BYTES) -> str:
    """The algorithm ``auto`` uses for a message of ``nbytes``."""
    return SMALL if nbytes < threshold_bytes else LARGE
