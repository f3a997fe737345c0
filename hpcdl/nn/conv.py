"""``Conv2d``: 2-D cross-correlation by im2col and one matrix product."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

from hpcdl.backend import get_array_module
from hpcdl.nn._util import pair
from hpcdl.nn.init import default_rng, kaiming_normal, zeros
from hpcdl.nn.layer import Layer
from hpcdl.nn.parameter import Parameter

__all__ = ["Conv2d", "col2im", "im2col", "out_size", "pad2d"]


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


class Conv2d(Layer):
    """2-D convolution (cross-correlation, as in PyTorch) on ``(N, C, H, W)`` inputs.

    ``weight`` is ``(out_channels, in_channels, kh, kw)`` with He-normal
    initialisation (fan_in ``in_channels * kh * kw``); ``bias`` is
    ``(out_channels,)``, zeros. The forward pass copies the input windows into
    a matrix (im2col) and multiplies once; the matrix is the cache. Set
    ``needs_input_grad = False`` on a first layer to skip the col2im step.

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
    """

    _cache = ("_cols", "_shapes")

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
        self._cols: Any = None  # cache: im2col of the padded input, C*kh*kw, N*Ho*Wo
        self._shapes: tuple[tuple[int, ...], tuple[int, ...]] | None = None  # cache: x and padded x shapes

    def forward(self, x: Any) -> Any:
        xp = get_array_module(x)
        if x.ndim != 4 or x.shape[1] != self.in_channels:
            raise ValueError(
                f"{self.name or 'Conv2d'}: input shape {tuple(x.shape)} is not (N, {self.in_channels}, H, W)"
            )
        n, _, h, w = x.shape
        kh, kw = self.kernel_size
        sh, sw = self.stride
        ph, pw = self.padding
        ho, wo = out_size(h, kh, sh, ph), out_size(w, kw, sw, pw)
        if ho < 1 or wo < 1:
            raise ValueError(f"{self.name or 'Conv2d'}: input {h}x{w} is smaller than the kernel {kh}x{kw}")
        o = self.out_channels
        xpad = pad2d(x, ph, pw)  # N, C, Hp, Wp
        cols = im2col(xpad, self.kernel_size, self.stride, (ho, wo))  # C*kh*kw, N*Ho*Wo
        w2 = self.weight.data.reshape(o, -1)  # O, C*kh*kw
        y = xp.matmul(w2, cols)  # O, N*Ho*Wo
        if self.bias is not None:
            y += self.bias.data[:, None]  # O, N*Ho*Wo
        self._cols = cols
        self._shapes = (tuple(x.shape), tuple(xpad.shape))
        return xp.ascontiguousarray(y.reshape(o, n, ho, wo).transpose(1, 0, 2, 3))  # N, O, Ho, Wo

    def backward(self, gy: Any) -> Any:
        xp = get_array_module(gy)
        if self._cols is None or self._shapes is None:
            raise RuntimeError(f"{self.name or 'Conv2d'}: backward called before forward")
        n, o, ho, wo = gy.shape
        (_, _, h, w), padded_shape = self._shapes
        gy2 = xp.ascontiguousarray(gy.transpose(1, 0, 2, 3)).reshape(o, n * ho * wo)  # O, N*Ho*Wo
        xp.matmul(gy2, self._cols.T, out=self.weight.grad.reshape(o, -1))  # O, C*kh*kw
        if self.bias is not None:
            xp.sum(gy2, axis=1, out=self.bias.grad)  # O
        if not self.needs_input_grad:
            return None
        w2t = xp.ascontiguousarray(self.weight.data.reshape(o, -1).T)  # C*kh*kw, O (small; faster GEMM)
        gcols = xp.matmul(w2t, gy2)  # C*kh*kw, N*Ho*Wo
        gxpad = col2im(gcols, padded_shape, self.kernel_size, self.stride)  # N, C, Hp, Wp
        ph, pw = self.padding
        return xp.ascontiguousarray(gxpad[:, :, ph : ph + h, pw : pw + w])  # N, C, H, W

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
            f"stride={self.stride}, padding={self.padding}, bias={self.bias is not None}"
        )
