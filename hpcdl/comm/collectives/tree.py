"""Binomial-tree reduce and broadcast, from any root (mpi4py's ``demo/reductions`` loops).

Ranks are renumbered relative to the root, ``vrank = (rank - root) % size``. Reduce: at
``mask = 1, 2, 4, ...`` a rank with bit ``mask`` set sends its partial result to
``vrank - mask`` and is done; the others receive from ``vrank + mask`` (if it exists) and
add. Broadcast runs the same tree the other way: receive from ``vrank - mask`` at the
lowest set bit, then send to ``vrank + mask`` for every lower ``mask``. Both take
``ceil(log2(size))`` steps and move the whole vector on every edge (latency-optimal).
"""

from __future__ import annotations

from typing import Any

from hpcdl.comm.collectives.buffers import Alloc, reduction, scratch
from hpcdl.comm.collectives.schedule import Schedule
from hpcdl.comm.contract import Communicator, Request

__all__ = ["bcast", "reduce"]


def reduce(
    comm: Communicator, src: Any, dst: Any | None, op: Any, root: int, tag: int, *, alloc: Alloc = scratch
) -> Schedule:
    """Reduce every rank's flat ``src`` into ``root``'s flat ``dst`` (``None`` elsewhere).

    ``src is dst`` on the root: in place.
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    vrank = (rank - root) % size
    if size == 1 or src.size == 0:
        if vrank == 0 and src is not dst:
            dst[...] = src
        return
    combine = reduction(op, src)
    cur, acc, theirs = src, None, None
    mask = 1
    while mask < size:
        if vrank & mask:
            yield [comm.Isend(cur, dest=(rank - mask) % size, tag=tag)]
            break
        if vrank + mask < size:
            if theirs is None:
                theirs = alloc(src, src.size)
                acc = dst if vrank == 0 else alloc(src, src.size)
            yield [comm.Irecv(theirs, source=(rank + mask) % size, tag=tag)]
            combine(cur, theirs, out=acc)
            cur = acc
        mask <<= 1
    if vrank == 0 and cur is not dst:
        dst[...] = cur


def bcast(comm: Communicator, buf: Any, root: int, tag: int) -> Schedule:
    """Broadcast ``root``'s flat ``buf`` into every rank's ``buf``."""
    rank, size = comm.Get_rank(), comm.Get_size()
    if size == 1 or buf.size == 0:
        return
    vrank = (rank - root) % size
    mask = 1
    while mask < size:
        if vrank & mask:
            yield [comm.Irecv(buf, source=(rank - mask) % size, tag=tag)]
            break
        mask <<= 1
    mask >>= 1
    sends: list[Request] = []
    while mask > 0:
        if vrank + mask < size:
            sends.append(comm.Isend(buf, dest=(rank + mask) % size, tag=tag))
        mask >>= 1
    if sends:
        yield sends
