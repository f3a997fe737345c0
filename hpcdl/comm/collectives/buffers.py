"""Buffers of the collectives: flat views, in-place detection, chunking, the reduction ufunc."""

from __future__ import annotations

from itertools import accumulate
from typing import Any, NamedTuple

from hpcdl.backend import get_array_module

__all__ = [
    "Reduction", "check_pair", "chunk_counts", "chunk_offsets", "flat", "is_in_place", "mpi_op", "reduction",
    "scratch",
]  # fmt: skip

#: MPI's reduction operations, by the name of the ufunc that applies them elementwise.
_UFUNCS = {"SUM": "add", "MAX": "maximum", "MIN": "minimum"}


def chunk_counts(n: int, parts: int) -> list[int]:
    """Sizes of ``parts`` contiguous chunks of ``n`` elements, the first ``n % parts`` one longer.

    This is how the ring and Rabenseifner split a vector, and the size of each rank's part
    in :meth:`Collectives.reduce_scatter` and :meth:`Collectives.allgather`.

    Args:
        n: number of elements (0 allowed).
        parts: number of chunks (at least 1).

    Returns:
        ``parts`` sizes summing to ``n``.
    """
    q, r = divmod(n, parts)
    return [q + 1 if i < r else q for i in range(parts)]


def chunk_offsets(counts: list[int]) -> list[int]:
    """Start of each chunk (a prefix sum of ``counts``), plus the total as a last entry."""
    return [0, *accumulate(counts)]


def scratch(like: Any, n: int) -> Any:
    """An uninitialised 1-D buffer of ``n`` elements, of ``like``'s dtype and device."""
    return get_array_module(like).empty(n, dtype=like.dtype)


def flat(buf: Any, what: str) -> Any:
    """A 1-D view of the contiguous array ``buf``.

    Raises:
        TypeError: ``buf`` is not an array.
        ValueError: ``buf`` is not C-contiguous (its elements cannot be sent in place).
    """
    if not hasattr(buf, "reshape") or not hasattr(buf, "dtype"):
        raise TypeError(f"{what} must be a NumPy or CuPy array (got {type(buf).__name__})")
    if not buf.flags.c_contiguous:
        raise ValueError(f"{what} must be C-contiguous (got an array of strides {buf.strides})")
    return buf.reshape(-1)


def is_in_place(sendbuf: Any, recvbuf: Any) -> bool:
    """True for an in-place call: ``sendbuf`` is ``recvbuf`` or ``hpcdl.comm.IN_PLACE``."""
    if sendbuf is recvbuf:
        return True
    if hasattr(sendbuf, "dtype"):
        return False
    import hpcdl.comm as hc

    return sendbuf is hc.IN_PLACE


class Reduction(NamedTuple):
    """An MPI reduction operation resolved once for an operation's buffers.

    :class:`~hpcdl.comm.collectives.Collectives` passes one to the schedules as their
    ``op``: resolving ``hpcdl.comm.SUM`` and the array module costs microseconds, which
    matter for small messages.
    """

    #: the MPI operation (``hpcdl.comm.SUM``, ``MAX`` or ``MIN``), for the library's own calls
    op: Any
    #: the elementwise ufunc applying it (``xp.add``, ``xp.maximum``, ``xp.minimum``)
    ufunc: Any


def reduction(op: Any, buf: Any) -> Any:
    """The ufunc applying ``op`` (``hpcdl.comm.SUM``, ``MAX``, ``MIN`` or a :class:`Reduction`).

    Raises:
        ValueError: ``op`` is another operation.
    """
    if type(op) is Reduction:
        return op.ufunc
    import hpcdl.comm as hc

    for name, ufunc in _UFUNCS.items():
        if op is getattr(hc, name):
            return getattr(get_array_module(buf), ufunc)
    raise ValueError(f"collectives reduce with hpcdl.comm.SUM, MAX or MIN (got {op!r})")


def mpi_op(op: Any) -> Any:
    """The MPI operation of ``op`` (itself, or a :class:`Reduction`'s)."""
    return op.op if type(op) is Reduction else op


def check_pair(sendbuf: Any, recvbuf: Any, what: str) -> tuple[Any, Any]:
    """Flat views ``(src, dst)`` of a send and a receive buffer of the same size and dtype.

    An in-place call (:func:`is_in_place`) gives ``src is dst``.

    Raises:
        ValueError: the sizes or dtypes differ.
    """
    dst = flat(recvbuf, f"{what} recvbuf")
    if is_in_place(sendbuf, recvbuf):
        return dst, dst
    src = flat(sendbuf, f"{what} sendbuf")
    if src.size != dst.size or src.dtype != dst.dtype:
        raise ValueError(
            f"{what}: sendbuf ({src.size} x {src.dtype}) and recvbuf ({dst.size} x {dst.dtype}) "
            "must have the same size and dtype"
        )
    return src, dst
