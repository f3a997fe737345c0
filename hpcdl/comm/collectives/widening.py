"""Allreduce of a compressed buffer (float16, or bfloat16 bits) with the sum accumulated in float32.

A compressed gradient exchange sends 2-byte values, but summing them in 2-byte arithmetic
rounds once per hop: a ring allreduce over N ranks rounds each element N - 1 times and the
error grows with N. Here each rank owns one chunk and adds every rank's contribution to it
in a **float32 accumulator**, then rounds once:

1. reduce-scatter by pairwise exchange: in round k = 1 .. N-1, rank r sends its chunk
   (r + k) % N, in wire format, to rank (r + k) % N and receives its own chunk r from rank
   (r - k) % N, widens it and adds it to its float32 accumulator (which started as its own
   chunk, widened). Each round is a permutation: no rank receives from two at once.
2. the sum, rounded once to the wire format, is allgathered around the ring.

So the result is ``round(sum over ranks of round(g_r))``, exactly what an exact sum of the
compressed values followed by one rounding gives (up to float32's own summation order), at
the ring's cost: each rank sends and receives ``2 (N - 1) / N`` of the vector, in
``2 (N - 1)`` rounds.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hpcdl.comm.collectives.buffers import Alloc, chunk_counts, chunk_offsets, scratch
from hpcdl.comm.collectives.ring import _ring_allgather
from hpcdl.comm.collectives.schedule import Schedule, sendrecv
from hpcdl.comm.contract import Communicator
from hpcdl.comm.pack import narrow_into, widen_into

__all__ = ["WIRE_FORMATS", "allreduce"]

#: compressed formats this allreduce sums, and the dtype of their buffers
WIRE_FORMATS: dict[str, np.dtype] = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(np.uint16)}


def allreduce(
    comm: Communicator, src: Any, dst: Any, tag: int, wire: str = "float16", *, alloc: Alloc = scratch
) -> Schedule:
    """Sum of every rank's flat ``src`` into the flat ``dst``, accumulated in float32.

    Args:
        comm: the communicator.
        src: this rank's values in ``wire`` format (``src is dst``: in place).
        dst: the result, same size and dtype.
        tag: the tag of this operation's messages.
        wire: ``"float16"`` (buffers of ``float16``) or ``"bfloat16"`` (its bits in ``uint16``).
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    if size == 1 or dst.size == 0:
        if src is not dst:
            dst[...] = src
        return
    counts = chunk_counts(dst.size, size)
    off = chunk_offsets(counts)
    mine = slice(off[rank], off[rank + 1])
    acc = widen_into(wire, src[mine], alloc(src, counts[rank], np.float32))
    tmp = alloc(src, counts[rank], np.float32)
    inbox = alloc(src, counts[rank])
    for k in range(1, size):
        dest, source = (rank + k) % size, (rank - k) % size
        yield sendrecv(comm, src[off[dest] : off[dest + 1]], dest, inbox, source, tag)
        acc += widen_into(wire, inbox, tmp)
    narrow_into(wire, acc, dst[mine])  # src is read no more: in place is safe from here
    yield from _ring_allgather(comm, dst, tag)
