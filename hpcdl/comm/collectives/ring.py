"""Ring collectives: reduce-scatter, allgather, and allreduce as the one followed by the other.

Each rank sends to ``dest = (rank + 1) % size`` and receives from ``source = (rank - 1) % size``;
the vector is cut into ``size`` chunks (:func:`chunk_counts`: the first ``n % size`` one
element longer). In ``size - 1`` rounds of the reduce-scatter each chunk travels once around
the ring, gathering one contribution per hop, and ends complete on rank ``chunk``; the
allgather then passes the complete chunks ``size - 1`` hops on. Each rank sends and receives
``2 (size - 1) / size`` of the vector: bandwidth-optimal, with ``2 (size - 1)`` latencies.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hpcdl.comm.collectives.buffers import (
    Alloc,
    chunk_counts,
    chunk_offsets,
    reduction,
    scale_in_place,
    scratch,
)
from hpcdl.comm.collectives.schedule import Schedule, sendrecv
from hpcdl.comm.contract import Communicator

__all__ = ["allgather", "allreduce", "reduce_scatter"]


def _ring_reduce_scatter(
    comm: Communicator,
    src: Any,
    reduce: Any,
    tag: int,
    target: Callable[[int, int, int], Any],
    alloc: Alloc = scratch,
) -> Schedule:
    """The rounds of a ring reduce-scatter of ``src``; rank r ends with chunk r in ``target``.

    Round ``step`` sends the partial sum of chunk ``(rank - step - 1) % size`` (at step 0,
    this rank's own contribution) and receives the partial sum of chunk
    ``(rank - step - 2) % size``, adds its own contribution and stores it in
    ``target(step, lo, hi)`` (the chunk is ``[lo, hi)`` of the vector), which is what the
    next round sends. Chunk bounds are computed, not looked up: at 1,024 ranks, tables of
    offsets per rank no longer fit in the cache of a simulation.
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    source, dest = (rank - 1) % size, (rank + 1) % size
    q, r = divmod(src.size, size)  # chunk c is [c q + min(c, r), ...) with q + (c < r) elements
    inbox = alloc(src, q + (r > 0))
    c = (rank - 1) % size
    lo = c * q + (c if c < r else r)
    outgoing = src[lo : lo + q + (c < r)]
    for step in range(size - 1):
        c = (rank - step - 2) % size
        lo = c * q + (c if c < r else r)
        hi = lo + q + (c < r)
        incoming = inbox[: hi - lo]
        yield sendrecv(comm, outgoing, dest, incoming, source, tag)
        partial = target(step, lo, hi)
        reduce(src[lo:hi], incoming, out=partial)
        outgoing = partial


def _ring_allgather(comm: Communicator, dst: Any, tag: int) -> Schedule:
    """The rounds of a ring allgather in ``dst``, where rank r's chunk r is already in place.

    Round ``step`` sends chunk ``(rank - step) % size`` and receives chunk
    ``(rank - step - 1) % size``, straight into its place in ``dst`` (chunks as
    :func:`~hpcdl.comm.collectives.buffers.chunk_counts` cuts them).
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    source, dest = (rank - 1) % size, (rank + 1) % size
    q, r = divmod(dst.size, size)
    c = rank
    lo = c * q + (c if c < r else r)
    for step in range(size - 1):
        out_lo, out_hi = lo, lo + q + (c < r)
        c = (rank - step - 1) % size
        lo = c * q + (c if c < r else r)
        yield sendrecv(comm, dst[out_lo:out_hi], dest, dst[lo : lo + q + (c < r)], source, tag)


def allreduce(
    comm: Communicator,
    src: Any,
    dst: Any,
    op: Any,
    tag: int,
    *,
    alloc: Alloc = scratch,
    scale: float | None = None,
) -> Schedule:
    """Ring allreduce of the flat ``src`` into the flat ``dst`` (``src is dst``: in place).

    ``scale``: each rank multiplies the chunk it completes by it (in ``dst``'s dtype) before
    the allgather passes it on: the bits of a multiplication after, on ``1 / size`` of the vector.
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    if size == 1 or dst.size == 0:
        if src is not dst:
            dst[...] = src
        if scale is not None:
            scale_in_place(dst, scale)
        return

    def in_dst(step: int, lo: int, hi: int) -> Any:
        return dst[lo:hi]

    yield from _ring_reduce_scatter(comm, src, reduction(op, dst), tag, in_dst, alloc)
    if scale is not None:
        q, r = divmod(dst.size, size)
        lo = rank * q + min(rank, r)
        scale_in_place(dst[lo : lo + q + (rank < r)], scale)
    yield from _ring_allgather(comm, dst, tag)


def reduce_scatter(
    comm: Communicator, src: Any, out: Any, op: Any, tag: int, *, alloc: Alloc = scratch
) -> Schedule:
    """Ring reduce-scatter: chunk ``rank`` of the reduction of every rank's ``src`` into ``out``.

    ``out`` may overlap ``src`` only as MPI's in-place reduce-scatter does (``out`` is the
    start of ``src``): the last round reads chunk ``rank`` of ``src`` and writes ``out``
    elementwise, and earlier rounds write a private buffer.
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    counts = chunk_counts(src.size, size)
    off = chunk_offsets(counts)
    if size == 1 or src.size == 0:
        if out is not src:
            out[...] = src[off[rank] : off[rank + 1]]
        return
    acc = alloc(src, max(counts))

    def partial(step: int, lo: int, hi: int) -> Any:
        return out if step == size - 2 else acc[: hi - lo]

    yield from _ring_reduce_scatter(comm, src, reduction(op, src), tag, partial, alloc)


def allgather(comm: Communicator, mine: Any, dst: Any, tag: int) -> Schedule:
    """Ring allgather: every rank's ``mine`` (chunk ``rank`` of ``dst``) into every ``dst``.

    ``mine is None``: this rank's chunk is already in place in ``dst``.
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    counts = chunk_counts(dst.size, size)
    off = chunk_offsets(counts)
    if mine is not None:
        dst[off[rank] : off[rank + 1]] = mine
    if size == 1 or dst.size == 0:
        return
    yield from _ring_allgather(comm, dst, tag)
