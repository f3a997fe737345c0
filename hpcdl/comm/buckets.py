"""Gradient buckets: a fixed layout filled from the last array back, packed one bucket at a time."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from hpcdl.backend import get_array_module
from hpcdl.comm.pack import SUPPORTED_DTYPES, Packer, PackError, _shape_of, wire_dtype

__all__ = ["Bucket", "BucketPlan", "Buckets", "plan_buckets"]


@dataclass(frozen=True)
class Bucket:
    """One bucket of a :class:`BucketPlan`.

    Attributes:
        index: the bucket's number (0 holds the last arrays of the list).
        arrays: indices of its arrays in the caller's list, ascending (definition order).
        offsets: element offsets of those arrays in the bucket's buffer, ``len(arrays) + 1``
            entries (a prefix sum of their sizes).
    """

    index: int
    arrays: tuple[int, ...]
    offsets: tuple[int, ...]

    @property
    def size(self) -> int:
        """Elements in the bucket."""
        return self.offsets[-1]

    @property
    def last_ready(self) -> int:
        """The array whose gradient completes the bucket when backward runs last to first."""
        return self.arrays[0]


@dataclass(frozen=True)
class BucketPlan:
    """Which array goes into which bucket, at which offset: pure data, the same on every rank.

    Attributes:
        buckets: the buckets, in the order they fill (and should be reduced).
        bucket_of: for each array index, its bucket.
        bucket_bytes: the capacity asked for (None: one bucket).
        itemsize: bytes per element in the buffers (the wire format's).
    """

    buckets: tuple[Bucket, ...]
    bucket_of: tuple[int, ...]
    bucket_bytes: int | None
    itemsize: int

    def __len__(self) -> int:
        return len(self.buckets)

    def nbytes(self, b: int) -> int:
        """Bytes of bucket ``b``'s buffer."""
        return self.buckets[b].size * self.itemsize

    def describe(self) -> str:
        """A table: one line per bucket with its arrays, elements and bytes."""
        lines = [f"{'bucket':>6} {'arrays':>12} {'elements':>10} {'bytes':>10}"]
        for bk in self.buckets:
            span = f"{bk.arrays[0]}..{bk.arrays[-1]}" if bk.arrays else "-"
            lines.append(f"{bk.index:>6} {span:>12} {bk.size:>10} {bk.size * self.itemsize:>10}")
        return "\n".join(lines)


def plan_buckets(sizes: Sequence[int], bucket_bytes: int | None, itemsize: int) -> BucketPlan:
    """Assign arrays of ``sizes`` elements to buckets of at most ``bucket_bytes`` bytes.

    Arrays are taken from the last to the first (as backward produces gradients), and a
    bucket is closed when the next array would overflow it, so bucket 0 holds the last
    arrays. An array never straddles two buckets: one larger than the capacity alone gets
    a bucket of its own (as in PyTorch DDP). Inside a bucket the arrays keep their
    definition order. Empty arrays join whichever bucket is open.

    Args:
        sizes: elements of each array, in the model's definition order.
        bucket_bytes: capacity of a bucket in bytes of the buffer; None for a single
            bucket holding everything.
        itemsize: bytes per element of the buffer (e.g. 2 for float16 packing).

    Returns:
        The plan (no bucket for an empty list).

    Raises:
        ValueError: ``bucket_bytes`` or ``itemsize`` is not positive.
    """
    if bucket_bytes is not None and bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be a positive integer or None ({bucket_bytes} < 1)")
    if itemsize < 1:
        raise ValueError(f"itemsize must be a positive integer ({itemsize} < 1)")
    cap = math.inf if bucket_bytes is None else bucket_bytes
    groups: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i in reversed(range(len(sizes))):
        nbytes = int(sizes[i]) * itemsize
        if nbytes and current and used + nbytes > cap:
            groups.append(current)
            current, used = [], 0
        current.append(i)
        used += nbytes
    if current:
        groups.append(current)
    buckets, bucket_of = [], [0] * len(sizes)
    for b, group in enumerate(groups):
        arrays = tuple(sorted(group))
        offsets = [0]
        for i in arrays:
            offsets.append(offsets[-1] + int(sizes[i]))
            bucket_of[i] = b
        buckets.append(Bucket(b, arrays, tuple(offsets)))
    return BucketPlan(tuple(buckets), tuple(bucket_of), bucket_bytes, itemsize)


class Buckets:
    """Packs and unpacks a fixed list of arrays bucket by bucket, following a :class:`BucketPlan`.

    Each bucket has its own buffer (a :class:`~hpcdl.comm.pack.Packer` over the bucket's
    arrays), so that its nonblocking allreduce can start while later buckets are still
    being filled. Buffers are reallocated only when :meth:`rebind` needs a larger one.

    During backward, call :meth:`mark_ready` with each array index as its gradient is
    written: it returns the buckets that became ready, **in bucket order** (bucket ``b``
    is released only after ``0..b-1``), so every rank starts its collectives in the same
    order even if gradients arrive in a different one. :meth:`reset` starts the next step.

    Args:
        arrays_or_shapes: the arrays (or shapes), in the model's definition order.
        bucket_bytes: bucket capacity in bytes of the packed format (None: one bucket).
        dtype: the arrays' dtype; inferred from arrays, required with shapes.
        mode: buffer format, see :class:`~hpcdl.comm.pack.Packer`.
        xp: array module of the buffers (inferred from the arrays).
        impl: ``"auto"``, ``"cython"`` or ``"numpy"``, as for :class:`~hpcdl.comm.pack.Packer`.

    Raises:
        PackError: as for :class:`~hpcdl.comm.pack.Packer`.
        ValueError: ``bucket_bytes`` is not positive.
    """

    def __init__(
        self,
        arrays_or_shapes: Sequence[Any],
        bucket_bytes: int | None,
        dtype: Any = None,
        *,
        mode: str = "plain",
        xp: ModuleType | None = None,
        impl: str = "auto",
    ) -> None:
        items = list(arrays_or_shapes)
        arrays = [a for a in items if hasattr(a, "dtype")]
        self.dtype: np.dtype = np.dtype(dtype if dtype is not None else _dtype_of(arrays))
        if self.dtype not in SUPPORTED_DTYPES:
            raise PackError(f"Buckets supports float32 and float64 arrays (got {self.dtype})")
        for i, a in enumerate(arrays):
            if np.dtype(a.dtype) != self.dtype:
                raise PackError(f"array {i} has dtype {a.dtype}, the buckets {self.dtype}")
        self.mode = mode
        self.wire_dtype: np.dtype = wire_dtype(mode, self.dtype)
        self.xp: ModuleType = xp if xp is not None else get_array_module(*arrays)
        Packer([], self.dtype, xp=self.xp, impl=impl, mode=mode)  # validates impl
        self.impl = impl
        self.bucket_bytes = bucket_bytes
        self._packers: list[Packer] = []
        self.rebind(items)

    def rebind(self, arrays_or_shapes: Sequence[Any]) -> None:
        """Lay out a new list of shapes, keeping each bucket's buffer if it is large enough."""
        self.shapes: tuple[tuple[int, ...], ...] = tuple(_shape_of(a) for a in arrays_or_shapes)
        sizes = [math.prod(s) for s in self.shapes]
        self.plan: BucketPlan = plan_buckets(sizes, self.bucket_bytes, self.wire_dtype.itemsize)
        for bk in self.plan.buckets:
            shapes = [self.shapes[i] for i in bk.arrays]
            if bk.index < len(self._packers):
                self._packers[bk.index].rebind(shapes)
            else:
                self._packers.append(Packer(shapes, self.dtype, xp=self.xp, impl=self.impl, mode=self.mode))
        self._members: tuple[tuple[int, ...], ...] = tuple(bk.arrays for bk in self.plan.buckets)
        self.reset()

    def __len__(self) -> int:
        return len(self.plan.buckets)

    # -- readiness -----------------------------------------------------------------------

    def bucket_of(self, i: int) -> int:
        """The bucket holding array ``i``."""
        return self.plan.bucket_of[i]

    def reset(self) -> None:
        """Forget which gradients are ready (call at the start of each backward)."""
        self._missing = [len(bk.arrays) for bk in self.plan.buckets]
        self._released = 0

    def is_complete(self, b: int) -> bool:
        """True when every array of bucket ``b`` has been marked ready since :meth:`reset`."""
        return self._missing[b] == 0

    def mark_ready(self, i: int) -> list[int]:
        """Record that array ``i``'s gradient is final; return the buckets now ready to reduce.

        Returns:
            Bucket indices, ascending, that are complete and whose predecessors were all
            returned before (usually ``[]`` or ``[b]``).

        Raises:
            PackError: more arrays of ``i``'s bucket were marked than it holds (an array
                marked twice since the last :meth:`reset`).
        """
        b = self.plan.bucket_of[i]
        if self._missing[b] == 0:
            raise PackError(f"array {i} marked ready twice: its bucket {b} is already complete")
        self._missing[b] -= 1
        ready = []
        while self._released < len(self._missing) and self._missing[self._released] == 0:
            ready.append(self._released)
            self._released += 1
        return ready

    # -- copies --------------------------------------------------------------------------

    def buffer(self, b: int) -> Any:
        """Bucket ``b``'s packed buffer (1-D, :attr:`wire_dtype`)."""
        return self._packers[b].buffer

    def packer(self, b: int) -> Packer:
        """The :class:`~hpcdl.comm.pack.Packer` of bucket ``b`` (its arrays in bucket order)."""
        return self._packers[b]

    def pack_bucket(self, b: int, arrays: Sequence[Any], *, qscale: float | None = None) -> Any:
        """Pack bucket ``b``'s arrays (taken from the full list ``arrays``) into its buffer.

        Args:
            b: the bucket.
            arrays: all arrays, in definition order (only bucket ``b``'s are read).
            qscale: quantization scale (``mode="int32"`` only).

        Returns:
            The bucket's buffer.

        Raises:
            PackError: wrong number of arrays, or an array does not match the layout.
        """
        self._check_len(arrays, "pack_bucket")
        return self._packers[b].pack([arrays[i] for i in self._members[b]], qscale=qscale)

    def unpack_bucket(
        self,
        b: int,
        buffer: Any,
        arrays: Sequence[Any],
        scale: float = 1.0,
        *,
        qscale: float | None = None,
    ) -> None:
        """Copy ``buffer`` (bucket ``b``'s layout) back into its arrays, times ``scale``.

        Args:
            b: the bucket.
            buffer: the reduced buffer of bucket ``b``.
            arrays: all arrays, in definition order (only bucket ``b``'s are written).
            scale: factor applied while copying (``1 / size`` for an average).
            qscale: quantization scale used by ``pack_bucket`` (``mode="int32"`` only).
        """
        self._check_len(arrays, "unpack_bucket")
        self._packers[b].unpack(buffer, [arrays[i] for i in self._members[b]], scale, qscale=qscale)

    def pack(self, arrays: Sequence[Any], *, qscale: float | None = None) -> list[Any]:
        """Pack every bucket; returns the buffers in bucket order."""
        return [self.pack_bucket(b, arrays, qscale=qscale) for b in range(len(self))]

    def unpack(
        self,
        buffers: Sequence[Any],
        arrays: Sequence[Any],
        scale: float = 1.0,
        *,
        qscale: float | None = None,
    ) -> None:
        """Unpack every bucket from ``buffers`` (in bucket order)."""
        if len(buffers) != len(self):
            raise PackError(f"unpack got {len(buffers)} buffers for {len(self)} buckets")
        for b, buf in enumerate(buffers):
            self.unpack_bucket(b, buf, arrays, scale, qscale=qscale)

    def maxabs(self, arrays: Sequence[Any]) -> float:
        """``max |x|`` over all arrays (NaN if any is NaN): the local input of the MAX allreduce."""
        self._check_len(arrays, "maxabs")
        m = 0.0
        for b, members in enumerate(self._members):
            v = self._packers[b].maxabs([arrays[i] for i in members])
            if math.isnan(v):
                return math.nan
            m = max(m, v)
        return m

    def _check_len(self, arrays: Sequence[Any], what: str) -> None:
        if len(arrays) != len(self.shapes):
            raise PackError(f"{what} got {len(arrays)} arrays, the buckets were built for {len(self.shapes)}")


def _dtype_of(arrays: Sequence[Any]) -> Any:
    dtypes = {np.dtype(a.dtype) for a in arrays}
    if len(dtypes) != 1:
        raise PackError(
            "Buckets needs dtype= when given shapes, or arrays of one dtype "
            f"(got {sorted(str(d) for d in dtypes) or 'no arrays'})"
        )
    return dtypes.pop()
