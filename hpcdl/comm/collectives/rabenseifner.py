"""Rabenseifner's allreduce: a recursive-halving reduce-scatter, then a recursive-doubling allgather.

Among ``pof2`` ranks the vector is cut into ``pof2`` blocks (:func:`chunk_counts`). Halving:
at ``mask = pof2 / 2, pof2 / 4, ..., 1`` rank ``r`` and ``r ^ mask`` share a range of
``2 * mask`` blocks; each sends the half the other keeps and adds the half it receives, so
that rank ``r`` ends with block ``r`` reduced. Doubling: at ``mask = 1, 2, ...`` the
partners swap their ``mask`` reduced blocks. Each rank moves ``2 (pof2 - 1) / pof2`` of the
vector (like the ring) in ``2 log2(pof2)`` steps (unlike it). A rank count that is not a
power of two is folded first (:mod:`hpcdl.comm.collectives.fold`), as MPICH does.
"""

from __future__ import annotations

from typing import Any

from hpcdl.comm.collectives.buffers import Alloc, chunk_counts, chunk_offsets, scratch
from hpcdl.comm.collectives.fold import folded, old_rank
from hpcdl.comm.collectives.schedule import Schedule, sendrecv
from hpcdl.comm.contract import Communicator

__all__ = ["allreduce"]


def allreduce(
    comm: Communicator, src: Any, dst: Any, op: Any, tag: int, *, alloc: Alloc = scratch
) -> Schedule:
    """Rabenseifner's allreduce of the flat ``src`` into the flat ``dst`` (in place if same)."""

    def core(cur: Any, newrank: int, pof2: int, rem: int, reduce: Any) -> Schedule:
        off = chunk_offsets(chunk_counts(dst.size, pof2))
        theirs = alloc(dst, off[pof2 // 2])  # the larger half: the first blocks are longer
        # reduce-scatter by recursive halving: keep [lo, hi), a range of blocks halved each step
        lo, hi = 0, pof2
        mask = pof2 >> 1
        while mask:
            partner = old_rank(newrank ^ mask, rem)
            mid = lo + mask
            (k0, k1), (g0, g1) = ((mid, hi), (lo, mid)) if newrank & mask else ((lo, mid), (mid, hi))
            keep = slice(off[k0], off[k1])
            count = keep.stop - keep.start
            yield sendrecv(comm, cur[off[g0] : off[g1]], partner, theirs[:count], partner, tag)
            reduce(cur[keep], theirs[:count], out=dst[keep])
            cur = dst
            lo, hi = k0, k1
            mask >>= 1
        # allgather by recursive doubling: swap the 'mask' blocks each partner holds
        mask = 1
        while mask < pof2:
            partner_new = newrank ^ mask
            mine, their = (newrank // mask) * mask, (partner_new // mask) * mask
            partner = old_rank(partner_new, rem)
            yield sendrecv(
                comm,
                dst[off[mine] : off[mine + mask]],
                partner,
                dst[off[their] : off[their + mask]],
                partner,
                tag,
            )
            mask <<= 1

    return folded(comm, src, dst, op, tag, alloc, core)
