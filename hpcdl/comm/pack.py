"""Pack many arrays into one contiguous buffer and back, casting on the way (wraps ``ext/pack.pyx``).

``int32`` packing quantizes with a scale every rank shares, chosen so that a sum of the N
ranks' buffers cannot overflow. Two rules give it:

- **pow2** (the default of ``exchange.int32_scale``): SwitchML's block floating point. Each
  rank sends the binary exponent ``e`` of its bucket's ``max |g|`` (:func:`int32_exponent`,
  ``max |g| = m * 2**e`` with ``0.5 <= m < 1``); a MAX over the ranks' *integers* gives the
  bucket's exponent (a programmable switch does this as "max instead of sum" over int32),
  and every rank quantizes with the same power of two :func:`int32_pow2_scale`, the largest
  ``2**k`` with ``N * 2**e * 2**k <= 2**31 - 1``. An in-network aggregation switch and the
  ring then sum the same integers: their sums are bitwise the same. Scaling by ``2**k`` is
  exact in floating point; the price is up to two bits of the int32 range (``max |g| *
  2**k`` lies in ``(L / 4, L]``, ``L = floor((2**31 - 1) / N)``).
- **max** (the rule before it, ``exchange.int32_scale = "max"``): scale
  ``floor((2**31 - 1) / N) / max |g|`` from the global ``max |g|`` (a MAX allreduce of one
  float, :func:`int32_scale`): the whole range, at the cost of a scale that is no power of two.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy as np

from hpcdl.backend import get_array_module

try:
    from hpcdl._ext import pack as _kernel
except ImportError:  # not built: `python setup.py build_ext --inplace` or `pip install .`
    _kernel = None

__all__ = [
    "HAVE_EXT",
    "INT32_LIMIT",
    "MODES",
    "PackError",
    "Packer",
    "SUPPORTED_DTYPES",
    "INT32_NONFINITE_EXPONENT",
    "INT32_ZERO_EXPONENT",
    "int32_exponent",
    "int32_pow2_scale",
    "int32_pow2_shift",
    "int32_scale",
    "local_maxabs",
    "narrow_into",
    "widen_into",
    "wire_dtype",
]

#: True when the compiled kernel ``hpcdl._ext.pack`` is importable.
HAVE_EXT: bool = _kernel is not None

#: Array dtypes the packer accepts (the kernel's fused type).
SUPPORTED_DTYPES: tuple[np.dtype, ...] = (np.dtype(np.float32), np.dtype(np.float64))

#: Buffer formats: ``plain`` (the arrays' dtype), ``float16`` (IEEE half), ``bfloat16``
#: (its bits in ``uint16``), ``int32`` (quantized with a shared scale).
MODES: tuple[str, ...] = ("plain", "float16", "bfloat16", "int32")

#: Largest magnitude of a quantized value: ``int32`` packing saturates to ``±INT32_LIMIT``.
INT32_LIMIT: int = 2**31 - 1

#: :func:`int32_exponent` of zero: below the exponent of every nonzero float64 (the smallest
#: subnormal, ``2**-1074``, has exponent -1073), so a MAX over the ranks passes it over.
INT32_ZERO_EXPONENT: int = -1075

#: :func:`int32_exponent` of NaN or inf: the largest int32, which a MAX over the ranks carries
#: to every rank, so that all of them refuse the bucket alike (:func:`int32_pow2_scale` raises).
INT32_NONFINITE_EXPONENT: int = 2**31 - 1

#: the largest ``k`` whose ``2.0**k`` is a finite float64
_MAX_SHIFT = 1023

_IMPLS = ("auto", "cython", "numpy")
_WIRE = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(np.uint16), "int32": np.dtype(np.int32)}


class PackError(ValueError):
    """The arrays given to :class:`Packer` do not match the layout it was built for."""


def wire_dtype(mode: str, dtype: Any) -> np.dtype:
    """The buffer's dtype for arrays of ``dtype`` packed in ``mode``.

    Raises:
        PackError: ``mode`` is unknown.
    """
    if mode not in MODES:
        raise PackError(f"mode must be one of {MODES} (got {mode!r})")
    return _WIRE.get(mode, np.dtype(dtype))


def int32_scale(global_maxabs: float, n_terms: int) -> float:
    """The ``max`` rule's quantization scale for ``int32`` packing: a sum of ``n_terms`` cannot overflow.

    ``scale = floor((2**31 - 1) / n_terms) / global_maxabs``: every ``rint(g * scale)`` is then
    at most ``floor((2**31 - 1) / n_terms)`` in magnitude (the floor keeps rounding to the
    nearest integer from adding half a unit per term), so the sum of ``n_terms`` of them fits.
    ``global_maxabs`` is ``max |g|`` over every rank: :func:`local_maxabs` followed by a MAX
    allreduce of one float. A zero maximum (all gradients zero) gives scale 1.

    Args:
        global_maxabs: the largest ``|g|`` over all arrays of all ranks.
        n_terms: how many quantized buffers are summed (the number of ranks).

    Returns:
        The scale passed as ``qscale`` to ``pack`` and ``unpack``.

    Raises:
        ValueError: ``n_terms < 1``, or ``global_maxabs`` is negative, NaN, infinite, or so
            small that the scale overflows.
    """
    if n_terms < 1:
        raise ValueError(f"n_terms must be a positive integer ({n_terms} < 1)")
    maxabs = float(global_maxabs)
    if not math.isfinite(maxabs) or maxabs < 0:
        raise ValueError(f"global max |g| must be finite and non-negative (got {maxabs})")
    if maxabs == 0.0:
        return 1.0
    scale = (INT32_LIMIT // n_terms) / maxabs
    if not math.isfinite(scale):
        raise ValueError(f"global max |g| = {maxabs} is too small for an int32 scale")
    return scale


def int32_exponent(local_maxabs: float) -> int:
    """The binary exponent ``e`` of ``max |g|``: ``local_maxabs = m * 2**e`` with ``0.5 <= m < 1``.

    Every ``|g| <= max |g|`` is then ``< 2**e``, strictly. This integer is what a rank sends
    for the ``pow2`` rule, reduced with MAX over the ranks (as int32) before
    :func:`int32_pow2_scale`.

    Args:
        local_maxabs: this rank's ``max |g|`` of the bucket (:func:`local_maxabs`).

    Returns:
        ``e`` (``math.frexp``), between -1073 and 1024 for nonzero finite values;
        :data:`INT32_ZERO_EXPONENT` for 0 (an all-zero bucket), :data:`INT32_NONFINITE_EXPONENT`
        for NaN or inf.

    Raises:
        ValueError: ``local_maxabs`` is negative.
    """
    maxabs = float(local_maxabs)
    if not math.isfinite(maxabs):
        return INT32_NONFINITE_EXPONENT
    if maxabs < 0:
        raise ValueError(f"max |g| must be non-negative (got {maxabs})")
    if maxabs == 0.0:
        return INT32_ZERO_EXPONENT
    return math.frexp(maxabs)[1]


def int32_pow2_scale(global_exponent: int, n_terms: int) -> float:
    """The ``pow2`` rule's quantization scale: ``2.0**k``, k = :func:`int32_pow2_shift`."""
    return math.ldexp(1.0, int32_pow2_shift(global_exponent, n_terms))


def int32_pow2_shift(global_exponent: int, n_terms: int) -> int:
    """The exponent ``k`` of the ``pow2`` rule's scale ``2**k`` (SwitchML's block floating point); the
    switch (:mod:`hpcdl.switch`) quantises with the same ``k``, so that it and the ring sum the
    same integers.

    ``k`` is the largest integer with ``n_terms * 2**e * 2**k <= 2**31 - 1``, ``e =
    global_exponent``: with ``L = floor((2**31 - 1) / n_terms)`` (the integer bound is the
    same, as ``2**(e + k)`` is an integer or below 1), ``e + k = L.bit_length() - 1``, exact
    integer arithmetic. Every ``|g| < 2**e`` gives ``|g * 2**k| < 2**(e + k)``, and rounding
    to the nearest integer cannot pass that integer: ``|rint(g * 2**k)| <= 2**(e + k) <= L``,
    so the sum of ``n_terms`` fits int32. The product ``g * 2**k`` is exact in float64 (or
    underflows toward zero), and so is dividing the sum by ``2**k``.

    ``k`` is capped at 1023, so that ``2**k`` stays a finite float64 (this happens only when
    the global ``max |g|`` is below ``2**-994``, float64 gradients: float32's smallest value
    is ``2**-149``; a smaller scale only shrinks the quantized values, which stay in bounds).
    A bucket that is zero on every rank (:data:`INT32_ZERO_EXPONENT`) gets scale 1, as under
    :func:`int32_scale`.

    Args:
        global_exponent: the MAX over the ranks of their :func:`int32_exponent`.
        n_terms: how many quantized buffers are summed (the number of ranks).

    Returns:
        ``k`` (possibly negative: large gradients are scaled down); 0 for an all-zero bucket.

    Raises:
        ValueError: ``n_terms`` is not in ``[1, 2**31 - 1]``, or ``global_exponent`` is
            :data:`INT32_NONFINITE_EXPONENT` (a NaN or inf gradient on some rank) or otherwise
            outside the exponents of finite float64 values.
    """
    if not 1 <= n_terms <= INT32_LIMIT:
        raise ValueError(f"n_terms must be an integer in [1, 2**31 - 1] (got {n_terms})")
    e = int(global_exponent)
    if e == INT32_NONFINITE_EXPONENT:
        raise ValueError("a max |g| is NaN or infinite: no int32 scale quantizes it")
    if e <= INT32_ZERO_EXPONENT:
        return 0
    if e > 1024:
        raise ValueError(f"exponent {e} is beyond every finite float64's (at most 1024)")
    return min((INT32_LIMIT // n_terms).bit_length() - 1 - e, _MAX_SHIFT)


def local_maxabs(arrays: Sequence[Any]) -> float:
    """``max |x|`` over all elements of ``arrays`` (0.0 when empty, NaN if any is NaN).

    NumPy float32/float64 contiguous arrays go through the ``nogil`` kernel; others (CuPy,
    strided) through ``xp.abs(a).max()``.

    Args:
        arrays: the local gradients.

    Returns:
        The local maximum, to be reduced with MAX over the ranks before :func:`int32_scale`.
    """
    m = 0.0
    for a in arrays:
        if a.size == 0:
            continue
        if HAVE_EXT and isinstance(a, np.ndarray) and a.dtype in SUPPORTED_DTYPES and a.flags.c_contiguous:
            v = _kernel.maxabs(a.reshape(-1))
        else:
            xp = get_array_module(a)
            v = float(xp.abs(a).max())
        if math.isnan(v):
            return math.nan
        m = max(m, v)
    return m


def widen_into(wire: str, src: Any, out: Any) -> Any:
    """``out[...] = src`` as float values, ``src`` 1-D in ``wire`` format (``float16`` or ``bfloat16`` bits).

    Exact (every 2-byte value is a float32). Contiguous NumPy arrays go through the kernel
    (F16C where the CPU has it); others through NumPy/CuPy casts.

    Returns:
        ``out``.
    """
    if _kernel_applies(src, out):
        kernel = _kernel.from_float16 if wire == "float16" else _kernel.from_bfloat16
        kernel(src.view(np.uint16), out)
    elif wire == "bfloat16":
        out[...] = (src.astype(np.uint32) << 16).view(np.float32)
    else:
        out[...] = src
    return out


def narrow_into(wire: str, src: Any, out: Any) -> Any:
    """``out[...] =`` the float values ``src`` rounded to nearest even in ``wire`` format.

    Bit for bit what packing in that mode gives (beyond float16's range: inf).

    Returns:
        ``out``.
    """
    if _kernel_applies(src, out):
        kernel = _kernel.to_float16 if wire == "float16" else _kernel.to_bfloat16
        kernel(src, out.view(np.uint16))
    elif wire == "bfloat16":
        out[...] = _bfloat16_bits(get_array_module(src), src)
    else:
        with np.errstate(over="ignore"):
            out[...] = src
    return out


def _kernel_applies(*arrays: Any) -> bool:
    return (
        HAVE_EXT
        and all(
            isinstance(a, np.ndarray) and a.ndim == 1 and a.flags.c_contiguous and a.flags.aligned
            for a in arrays
        )
        and arrays[-1].flags.writeable
    )


def _shape_of(item: Any) -> tuple[int, ...]:
    if hasattr(item, "shape"):
        return tuple(int(d) for d in item.shape)
    if isinstance(item, int | np.integer):
        return (int(item),)
    return tuple(int(d) for d in item)


class Packer:
    """Copies a fixed list of arrays into one 1-D buffer at precomputed offsets, and back.

    Array ``i`` occupies ``buffer[offsets[i]:offsets[i + 1]]`` in the order of the list given
    (the caller passes parameters in the model's fixed order, the same on every rank).
    The offsets are a prefix sum of the sizes, computed once; the buffer is allocated once
    and reallocated only when :meth:`rebind` needs a larger one.

    ``mode`` casts while packing (the buffer's dtype is :func:`wire_dtype`):

    - ``"plain"``: the arrays' dtype; ``unpack`` multiplies by ``scale`` in that dtype.
    - ``"float16"``: bit for bit ``a.astype(np.float16)`` (round to nearest even,
      subnormals, inf, NaN); ``unpack`` widens exactly and multiplies by ``scale`` in the
      arrays' dtype. The pack side gives float16 values only: **summing** float16 buffers
      across ranks must accumulate in float32 (unpack each received buffer to float32 and
      add, or a custom reduction op); that is the exchange's business.
    - ``"bfloat16"``: the upper 16 bits of the float32 value rounded to nearest even, as
      ``uint16`` (NaN stays NaN); float64 arrays are first rounded to float32.
    - ``"int32"``: ``q = rint(g * qscale)`` in float64, saturated to ``±(2**31 - 1)``, NaN to 0;
      ``unpack`` gives ``q * (scale / qscale)`` computed in float64. ``qscale`` comes from
      :func:`int32_pow2_scale` (or :func:`int32_scale`), so that a sum of N buffers cannot overflow.

    NumPy arrays that are C-contiguous and aligned go through the compiled kernel: a
    pointer table built in C on each call, then ``memcpy`` or the cast loop per array,
    without the GIL. CuPy arrays, strided arrays, or a missing kernel take a NumPy/CuPy
    slice path with identical results.

    Args:
        arrays_or_shapes: the arrays to pack (their shapes, dtype and array module are
            taken), or their shapes (tuples, or ints for 1-D).
        dtype: the arrays' dtype; inferred from the arrays when omitted, required with shapes.
        xp: array module of the buffer (``numpy`` or ``cupy``); inferred from the arrays
            when omitted, NumPy for shapes.
        impl: ``"auto"`` (kernel when it applies), ``"cython"`` (require the kernel for NumPy
            arrays) or ``"numpy"`` (always the slice path).
        mode: the buffer format, one of :data:`MODES`.

    Raises:
        PackError: the dtype is missing, unsupported or not shared by all arrays, or the
            mode is unknown.
        ValueError: ``impl`` is unknown, or ``"cython"`` without the compiled kernel.
    """

    def __init__(
        self,
        arrays_or_shapes: Sequence[Any],
        dtype: Any = None,
        *,
        xp: ModuleType | None = None,
        impl: str = "auto",
        mode: str = "plain",
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
        self.mode: str = mode
        #: the buffer's dtype (the arrays' one for ``plain``)
        self.wire_dtype: np.dtype = wire_dtype(mode, self.dtype)
        self.xp: ModuleType = xp if xp is not None else get_array_module(*arrays)
        self.impl = impl
        #: ``"cython"`` or ``"numpy"``: the path the last ``pack``/``unpack`` took
        self.last_impl: str | None = None
        self._storage: Any = None
        self.rebind(items)

    # -- layout --------------------------------------------------------------------------

    def rebind(self, arrays_or_shapes: Sequence[Any]) -> None:
        """Use a new list of shapes (same dtype), keeping the buffer if it is large enough.

        Args:
            arrays_or_shapes: arrays or shapes, as for the constructor.
        """
        self.shapes: tuple[tuple[int, ...], ...] = tuple(_shape_of(a) for a in arrays_or_shapes)
        sizes = np.array([math.prod(s) for s in self.shapes], dtype=np.intp)
        offsets = np.zeros(len(sizes) + 1, dtype=np.intp)
        np.cumsum(sizes, out=offsets[1:])
        offsets.flags.writeable = False
        self.sizes: np.ndarray = sizes
        self.offsets: np.ndarray = offsets
        self.total: int = int(offsets[-1])
        if self._storage is None or self._storage.size < self.total:
            self._storage = self.xp.empty(self.total, dtype=self.wire_dtype)
        self._offsets_list: list[int] = offsets.tolist()
        use_kernel = HAVE_EXT and self.impl != "numpy" and self.xp is np
        self._plan = (
            _kernel.Plan(list(self.shapes), self.dtype, MODES.index(self.mode)) if use_kernel else None
        )

    def place(self, storage: Any) -> None:
        """Keep the buffer in ``storage`` from now on (e.g. node memory; nothing is copied).

        Raises:
            PackError: ``storage`` is not a 1-D array of :attr:`wire_dtype` and at least :attr:`total`.
        """
        if storage.ndim != 1 or storage.dtype != self.wire_dtype or storage.size < self.total:
            raise PackError(
                f"a packer's storage must be 1-D, {self.wire_dtype} and at least {self.total} elements "
                f"(got {storage.shape} {storage.dtype})"
            )
        self._storage = storage

    @property
    def nbytes(self) -> int:
        """Bytes of the packed data (``total * wire_dtype.itemsize``)."""
        return self.total * self.wire_dtype.itemsize

    @property
    def buffer(self) -> Any:
        """The packed buffer: a 1-D view of ``total`` elements of the owned storage."""
        return self._storage[: self.total]

    def slot(self, buffer: Any, i: int) -> Any:
        """The view of array ``i`` inside ``buffer``, shaped like the array."""
        o = self._offsets_list
        return buffer[o[i] : o[i + 1]].reshape(self.shapes[i])

    # -- copies --------------------------------------------------------------------------

    def pack(self, arrays: Sequence[Any], *, qscale: float | None = None) -> Any:
        """Copy ``arrays`` into the buffer in order, casting to the mode's format.

        Args:
            arrays: arrays with the shapes and dtype the packer was built for.
            qscale: the quantization scale, required by (and only by) ``mode="int32"``.

        Returns:
            The 1-D buffer view (:attr:`buffer`), valid until the next ``pack``/``rebind``.

        Raises:
            PackError: wrong number of arrays, an array's shape or dtype differs, or
                ``qscale`` is missing or given for the wrong mode.
        """
        q = self._qscale(qscale)
        buf = self.buffer
        if not isinstance(arrays, list):
            arrays = list(arrays)
        if self._plan is not None and self._plan.pack(arrays, buf, q):
            self.last_impl = "cython"
            return buf
        self._check(arrays, "pack")
        self.last_impl = "numpy"
        with np.errstate(over="ignore", invalid="ignore"):  # inf and NaN pass silently, as in the kernel
            self._pack_slices(arrays, buf, q)
        return buf

    def _pack_slices(self, arrays: list[Any], buf: Any, q: float) -> None:
        o, xp = self._offsets_list, self.xp
        for i, a in enumerate(arrays):
            dst = buf[o[i] : o[i + 1]].reshape(a.shape)
            if self.mode in ("plain", "float16"):
                xp.copyto(dst, a, casting="same_kind")
            elif self.mode == "bfloat16":
                dst[...] = _bfloat16_bits(xp, a)
            else:
                v = xp.clip(a.astype(np.float64) * q, -INT32_LIMIT, INT32_LIMIT)
                dst[...] = xp.nan_to_num(xp.rint(v), nan=0.0).astype(np.int32)

    def unpack(
        self, buffer: Any, arrays: Sequence[Any], scale: float = 1.0, *, qscale: float | None = None
    ) -> None:
        """Copy ``buffer`` back into ``arrays``, multiplied by ``scale``.

        ``arrays[i][...] = buffer[offsets[i]:offsets[i + 1]] * scale``: the product is
        computed in the arrays' dtype for ``plain``/``float16``/``bfloat16`` (``scale =
        1 / size`` turns a summed buffer into an average), in float64 as
        ``q * (scale / qscale)`` for ``int32``.

        Args:
            buffer: a 1-D buffer of at least ``total`` elements of :attr:`wire_dtype` (the
                packer's own :attr:`buffer` or a received one).
            arrays: writable arrays with the shapes and dtype the packer was built for.
            scale: factor applied while copying.
            qscale: the quantization scale used by ``pack`` (``mode="int32"`` only).

        Raises:
            PackError: wrong number of arrays, an array's shape or dtype differs, the
                buffer is too small, not 1-D or of another dtype, or ``qscale`` is missing.
        """
        if getattr(buffer, "ndim", None) != 1 or buffer.size < self.total:
            raise PackError(
                f"unpack needs a 1-D buffer of at least {self.total} elements "
                f"(got shape {getattr(buffer, 'shape', None)})"
            )
        if np.dtype(buffer.dtype) != self.wire_dtype:
            raise PackError(f"unpack buffer has dtype {buffer.dtype}, the packer {self.wire_dtype}")
        q = self._qscale(qscale)
        scale = float(scale)
        mult = scale / q if self.mode == "int32" else scale
        if not isinstance(arrays, list):
            arrays = list(arrays)
        if self._plan is not None and self._plan.unpack(buffer, arrays, mult):
            self.last_impl = "cython"
            return
        self._check(arrays, "unpack")
        self.last_impl = "numpy"
        with np.errstate(over="ignore", invalid="ignore"):
            self._unpack_slices(buffer, arrays, scale, mult)

    def _unpack_slices(self, buffer: Any, arrays: list[Any], scale: float, mult: float) -> None:
        o, xp = self._offsets_list, self.xp
        s = self.dtype.type(scale)
        for i, a in enumerate(arrays):
            src = buffer[o[i] : o[i + 1]].reshape(a.shape)
            if self.mode == "bfloat16":
                src = (src.astype(np.uint32) << 16).view(np.float32)
            if self.mode == "int32":
                a[...] = src * mult  # float64 product, rounded to a's dtype
            elif scale == 1.0:
                xp.copyto(a, src)
            else:
                xp.multiply(src, s, out=a)

    def maxabs(self, arrays: Sequence[Any]) -> float:
        """:func:`local_maxabs` of ``arrays`` (one kernel call when they qualify)."""
        arrays = list(arrays)
        if self._plan is not None:
            m = self._plan.maxabs(arrays)
            if m is not None:
                return float(m)
        return local_maxabs(arrays)

    # -- helpers -------------------------------------------------------------------------

    def _qscale(self, qscale: float | None) -> float:
        if self.mode == "int32":
            if qscale is None or not (float(qscale) > 0 and math.isfinite(qscale)):
                raise PackError(
                    f"mode='int32' needs qscale= a positive finite scale (got {qscale}): "
                    "compute it with int32_pow2_scale(global exponent, number of ranks)"
                )
            return float(qscale)
        if qscale is not None:
            raise PackError(f"qscale= applies to mode='int32' only (this packer: mode={self.mode!r})")
        return 1.0

    def _check(self, arrays: Sequence[Any], what: str) -> None:
        """Validate ``arrays`` against the layout (the slice path's checks)."""
        if len(arrays) != len(self.shapes):
            raise PackError(f"{what} got {len(arrays)} arrays, the packer was built for {len(self.shapes)}")
        for i, a in enumerate(arrays):
            if a.dtype != self.dtype:
                raise PackError(f"{what}: array {i} has dtype {a.dtype}, the packer {self.dtype}")
            if a.shape != self.shapes[i]:
                raise PackError(f"{what}: array {i} has shape {a.shape}, the packer expects {self.shapes[i]}")


def _bfloat16_bits(xp: ModuleType, a: Any) -> Any:
    """bfloat16 bits (round to nearest even, NaN kept quiet) of ``a``, as ``uint16``."""
    x = xp.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    rounded = (x + np.uint32(0x7FFF) + ((x >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    nan = (x & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    return xp.where(nan, (x >> np.uint32(16)) | np.uint32(0x40), rounded).astype(np.uint16)
