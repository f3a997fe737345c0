"""The fold of a non-power-of-two rank count into a power-of-two subset (MPICH's allreduce).

With ``size = pof2 + rem`` (``pof2`` the largest power of two not above ``size``), the
first ``2 * rem`` ranks pair up: each even one sends its vector to the odd one above it and
sits out, the odd one adds it. The ``pof2`` remaining ranks (the odd ones below ``2 * rem``
and all ranks from ``2 * rem`` on) run the power-of-two algorithm under new ranks
``0 .. pof2 - 1``; afterwards each odd rank sends the result back to its even partner.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from typing import Any

from hpcdl.comm.collectives.buffers import Alloc, reduction, scratch
from hpcdl.comm.collectives.schedule import Schedule
from hpcdl.comm.contract import Communicator, Request

__all__ = ["fold_in", "fold_out", "folded", "new_rank", "old_rank", "split_pof2"]


def split_pof2(size: int) -> tuple[int, int]:
    """``(pof2, rem)``: the largest power of two ``<= size``, and ``size - pof2``."""
    pof2 = 1 << (size.bit_length() - 1)
    return pof2, size - pof2


def new_rank(rank: int, rem: int) -> int:
    """The rank among the ``pof2`` that stay in, or ``-1`` for an even rank that sits out."""
    if rank < 2 * rem:
        return -1 if rank % 2 == 0 else rank // 2
    return rank - rem


def old_rank(newrank: int, rem: int) -> int:
    """The communicator rank of the rank numbered ``newrank`` among the ``pof2``."""
    return newrank * 2 + 1 if newrank < rem else newrank + rem


def fold_in(
    comm: Communicator, src: Any, dst: Any, reduce: Any, tag: int, alloc: Alloc = scratch
) -> Generator[Sequence[Request], None, Any]:
    """Fold the extra ranks in: even ranks below ``2 * rem`` hand their ``src`` to ``rank + 1``.

    Returns (as the value of ``yield from``):
        The vector this rank goes on with: ``dst`` holding ``src`` plus the partner's on an
        odd rank below ``2 * rem``, ``src`` itself on the ranks above, ``None`` on a rank
        that sits out.
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    _, rem = split_pof2(size)
    if rank >= 2 * rem:
        return src
    if rank % 2 == 0:
        yield [comm.Isend(src, dest=rank + 1, tag=tag)]
        return None
    theirs = alloc(dst, dst.size)
    yield [comm.Irecv(theirs, source=rank - 1, tag=tag)]
    reduce(src, theirs, out=dst)
    return dst


def fold_out(comm: Communicator, dst: Any, tag: int) -> Schedule:
    """Send the result in ``dst`` back from each odd rank below ``2 * rem`` to its even partner."""
    rank, size = comm.Get_rank(), comm.Get_size()
    _, rem = split_pof2(size)
    if rank < 2 * rem:
        if rank % 2 == 0:
            yield [comm.Irecv(dst, source=rank + 1, tag=tag)]
        else:
            yield [comm.Isend(dst, dest=rank - 1, tag=tag)]


#: The power-of-two part of an allreduce: ``core(cur, newrank, pof2, rem, reduce)`` reduces
#: ``cur`` (this rank's vector, after the fold) into ``dst`` among the ``pof2`` ranks.
Core = Callable[[Any, int, int, int, Any], Schedule]


def folded(comm: Communicator, src: Any, dst: Any, op: Any, tag: int, alloc: Alloc, core: Core) -> Schedule:
    """An allreduce of ``src`` into ``dst`` by a power-of-two algorithm ``core``, folded around it.

    One rank or an empty vector: a copy. Otherwise the extra ranks fold in, the ``pof2``
    ranks run ``core`` (its new rank, ``reduce`` the ufunc of ``op``), and the extra ranks
    get the result back.
    """
    size = comm.Get_size()
    if size == 1 or dst.size == 0:
        if src is not dst:
            dst[...] = src
        return
    reduce = reduction(op, dst)
    pof2, rem = split_pof2(size)
    cur = (yield from fold_in(comm, src, dst, reduce, tag, alloc)) if rem else src  # no fold: no generator
    if cur is not None:
        yield from core(cur, new_rank(comm.Get_rank(), rem), pof2, rem, reduce)
    if rem:
        yield from fold_out(comm, dst, tag)
