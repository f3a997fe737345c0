"""``Conv2d``: 2-D cross-correlation by im2col and matrix products.

The windows are copied into a matrix with one row per output pixel, ``(N*Ho*Wo, C*kh*kw)``
(:func:`im2row`), which makes the three products of a step the fastest of the layouts
measured with OpenBLAS on one thread. On NumPy float32/float64 arrays the copies are the
compiled kernels of ``hpcdl._ext.conv`` (padding folded in: no padded copy of the input,
no padded gradient); on CuPy or other dtypes they are :func:`im2col`/:func:`col2im`, the
array-module reference, which the kernels equal bit for bit.

3x3 stride-1 convolutions with enough channels (:data:`WINOGRAD_MIN_CHANNELS`) multiply by
Winograd F(2x2, 3x3) instead (:mod:`hpcdl.nn.winograd`), forward and for the input gradient:
2.25 times fewer multiplications, results that differ from im2row's in the last bits.
``Conv2d.winograd`` chooses per layer; :mod:`hpcdl.nn.convplan` sets it by timing both products
at each layer's shape on the machine.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

import numpy as np

from hpcdl.backend import get_array_module
from hpcdl.nn._util import pair
from hpcdl.nn.init import default_rng, kaiming_normal, zeros
from hpcdl.nn.layer import Layer
from hpcdl.nn.parameter import Parameter
from hpcdl.nn.winograd import CHUNK_TILES, conv3x3, filter_transform, tiles

try:
    from hpcdl._ext import conv as _kernel
except ImportError:  # not built: `python setup.py build_ext --inplace` or `pip install .`
    _kernel = None

__all__ = ["WINOGRAD_MIN_CHANNELS", "Conv2d", "col2im", "im2col", "im2row", "out_size", "pad2d", "row2im"]

#: dtypes the compiled kernels take (their fused type)
_KERNEL_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))

#: rows of the column matrix per chunk of samples on the CPU: a chunk's windows are copied
#: and multiplied while they are still in cache (measured: 1024 rows, see Conv2d)
CHUNK_ROWS = 1024

#: eligible layers (3x3, stride 1, padding <= 2 alike on both axes) whose in and out channels
#: are both at least this use Winograd when ``Conv2d.winograd`` is ``None``: below it the
#: transforms' memory passes mostly cost more than the products save. Measured on one AMD EPYC,
#: and not true of every shape even there (small images: 2x2, 4x4); a run times each layer's
#: shape instead and fixes ``winograd`` (:mod:`hpcdl.nn.convplan`, ``model.winograd``)
WINOGRAD_MIN_CHANNELS = 64


def out_size(size: int, k: int, s: int, p: int) -> int:
    """Output length of a window ``k`` sliding with stride ``s`` over ``size + 2p``."""
    return (size + 2 * p - k) // s + 1


def pad2d(x: Any, ph: int, pw: int, value: float = 0.0) -> Any:
    """``x`` (N, C, H, W) padded by ``ph`` rows and ``pw`` columns of ``value`` on each side."""
    if ph == 0 and pw == 0:
        return x
    xp = get_array_module(x)
    n, c, h, w = x.shape
    out = xp.full((n, c, h + 2 * ph, w + 2 * pw), value, dtype=x.dtype)  # N, C, Hp, Wp
    out[:, :, ph : ph + h, pw : pw + w] = x  # N, C, H, W
    return out


def im2col(xpad: Any, kernel: tuple[int, int], stride: tuple[int, int], out: tuple[int, int]) -> Any:
    """The windows of ``xpad`` (N, C, Hp, Wp) as columns: ``(C * kh * kw, N * Ho * Wo)``.

    One strided slice copy per kernel offset (kh * kw of them): each copies
    rows of ``Wo`` neighbouring pixels, much faster than copying a 6-D
    strided view element by element.

    Args:
        xpad: The padded input, ``(N, C, Hp, Wp)``.
        kernel: ``(kh, kw)``.
        stride: ``(sh, sw)``.
        out: ``(Ho, Wo)``.
    """
    xp = get_array_module(xpad)
    n, c, _, _ = xpad.shape
    (kh, kw), (sh, sw), (ho, wo) = kernel, stride, out
    xt = xpad.transpose(1, 0, 2, 3)  # C, N, Hp, Wp (view)
    cols = xp.empty((c, kh, kw, n, ho, wo), dtype=xpad.dtype)  # C, kh, kw, N, Ho, Wo
    for i in range(kh):
        for j in range(kw):
            cols[:, i, j] = xt[:, :, i : i + sh * ho : sh, j : j + sw * wo : sw]  # C, N, Ho, Wo
    return cols.reshape(c * kh * kw, n * ho * wo)  # C*kh*kw, N*Ho*Wo


def col2im(
    gcols: Any, padded_shape: tuple[int, ...], kernel: tuple[int, int], stride: tuple[int, int]
) -> Any:
    """Adjoint of :func:`im2col`: sum column gradients back onto the padded input.

    One vectorised accumulation per kernel offset (kh * kw of them), not a loop
    over pixels.

    Args:
        gcols: Gradient of the columns, ``(C * kh * kw, N * Ho * Wo)``.
        padded_shape: ``(N, C, Hp, Wp)``.
        kernel: ``(kh, kw)``.
        stride: ``(sh, sw)``.

    Returns:
        The gradient of the padded input, ``(N, C, Hp, Wp)`` (a transposed view).
    """
    xp = get_array_module(gcols)
    n, c, hp, wp = padded_shape
    (kh, kw), (sh, sw) = kernel, stride
    ho, wo = out_size(hp, kh, sh, 0), out_size(wp, kw, sw, 0)
    g = gcols.reshape(c, kh, kw, n, ho, wo)  # C, kh, kw, N, Ho, Wo
    gxt = xp.zeros((c, n, hp, wp), dtype=gcols.dtype)  # C, N, Hp, Wp
    for i in range(kh):
        for j in range(kw):
            gxt[:, :, i : i + sh * ho : sh, j : j + sw * wo : sw] += g[:, i, j]  # C, N, Ho, Wo
    return gxt.transpose(1, 0, 2, 3)  # N, C, Hp, Wp


def _kernel_takes(*arrays: Any) -> bool:
    """True when the compiled kernels take ``arrays``: NumPy, one float32/float64 dtype, C-contiguous."""
    if _kernel is None:
        return False
    dtype = arrays[0].dtype
    return (
        all(type(a) is np.ndarray and a.dtype == dtype and a.flags.c_contiguous for a in arrays)
        and dtype in _KERNEL_DTYPES
    )


def im2row(
    x: Any,
    kernel: tuple[int, int],
    stride: tuple[int, int],
    padding: tuple[int, int],
    out: Any = None,
) -> Any:
    """The windows of ``x`` (N, C, H, W) as rows: ``(N * Ho * Wo, C * kh * kw)``, zero padding
    folded in.

    Row ``(n, oy, ox)`` holds the window of output pixel ``(oy, ox)`` of sample ``n``, in
    (channel, kernel row, kernel column) order: ``im2col(pad2d(x, ph, pw), ...).T``. On
    C-contiguous NumPy float32/float64 arrays this is the compiled kernel; else that reference.

    Args:
        x: The unpadded input, ``(N, C, H, W)``.
        kernel: ``(kh, kw)``.
        stride: ``(sh, sw)``.
        padding: Zero padding ``(ph, pw)`` on each side.
        out: Where to write (every element is overwritten); a new array when ``None``.

    Returns:
        ``out``, or the new array.
    """
    xp = get_array_module(x)
    n, c, h, w = x.shape
    (kh, kw), (sh, sw), (ph, pw) = kernel, stride, padding
    ho, wo = out_size(h, kh, sh, ph), out_size(w, kw, sw, pw)
    if out is None:
        out = xp.empty((n * ho * wo, c * kh * kw), dtype=x.dtype)
    if _kernel_takes(x, out):
        _kernel.im2row(x, out, kh, kw, sh, sw, ph, pw)
    else:
        out[...] = im2col(pad2d(x, ph, pw), kernel, stride, (ho, wo)).T  # N*Ho*Wo, C*kh*kw
    return out


def row2im(
    rows: Any,
    x_shape: tuple[int, ...],
    kernel: tuple[int, int],
    stride: tuple[int, int],
    padding: tuple[int, int],
    out: Any = None,
) -> Any:
    """Adjoint of :func:`im2row`: the rows' gradients summed back onto the unpadded input.

    Each pixel's contributions are added in the order :func:`col2im` adds them (kernel
    offsets ascending), so the kernel and the reference agree bit for bit; what falls on
    the padding is dropped.

    Args:
        rows: Gradient of the rows, ``(N * Ho * Wo, C * kh * kw)``.
        x_shape: ``(N, C, H, W)`` of the unpadded input.
        kernel: ``(kh, kw)``.
        stride: ``(sh, sw)``.
        padding: ``(ph, pw)``.
        out: Where to write ``(N, C, H, W)`` (overwritten); a new array when ``None``.

    Returns:
        ``out``, or the new array: the gradient of the input.
    """
    xp = get_array_module(rows)
    n, c, h, w = x_shape
    (kh, kw), (sh, sw), (ph, pw) = kernel, stride, padding
    if out is None:
        out = xp.empty((n, c, h, w), dtype=rows.dtype)
    if _kernel_takes(rows, out):
        _kernel.row2im(rows, out, kh, kw, sh, sw, ph, pw)
    else:
        gxpad = col2im(rows.T, (n, c, h + 2 * ph, w + 2 * pw), kernel, stride)  # N, C, Hp, Wp
        out[...] = gxpad[:, :, ph : ph + h, pw : pw + w]  # N, C, H, W
    return out


def _rows_to_nchw(rows: Any, out: Any) -> None:
    """``out`` (N, O, P) = ``rows`` (N, P, O) transposed per sample."""
    if _kernel_takes(rows, out):
        _kernel.rows_to_nchw(rows, out)
    else:
        out[...] = rows.transpose(0, 2, 1)


def _refs(holder: object, attr: str) -> int:
    """References to ``holder.attr`` (as counted by CPython, through this one function)."""
    return sys.getrefcount(getattr(holder, attr))


class _Probe:
    """An object whose one attribute alone holds an array (for :data:`_ALONE`)."""

    def __init__(self) -> None:
        self.a = np.empty(0)


#: :func:`_refs` of an array that only its attribute holds (calibrated here, so the count
#: of the interpreter's own temporary references cancels out)
_ALONE = _refs(_Probe(), "a")


class Conv2d(Layer):
    """2-D convolution (cross-correlation, as in PyTorch) on ``(N, C, H, W)`` inputs.

    ``weight`` is ``(out_channels, in_channels, kh, kw)`` with He-normal
    initialisation (fan_in ``in_channels * kh * kw``); ``bias`` is
    ``(out_channels,)``, zeros. The forward pass copies the input windows into
    a matrix, a row per output pixel (:func:`im2row`), and multiplies it by the
    weights; the matrix is the cache. Set ``needs_input_grad = False`` on a first
    layer to skip the input gradient.

    On the CPU the samples go through in chunks of about :data:`CHUNK_ROWS` rows: a chunk's
    windows are multiplied while they are still in cache, and the input gradient is formed
    and summed back (:func:`row2im`) a chunk at a time, never as a whole
    ``(N*Ho*Wo, C*kh*kw)`` matrix. A forward reuses the previous forward's matrix when
    nothing but this layer holds it (no :meth:`save_cache` handle, no view), so that the
    large matrices are not allocated, and faulted in page by page, every step.

    ``winograd`` (keyword, also an attribute) picks the product of the forward and the input
    gradient of a 3x3, stride-1 layer with padding <= 2 (the same on both axes): ``True``
    Winograd F(2x2, 3x3), ``False`` im2row, ``None`` (default) Winograd when both channel
    counts are at least :data:`WINOGRAD_MIN_CHANNELS`. The weight gradient is im2row's
    product either way; on the Winograd path the cache is the input (as a ``Linear``'s is),
    and backward builds its windows a chunk at a time (:meth:`windows` gives them whole).
    ``True`` on a layer that is not eligible raises ``ValueError``.

    Args:
        in_channels: Input channels C.
        out_channels: Output channels O.
        kernel_size: ``k`` or ``(kh, kw)``.
        stride: ``s`` or ``(sh, sw)``.
        padding: Zero padding ``p`` or ``(ph, pw)`` on each side.
        bias: Whether to learn an additive bias.
        rng: Stream for the weight initialisation (default ``default_rng(0)``).
        dtype: Parameter dtype.
        xp: Array module holding the parameters.
        winograd: Winograd for the forward and the input gradient (``None``: when it pays).
    """

    _cache = ("_cols", "_x", "_shapes", "_u")

    _params = ("weight", "bias")

    def __init__(  # noqa: PLR0917 (the signature mirrors torch.nn.Conv2d)
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, int],
        stride: int | tuple[int, int] = 1,
        padding: int | tuple[int, int] = 0,
        bias: bool = True,
        *,
        rng: np.random.Generator | None = None,
        dtype: Any = np.float32,
        xp: ModuleType = np,
        winograd: bool | None = None,
    ) -> None:
        super().__init__()
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.kernel_size = pair(kernel_size, "kernel_size")
        self.stride = pair(stride, "stride")
        self.padding = pair(padding, "padding")
        kh, kw = self.kernel_size
        if min(kh, kw, *self.stride) < 1 or min(self.padding) < 0:
            raise ValueError(
                f"Conv2d needs kernel_size, stride >= 1 and padding >= 0 "
                f"(got {self.kernel_size}, {self.stride}, {self.padding})"
            )
        fan_in = in_channels * kh * kw
        shape = (out_channels, in_channels, kh, kw)
        self.weight = Parameter(kaiming_normal(shape, fan_in, rng=default_rng(rng), dtype=dtype, xp=xp))
        self.bias = Parameter(zeros((out_channels,), dtype, xp)) if bias else None
        self._cols: Any = None  # cache: the input's windows, N*Ho*Wo, C*kh*kw
        self._shapes: tuple[tuple[int, ...], tuple[int, int]] | None = None  # cache: x's shape, (Ho, Wo)
        self._x: Any = None  # cache, Winograd: the input, N, C, H, W (its windows are built in backward)
        self._u: Any = None  # cache, Winograd: the transformed filters, 16, O, C (None: im2row)
        self.winograd = winograd
        self.uses_winograd()  # refuses winograd=True on a layer that is not eligible, now

    @property
    def winograd_eligible(self) -> bool:
        """Whether Winograd F(2x2, 3x3) can compute this layer: 3x3, stride 1, padding <= 2 alike."""
        ph, pw = self.padding
        return self.kernel_size == (3, 3) and self.stride == (1, 1) and ph == pw <= 2

    @property
    def winograd_by_rule(self) -> bool:
        """What ``winograd = None`` gives: eligible, and both channel counts at least
        :data:`WINOGRAD_MIN_CHANNELS`."""
        return self.winograd_eligible and min(self.in_channels, self.out_channels) >= WINOGRAD_MIN_CHANNELS

    def uses_winograd(self) -> bool:
        """Whether the forward and the input gradient go through Winograd (see ``winograd``).

        Raises:
            ValueError: ``winograd`` is ``True`` on a layer that is not eligible.
        """
        if self.winograd is None:
            return self.winograd_by_rule
        if self.winograd and not self.winograd_eligible:
            raise ValueError(
                f"{self.name or 'Conv2d'}: Winograd needs a 3x3 kernel, stride 1 and padding <= 2 alike "
                f"(got {self.kernel_size}, {self.stride}, {self.padding}); set winograd=None or False"
            )
        return bool(self.winograd)

    def _samples_per_chunk(self, xp: ModuleType, n: int, pixels: int) -> int:
        """Samples per chunk: about :data:`CHUNK_ROWS` rows on the CPU, all ``n`` on a GPU.

        On the CPU the count does not depend on ``n`` (the scratch is sized for a whole chunk,
        of which a smaller batch touches only its part): the memory probe's dry steps of two
        and three samples then see a fixed scratch, as a large batch has.
        """
        return max(1, -(-CHUNK_ROWS // pixels)) if xp is np else n

    def _winograd_chunk(self, xp: ModuleType, n: int, ho: int, wo: int) -> int:
        """Samples per Winograd chunk: at least :data:`CHUNK_TILES` tiles on the CPU, all ``n`` on a GPU."""
        th, tw = tiles(ho, wo)
        return max(1, -(-CHUNK_TILES // (th * tw))) if xp is np else n

    def _cols_buffer(self, xp: ModuleType, shape: tuple[int, int], dtype: Any) -> Any:
        """The previous forward's matrix when it fits and only this layer holds it, else a new one."""
        if (
            xp is np
            and self._cols is not None
            and self._cols.shape == shape
            and self._cols.dtype == dtype
            and self._cols.flags.c_contiguous
            and _refs(self, "_cols") == _ALONE
        ):
            return self._cols
        return xp.empty(shape, dtype=dtype)

    def forward(self, x: Any) -> Any:
        xp = get_array_module(x)
        if x.ndim != 4 or x.shape[1] != self.in_channels:
            raise ValueError(
                f"{self.name or 'Conv2d'}: input shape {tuple(x.shape)} is not (N, {self.in_channels}, H, W)"
            )
        n, c, h, w = x.shape
        kh, kw = self.kernel_size
        sh, sw = self.stride
        ph, pw = self.padding
        ho, wo = out_size(h, kh, sh, ph), out_size(w, kw, sw, pw)
        if ho < 1 or wo < 1:
            raise ValueError(f"{self.name or 'Conv2d'}: input {h}x{w} is smaller than the kernel {kh}x{kw}")
        o, p = self.out_channels, ho * wo
        x = xp.ascontiguousarray(x)
        w2 = self.weight.data.reshape(o, -1)  # O, C*kh*kw
        dtype = xp.result_type(x.dtype, w2.dtype)
        bias = None if self.bias is None else self.bias.data
        if self.uses_winograd():
            # the windows are the weight gradient's alone: built in backward, a chunk at a time
            # (measured: 64 channels at 32x32, 1.7 times faster than the whole matrix built here)
            self._x, self._cols = x, None
            self._u = filter_transform(self.weight.data)  # 16, O, C
            self._shapes = (tuple(x.shape), (ho, wo))
            return conv3x3(x, self._u, ph, bias=bias, samples_per_chunk=self._winograd_chunk(xp, n, ho, wo))
        cols = self._cols_buffer(xp, (n * p, c * kh * kw), x.dtype)  # N*Ho*Wo, C*kh*kw
        y = xp.empty((n, o, ho, wo), dtype=dtype)  # N, O, Ho, Wo
        step = self._samples_per_chunk(xp, n, p)
        yrows = xp.empty((step * p, o), dtype=dtype)  # chunk rows, O (scratch)
        for n0 in range(0, n, step):
            n1 = min(n, n0 + step)
            r0, r1 = n0 * p, n1 * p
            rows = im2row(x[n0:n1], self.kernel_size, self.stride, self.padding, out=cols[r0:r1])
            yc = xp.matmul(rows, w2.T, out=yrows[: r1 - r0])  # rows, O
            if bias is not None:
                yc += bias  # rows, O
            _rows_to_nchw(yc.reshape(n1 - n0, p, o), y[n0:n1].reshape(n1 - n0, o, p))  # n, O, Ho*Wo
        self._cols, self._x, self._u = cols, None, None
        self._shapes = (tuple(x.shape), (ho, wo))
        return y

    def backward(self, gy: Any) -> Any:
        xp = get_array_module(gy)
        if (self._cols is None and self._x is None) or self._shapes is None:
            raise RuntimeError(f"{self.name or 'Conv2d'}: backward called before forward")
        n, o, ho, wo = gy.shape
        x_shape, _ = self._shapes
        cols, p = self._cols, ho * wo
        gy2 = xp.empty((o, n * p), dtype=gy.dtype)  # O, N*Ho*Wo
        gy2.reshape(o, n, p)[...] = gy.reshape(n, o, p).transpose(1, 0, 2)  # O, N, Ho*Wo
        if cols is None:
            self._weight_grad_by_chunks(xp, gy2, n, p)
        else:
            xp.matmul(gy2, cols, out=self.weight.grad.reshape(o, -1))  # O, C*kh*kw
        if self.bias is not None:
            xp.sum(gy2, axis=1, out=self.bias.grad)  # O
        if not self.needs_input_grad:
            return None
        if self._u is not None:  # a 3x3 convolution of gy by the rotated, transposed filters
            step = self._winograd_chunk(xp, n, x_shape[2], x_shape[3])
            return conv3x3(
                xp.ascontiguousarray(gy), self._u, 2 - self.padding[0], rotated=True, samples_per_chunk=step
            )
        w2 = self.weight.data.reshape(o, -1)  # O, C*kh*kw
        dtype = xp.result_type(gy.dtype, w2.dtype)
        gx = xp.empty(x_shape, dtype=dtype)  # N, C, H, W
        step = self._samples_per_chunk(xp, n, p)
        gcols = xp.empty((step * p, cols.shape[1]), dtype=dtype)  # chunk rows, C*kh*kw (scratch)
        for n0 in range(0, n, step):
            n1 = min(n, n0 + step)
            r0, r1 = n0 * p, n1 * p
            gc = xp.matmul(gy2[:, r0:r1].T, w2, out=gcols[: r1 - r0])  # rows, C*kh*kw
            row2im(gc, gx[n0:n1].shape, self.kernel_size, self.stride, self.padding, out=gx[n0:n1])
        return gx

    def windows(self) -> Any:
        """The last forward's input windows, ``(N*Ho*Wo, C*kh*kw)`` (:func:`im2row`; K-FAC's factor).

        The im2row path's cached matrix; on the Winograd path, which keeps the input instead,
        a new matrix built from it.

        Raises:
            RuntimeError: no forward has run.
        """
        if self._cols is not None:
            return self._cols
        if self._x is None:
            raise RuntimeError(f"{self.name or 'Conv2d'}: windows asked for before forward")
        return im2row(self._x, self.kernel_size, self.stride, self.padding)

    def _weight_grad_by_chunks(self, xp: ModuleType, gy2: Any, n: int, p: int) -> None:
        """The weight gradient ``gy2 @ im2row(x)``, the windows of a chunk of samples at a time.

        A chunk's rows are multiplied while they are still in cache, the products summed:
        the whole ``(N*Ho*Wo, C*kh*kw)`` matrix is never written (the same product as the
        im2row path's in another order of additions, so its last bits may differ).
        """
        x = self._x
        gw = self.weight.grad.reshape(self.out_channels, -1)  # O, C*kh*kw
        step = self._samples_per_chunk(xp, n, p)
        rows = xp.empty((step * p, gw.shape[1]), dtype=x.dtype)  # chunk rows, C*kh*kw (scratch)
        part = xp.empty_like(gw) if step < n else None  # a later chunk's product (scratch)
        for n0 in range(0, n, step):
            n1 = min(n, n0 + step)
            r0, r1 = n0 * p, n1 * p
            rc = im2row(x[n0:n1], self.kernel_size, self.stride, self.padding, out=rows[: r1 - r0])
            if n0 == 0:
                xp.matmul(gy2[:, r0:r1], rc, out=gw)  # O, C*kh*kw
            else:
                xp.matmul(gy2[:, r0:r1], rc, out=part)
                gw += part

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
            f"stride={self.stride}, padding={self.padding}, bias={self.bias is not None}"
        )
