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

from hpcdl.comm.collectives.buffers import Alloc, chunk_counts, chunk_offsets, reduction, scratch
from hpcdl.comm.collectives.schedule import Schedule, sendrecv
from hpcdl.comm.contract import Communicator

__all__ = ["allgather", "allreduce", "reduce_scatter"]


def _ring_reduce_scatter(
    comm: Communicator,
    src: Any,
    reduce: Any,
    tag: int,
    counts: list[int],
    target: Callable[[int, int], Any],
    alloc: Alloc = scratch,
) -> Schedule:
    """The rounds of a ring reduce-scatter of ``src``; rank r ends with chunk r in ``target``.

    Round ``step`` sends the partial sum of chunk ``(rank - step - 1) % size`` (at step 0,
    this rank's own contribution) and receives the partial sum of chunk
    ``(rank - step - 2) % size``, adds its own contribution and stores it in
    ``target(step, chunk)``, which is what the next round sends.
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    source, dest = (rank - 1) % size, (rank + 1) % size
    off = chunk_offsets(counts)
    inbox = alloc(src, max(counts))
    send_chunk = (rank - 1) % size
    outgoing = src[off[send_chunk] : off[send_chunk + 1]]
    for step in range(size - 1):
        chunk = (rank - step - 2) % size
        count = counts[chunk]
        yield sendrecv(comm, outgoing, dest, inbox[:count], source, tag)
        partial = target(step, chunk)
        reduce(src[off[chunk] : off[chunk + 1]], inbox[:count], out=partial)
        outgoing = partial


def _ring_allgather(comm: Communicator, dst: Any, tag: int, counts: list[int]) -> Schedule:
    """The rounds of a ring allgather in ``dst``, where rank r's chunk r is already in place.

    Round ``step`` sends chunk ``(rank - step) % size`` and receives chunk
    ``(rank - step - 1) % size``, straight into its place in ``dst``.
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    source, dest = (rank - 1) % size, (rank + 1) % size
    off = chunk_offsets(counts)
    for step in range(size - 1):
        out_chunk, in_chunk = (rank - step) % size, (rank - step - 1) % size
        yield sendrecv(
            comm,
            dst[off[out_chunk] : off[out_chunk + 1]],
            dest,
            dst[off[in_chunk] : off[in_chunk + 1]],
            source,
            tag,
        )


def allreduce(
    comm: Communicator, src: Any, dst: Any, op: Any, tag: int, *, alloc: Alloc = scratch
) -> Schedule:
    """Ring allreduce of the flat ``src`` into the flat ``dst`` (``src is dst``: in place)."""
    size = comm.Get_size()
    if size == 1 or dst.size == 0:
        if src is not dst:
            dst[...] = src
        return
    counts = chunk_counts(dst.size, size)
    off = chunk_offsets(counts)

    def in_dst(step: int, chunk: int) -> Any:
        return dst[off[chunk] : off[chunk + 1]]

    yield from _ring_reduce_scatter(comm, src, reduction(op, dst), tag, counts, in_dst, alloc)
    yield from _ring_allgather(comm, dst, tag, counts)


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

    def partial(step: int, chunk: int) -> Any:
        return out if step == size - 2 else acc[: counts[chunk]]

    yield from _ring_reduce_scatter(comm, src, reduction(op, src), tag, counts, partial, alloc)


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
    yield from _ring_allgather(comm, dst, tag, counts)
