"""Pack many arrays into one contiguous buffer and back (wraps the Cython kernel of ``ext/``)."""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy as np

from hpcdl.backend import get_array_module

try:
    from hpcdl._ext import pack as _kernel
except ImportError:  # not built: `python setup.py build_ext --inplace` or `pip install .`
    _kernel = None

__all__ = ["HAVE_EXT", "PackError", "Packer", "SUPPORTED_DTYPES"]

#: True when the compiled kernel ``hpcdl._ext.pack`` is importable.
HAVE_EXT: bool = _kernel is not None

#: Buffer dtypes the packer accepts (the kernel's fused type).
SUPPORTED_DTYPES: tuple[np.dtype, ...] = (np.dtype(np.float32), np.dtype(np.float64))

_IMPLS = ("auto", "cython", "numpy")


class PackError(ValueError):
    """The arrays given to :class:`Packer` do not match the layout it was built for."""


def _shape_of(item: Any) -> tuple[int, ...]:
    if hasattr(item, "shape"):
        return tuple(int(d) for d in item.shape)
    if isinstance(item, int | np.integer):
        return (int(item),)
    return tuple(int(d) for d in item)


def _c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...] | None:
    """NumPy's strides of a C-contiguous array of ``shape``; None for an empty one (any)."""
    if 0 in shape:
        return None
    strides, step = [], itemsize
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))


class Packer:
    """Copies a fixed list of arrays into one 1-D buffer at precomputed offsets, and back.

    Array ``i`` occupies ``buffer[offsets[i]:offsets[i + 1]]`` in the order of the list given
    (the caller passes parameters in the model's fixed order, the same on every rank).
    The offsets are a prefix sum of the sizes, computed once; the buffer is allocated once
    and reallocated only when :meth:`rebind` needs a larger one. The buffer's dtype is the
    arrays' dtype.

    NumPy float32/float64 arrays that are C-contiguous go through the compiled kernel
    (``memcpy`` per array, scaled loop on unpack, without the GIL); CuPy arrays,
    non-contiguous arrays, or a missing kernel take a NumPy/CuPy slice-copy path with
    identical results. (Casting while packing, e.g. float32 arrays into a 16-bit buffer,
    fits as a buffer dtype distinct from the arrays' one: ``_check`` and the kernel
    dispatch in ``pack``/``unpack`` are the places to extend.)

    Args:
        arrays_or_shapes: the arrays to pack (their shapes, dtype and array module are
            taken), or their shapes (tuples, or ints for 1-D).
        dtype: the arrays' dtype; inferred from the arrays when omitted, required with shapes.
        xp: array module of the buffer (``numpy`` or ``cupy``); inferred from the arrays
            when omitted, NumPy for shapes.
        impl: ``"auto"`` (kernel when it applies), ``"cython"`` (require the kernel for NumPy
            arrays) or ``"numpy"`` (always the slice-copy path).

    Raises:
        PackError: the dtype is missing, unsupported or not shared by all arrays.
        ValueError: ``impl`` is unknown, or ``"cython"`` without the compiled kernel.
    """

    def __init__(
        self,
        arrays_or_shapes: Sequence[Any],
        dtype: Any = None,
        *,
        xp: ModuleType | None = None,
        impl: str = "auto",
    ) -> None:
        if impl not in _IMPLS:
            raise ValueError(f"impl must be one of {_IMPLS} (got {impl!r})")
        if impl == "cython" and not HAVE_EXT:
            raise ValueError(
                "impl='cython' needs the compiled kernel hpcdl._ext.pack: "
                "run `python setup.py build_ext --inplace` or `pip install .`"
            )
        items = list(arrays_or_shapes)
        arrays = [a for a in items if hasattr(a, "dtype")]
        if dtype is None:
            dtypes = {np.dtype(a.dtype) for a in arrays}
            if len(dtypes) != 1:
                raise PackError(
                    "Packer needs dtype= when given shapes, or arrays of one dtype "
                    f"(got {sorted(str(d) for d in dtypes) or 'no arrays'})"
                )
            dtype = dtypes.pop()
        self.dtype: np.dtype = np.dtype(dtype)
        if self.dtype not in SUPPORTED_DTYPES:
            raise PackError(f"Packer supports float32 and float64 buffers (got {self.dtype})")
        for i, a in enumerate(arrays):
            if np.dtype(a.dtype) != self.dtype:
                raise PackError(f"array {i} has dtype {a.dtype}, the packer {self.dtype}")
        self.xp: ModuleType = xp if xp is not None else get_array_module(*arrays)
        self.impl = impl
        self._storage: Any = None
        self.rebind(items)

    # -- layout --------------------------------------------------------------------------

    def rebind(self, arrays_or_shapes: Sequence[Any]) -> None:
        """Use a new list of shapes (same dtype), keeping the buffer if it is large enough.

        Args:
            arrays_or_shapes: arrays or shapes, as for the constructor.
        """
        self.shapes: tuple[tuple[int, ...], ...] = tuple(_shape_of(a) for a in arrays_or_shapes)
        sizes = np.array([int(np.prod(s, dtype=np.int64)) for s in self.shapes], dtype=np.intp)
        offsets = np.zeros(len(sizes) + 1, dtype=np.intp)
        np.cumsum(sizes, out=offsets[1:])
        offsets.flags.writeable = False
        self.sizes: np.ndarray = sizes
        self.offsets: np.ndarray = offsets
        self.total: int = int(offsets[-1])
        if self._storage is None or self._storage.size < self.total:
            self._storage = self.xp.empty(self.total, dtype=self.dtype)
        self._offsets_list: list[int] = offsets.tolist()
        self._cstrides = tuple(_c_strides(s, self.dtype.itemsize) for s in self.shapes)

    @property
    def nbytes(self) -> int:
        """Bytes of the packed data (``total * itemsize``)."""
        return self.total * self.dtype.itemsize

    @property
    def buffer(self) -> Any:
        """The packed buffer: a 1-D view of ``total`` elements of the owned storage."""
        return self._storage[: self.total]

    def slot(self, buffer: Any, i: int) -> Any:
        """The view of array ``i`` inside ``buffer``, shaped like the array."""
        o = self._offsets_list
        return buffer[o[i] : o[i + 1]].reshape(self.shapes[i])

    # -- copies --------------------------------------------------------------------------

    def pack(self, arrays: Sequence[Any]) -> Any:
        """Copy ``arrays`` into the buffer in order and return the buffer.

        Args:
            arrays: arrays with the shapes and dtype the packer was built for.

        Returns:
            The 1-D buffer view (:attr:`buffer`), valid until the next ``pack``/``rebind``.

        Raises:
            PackError: wrong number of arrays, or an array's shape or dtype differs.
        """
        buf = self.buffer
        if self._check(arrays, "pack", buf):
            _kernel.pack([a.reshape(-1) for a in arrays], buf, self.offsets)
        else:
            o = self._offsets_list
            for i, a in enumerate(arrays):
                self.xp.copyto(buf[o[i] : o[i + 1]].reshape(a.shape), a)
        return buf

    def unpack(self, buffer: Any, arrays: Sequence[Any], scale: float = 1.0) -> None:
        """Copy ``buffer`` back into ``arrays``, multiplied by ``scale``.

        ``arrays[i][...] = buffer[offsets[i]:offsets[i + 1]] * scale``, computed in the
        buffer's dtype (``scale = 1 / size`` turns a summed buffer into an average).

        Args:
            buffer: a 1-D buffer of at least ``total`` elements of the packer's dtype (the
                packer's own :attr:`buffer` or a received one).
            arrays: writable arrays with the shapes and dtype the packer was built for.
            scale: factor applied while copying.

        Raises:
            PackError: wrong number of arrays, an array's shape or dtype differs, or the
                buffer is too small, not 1-D or of another dtype.
        """
        if getattr(buffer, "ndim", None) != 1 or buffer.size < self.total:
            raise PackError(
                f"unpack needs a 1-D buffer of at least {self.total} elements "
                f"(got shape {getattr(buffer, 'shape', None)})"
            )
        if np.dtype(buffer.dtype) != self.dtype:
            raise PackError(f"unpack buffer has dtype {buffer.dtype}, the packer {self.dtype}")
        scale = float(scale)
        if self._check(arrays, "unpack", buffer):
            _kernel.unpack(buffer, [a.reshape(-1) for a in arrays], self.offsets, scale)
            return
        o = self._offsets_list
        for i, a in enumerate(arrays):
            src = buffer[o[i] : o[i + 1]].reshape(a.shape)
            if scale == 1.0:
                self.xp.copyto(a, src)
            else:
                self.xp.multiply(src, scale, out=a)

    # -- helpers -------------------------------------------------------------------------

    def _check(self, arrays: Sequence[Any], what: str, buf: Any) -> bool:
        """Validate ``arrays``; True when the kernel applies to them and to ``buf``."""
        if len(arrays) != len(self.shapes):
            raise PackError(f"{what} got {len(arrays)} arrays, the packer was built for {len(self.shapes)}")
        kernel = (
            self.impl != "numpy"
            and HAVE_EXT
            and isinstance(buf, np.ndarray)
            and buf.strides == (self.dtype.itemsize,)
        )
        for i, a in enumerate(arrays):
            if a.dtype != self.dtype:
                raise PackError(f"{what}: array {i} has dtype {a.dtype}, the packer {self.dtype}")
            if a.shape != self.shapes[i]:
                raise PackError(f"{what}: array {i} has shape {a.shape}, the packer expects {self.shapes[i]}")
            # C-contiguous strides (precomputed; a rarer contiguous layout just takes the
            # fallback). CuPy arrays are not np.ndarray.
            if kernel and not isinstance(a, np.ndarray):
                kernel = False
            elif kernel and a.strides != self._cstrides[i] and self._cstrides[i] is not None:
                kernel = False
        return kernel
