"""Buffers of the collectives: flat views, in-place detection, chunking, the reduction ufunc."""

from __future__ import annotations

from collections.abc import Callable
from itertools import accumulate
from typing import Any, NamedTuple

import numpy as np

from hpcdl.backend import get_array_module

__all__ = [
    "Alloc",
    "Lease",
    "Workspace",
    "Reduction", "check_pair", "chunk_counts", "chunk_offsets", "flat", "is_in_place", "mpi_op", "reduction",
    "scale_in_place", "scratch",
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


def scratch(like: Any, n: int, dtype: Any = None) -> Any:
    """An uninitialised 1-D buffer of ``n`` elements of ``dtype`` (default ``like``'s), on ``like``'s device.

    The default allocator of the schedules; :class:`Collectives` passes a :class:`Lease`
    of its :class:`Workspace` instead, which reuses buffers.
    """
    return get_array_module(like).empty(n, dtype=like.dtype if dtype is None else dtype)


#: How a schedule gets scratch space: ``alloc(like, n, dtype=None)`` as :func:`scratch`.
Alloc = Callable[..., Any]


class Workspace:
    """Scratch buffers kept by one :class:`Collectives` object and reused across its operations.

    A fresh multi-megabyte ``empty`` per call costs a page fault per 4 KiB page when the
    allocator maps it anew (glibc does above its mmap threshold): at 4 MB that was 40% of
    a ring allreduce here. Each operation takes a :class:`Lease`; its buffers return to
    the pool when the operation completes normally (after an error they are dropped, since
    a pending receive might still write into them). At most ``keep`` free buffers are
    kept (the largest).

    Args:
        keep: free buffers kept at most.
    """

    def __init__(self, keep: int = 8) -> None:
        self.keep = keep
        self._free: list[tuple[int, Any, Any]] = []  # (nbytes, array module, raw buffer)

    def lease(self) -> Lease:
        """A new lease, for one operation."""
        return Lease(self)

    def take(self, nbytes: int, xp: Any) -> Any:
        """A free raw (uint8) buffer of at least ``nbytes`` on ``xp``'s device, or a new one."""
        best = -1
        for i, (size, module, _) in enumerate(self._free):
            if size >= nbytes and module is xp and (best < 0 or size < self._free[best][0]):
                best = i
        if best >= 0:
            return self._free.pop(best)[2]
        return xp.empty(max(nbytes, 64), dtype=np.uint8)

    def give(self, raw: Any) -> None:
        """Return ``raw`` to the pool (the smallest are dropped beyond ``keep``)."""
        self._free.append((raw.nbytes, get_array_module(raw), raw))
        if len(self._free) > self.keep:
            self._free.sort(key=lambda entry: entry[0])
            del self._free[0]

    @property
    def nbytes(self) -> int:
        """Bytes held in free buffers."""
        return sum(entry[0] for entry in self._free)


class Lease:
    """The scratch buffers of one operation, taken from a :class:`Workspace`; an :data:`Alloc`."""

    __slots__ = ("_held", "_ws")

    def __init__(self, workspace: Workspace) -> None:
        self._ws = workspace
        self._held: list[Any] = []

    def __call__(self, like: Any, n: int, dtype: Any = None) -> Any:
        dt = like.dtype if dtype is None else np.dtype(dtype)
        raw = self._ws.take(n * dt.itemsize, get_array_module(like))
        self._held.append(raw)
        return raw[: n * dt.itemsize].view(dt)

    def release(self) -> None:
        """Give every buffer back (call only when no request uses them any more)."""
        for raw in self._held:
            self._ws.give(raw)
        self._held.clear()


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


def scale_in_place(x: Any, scale: float) -> None:
    """``x *= scale`` in ``x``'s dtype (the scalar rounded to it first, as NumPy does): the
    ``scale=`` of :meth:`~hpcdl.comm.collectives.Collectives.Iallreduce`, wherever it is applied."""
    get_array_module(x).multiply(x, x.dtype.type(scale), out=x)
