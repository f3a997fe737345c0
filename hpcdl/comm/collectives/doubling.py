"""Recursive-doubling allreduce: ``log2(size)`` exchanges of the whole vector (latency-optimal).

At step ``mask = 1, 2, 4, ...`` rank ``r`` swaps its partial result with rank ``r ^ mask``
and adds the two; after the last step every rank holds the full reduction. A rank count
that is not a power of two is folded first (:mod:`hpcdl.comm.collectives.fold`).
"""

from __future__ import annotations

from typing import Any

from hpcdl.comm.collectives.buffers import Alloc, scratch
from hpcdl.comm.collectives.fold import folded, old_rank
from hpcdl.comm.collectives.schedule import Schedule, sendrecv
from hpcdl.comm.contract import Communicator

__all__ = ["allreduce"]


def allreduce(
    comm: Communicator, src: Any, dst: Any, op: Any, tag: int, *, alloc: Alloc = scratch
) -> Schedule:
    """Recursive-doubling allreduce of the flat ``src`` into the flat ``dst`` (in place if same)."""

    def core(cur: Any, newrank: int, pof2: int, rem: int, reduce: Any) -> Schedule:
        theirs = alloc(dst, dst.size)
        mask = 1
        while mask < pof2:
            partner = old_rank(newrank ^ mask, rem)
            yield sendrecv(comm, cur, partner, theirs, partner, tag)
            reduce(cur, theirs, out=dst)
            cur = dst
            mask <<= 1

    return folded(comm, src, dst, op, tag, alloc, core)
