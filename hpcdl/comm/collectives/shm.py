"""The algorithm ``"shm"``: allreduce in memory that the ranks of one node share.

When every rank of a communicator runs on one node, each can read the others' buffers
directly if those buffers live in memory the node shares (an MPI-3 shared window,
``MPI_Win_allocate_shared``; in the simulator, the one process's memory). The allreduce then
moves no message but two barriers' worth:

1. a barrier: every rank's contribution is in place in its own segment;
2. rank ``r`` reduces chunk ``r`` (:func:`~hpcdl.comm.collectives.buffers.chunk_counts`) of
   every rank's buffer, read where it lies (its own value first, then the others' in rank
   order), scales it if asked, and writes the result into every rank's buffer; a barrier
   (after it no rank reads or writes another's buffer, so each may write its own again).

Each rank reads its chunk of every buffer and writes it into every buffer: the vector's
size read and written once, in one compiled pass (``hpcdl._ext.fused.sum_spread``, the bits
of NumPy's passes, which run when it is not built or the operation is MAX or MIN); the ring
also sends and receives ``2 (n - 1) / n`` of it through the MPI library's copies. Each
element is reduced on one rank only, so every rank ends with the same bits. The barriers are
dissemination barriers of empty point-to-point messages on the operation's tag
(``ceil(log2 n)`` rounds each), so that operations in flight at once stay apart, like the
other schedules.

The buffer must be node memory a :class:`~hpcdl.comm.collectives.Collectives` object gave
out (:meth:`~hpcdl.comm.collectives.Collectives.node_empty`), at the same place on every
rank: that is what lets a rank find the others' copy of it. The first barrier's messages
carry each rank's (block, offset, size, dtype) and a flag that travels on with the rounds,
so ranks that passed different places all raise the same error before any memory is
touched.

In the simulator the pass is charged by the network model, not measured: ``2 n`` bytes (its
chunk of each of the ``size`` buffers read and written) at the network file's
``intra.memory_GBps`` (the communicator's ``memory_pass``,
:meth:`hpcdl.sim.network.Network.memory_beta`), so that ``auto`` can price it
(:func:`hpcdl.comm.collectives.tune.analytic_time`). A network without that figure leaves
the pass to the compute model, like any work between communication calls, and ``auto``
there does not choose ``"shm"``.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from typing import Any

import numpy as np

from hpcdl.comm.collectives.buffers import Alloc, reduction, scale_in_place, scratch
from hpcdl.comm.collectives.schedule import Schedule, sendrecv
from hpcdl.comm.contract import Communicator

try:  # the compiled pass (sum, scale, spread in one)
    from hpcdl._ext import fused as _fused
except ImportError:  # not built: NumPy's passes
    _fused = None

__all__ = ["PLACE_BYTES", "NodeMemory", "agreeing_barrier", "allreduce", "barrier"]

#: bytes of each message of the allreduce's first barrier: the place (block, offset, size,
#: dtype) and the flag, as int64
PLACE_BYTES = 5 * 8


class NodeMemory:
    """One block of memory shared by the ranks of a communicator on one node: a segment per rank.

    Args:
        segments: every rank's segment (1-D ``uint8`` NumPy arrays of one length), by rank;
            this rank's is ``segments[rank]``.
        rank: this rank.
        sync: makes this rank's writes visible to the others and theirs to it (MPI's
            ``Win_sync``), called around each barrier.
        free: releases the memory (collective; MPI's ``Win_free``).
        ident: which block this is among those of one owner (the same on every rank), so
            that the ranks can check they reduce the same one.
    """

    __slots__ = ("_free", "ident", "rank", "segments", "start", "stop", "sync")

    def __init__(
        self,
        segments: Sequence[Any],
        rank: int,
        sync: Callable[[], None],
        free: Callable[[], None],
        ident: int = 0,
    ) -> None:
        self.segments = list(segments)
        self.ident = ident
        self.rank = rank
        self.sync = sync
        self._free: Callable[[], None] | None = free
        own = self.segments[rank]
        self.start = int(own.__array_interface__["data"][0])
        self.stop = self.start + own.nbytes

    def offset(self, arr: Any) -> int | None:
        """Where the C-contiguous NumPy array ``arr`` starts in this rank's segment (None: outside)."""
        if not isinstance(arr, np.ndarray):
            return None
        at = int(arr.__array_interface__["data"][0])
        if self.start <= at and at + arr.nbytes <= self.stop:
            return at - self.start
        return None

    def peers(self, arr: Any, offset: int) -> list[Any]:
        """Every rank's ``arr``: the same bytes of each segment, as ``arr``'s dtype and length."""
        n = arr.nbytes
        return [s[offset : offset + n].view(arr.dtype) for s in self.segments]

    def free(self) -> None:
        """Release the memory (collective; a second call does nothing)."""
        free, self._free = self._free, None
        if free is not None:
            self.segments = []
            free()


def barrier(comm: Communicator, tag: int, alloc: Alloc = scratch, like: Any = None) -> Schedule:
    """The rounds of a dissemination barrier on ``tag``: round ``k`` sends an empty message to
    ``rank + 2**k`` and receives one from ``rank - 2**k`` (``ceil(log2 size)`` rounds)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    like = like if like is not None else np.empty(0, np.uint8)
    token = alloc(like, 0, np.uint8)
    k = 1
    while k < size:
        yield sendrecv(comm, token, (rank + k) % size, alloc(like, 0, np.uint8), (rank - k) % size, tag)
        k <<= 1


def agreeing_barrier(comm: Communicator, tag: int, mine: Sequence[int]) -> Generator[Any, None, bool]:
    """A dissemination barrier whose messages carry ``mine`` (a few integers) and a flag: a rank
    that receives other integers than its own raises the flag, and the flag travels on with the
    rounds, which reach every rank from every other.

    Returns (as the value of ``yield from``):
        True on every rank when some two ranks passed different integers.
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    n = len(mine)
    out = np.zeros(n + 1, np.int64)
    out[:n] = mine
    bad = False
    k = 1
    while k < size:
        got = np.empty(n + 1, np.int64)
        out[n] = bad
        yield sendrecv(comm, out, (rank + k) % size, got, (rank - k) % size, tag)
        bad = bad or bool(got[n]) or not np.array_equal(got[:n], out[:n])
        k <<= 1
    return bad


def allreduce(
    comm: Communicator,
    src: Any,
    dst: Any,
    op: Any,
    tag: int,
    *,
    alloc: Alloc = scratch,
    memory: NodeMemory,
    offset: int,
    scale: float | None = None,
) -> Schedule:
    """Allreduce of ``src`` into ``dst``, which lies at ``offset`` of ``memory`` on every rank.

    ``src is dst``: in place; otherwise ``src`` is first copied into ``dst``. ``scale``: each
    rank multiplies its reduced chunk by it (in ``dst``'s dtype) before spreading it: the
    bits of a multiplication after the allreduce.
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    if src is not dst:
        dst[...] = src
    if size == 1 or dst.size == 0:
        if scale is not None:
            scale_in_place(dst, scale)
        return
    reduce = reduction(op, dst)
    views = memory.peers(dst, offset)
    q, r = divmod(dst.size, size)
    lo = rank * q + min(rank, r)
    hi = lo + q + (rank < r)
    mine = (memory.ident, offset, dst.nbytes, dst.dtype.num)
    memory.sync()
    differ = yield from agreeing_barrier(comm, tag, mine)  # every contribution is in place
    if differ:  # on every rank, before any rank touches another's memory
        raise ValueError(
            f"allreduce 'shm': the ranks passed different buffers (here node block {mine[0]}, byte "
            f"{offset}, {dst.nbytes} bytes of {dst.dtype}): every rank must pass the same place of the "
            "same Collectives.node_empty array, as MPI wants the same count and type"
        )
    memory.sync()

    def reduce_and_spread() -> None:
        if reduce is np.add and _fused is not None and _fused.sum_spread(views, rank, lo, hi, scale):
            return
        acc = dst[lo:hi]
        for p in range(size):
            if p != rank:
                reduce(acc, views[p][lo:hi], out=acc)
        if scale is not None:
            scale_in_place(acc, scale)
        for p in range(size):
            if p != rank:
                views[p][lo:hi] = acc

    memory_pass = getattr(comm, "memory_pass", None)  # a simulated world charges it by its model
    if memory_pass is None:
        reduce_and_spread()
    else:  # its chunk of every rank's buffer read, and written
        memory_pass(reduce_and_spread, 2 * size * (hi - lo) * dst.itemsize)
    memory.sync()
    yield from barrier(comm, tag, alloc, dst)  # every chunk is in every buffer; none is read any more
    memory.sync()  # the others' stores into this rank's buffer are visible to it
