"""Pooling: ``MaxPool2d``, ``AvgPool2d`` and ``GlobalAvgPool2d``."""

from __future__ import annotations

from typing import Any

from hpcdl.backend import get_array_module
from hpcdl.nn._util import pair
from hpcdl.nn.conv import _kernel, _kernel_takes, out_size, pad2d
from hpcdl.nn.layer import Layer

__all__ = ["AvgPool2d", "GlobalAvgPool2d", "MaxPool2d"]


class _Pool2d(Layer):
    """Shared geometry of the windowed pools."""

    _cache = ("_shapes",)

    def __init__(
        self,
        kernel_size: int | tuple[int, int],
        stride: int | tuple[int, int] | None = None,
        padding: int | tuple[int, int] = 0,
    ) -> None:
        super().__init__()
        self.kernel_size = pair(kernel_size, "kernel_size")
        self.stride = self.kernel_size if stride is None else pair(stride, "stride")
        self.padding = pair(padding, "padding")
        kh, kw = self.kernel_size
        ph, pw = self.padding
        if min(kh, kw, *self.stride) < 1 or min(ph, pw) < 0:
            raise ValueError(
                f"{type(self).__name__} needs kernel_size, stride >= 1 and padding >= 0 "
                f"(got {self.kernel_size}, {self.stride}, {self.padding})"
            )
        if 2 * ph > kh or 2 * pw > kw:
            raise ValueError(
                f"{type(self).__name__}: padding {self.padding} must be at most half the kernel "
                f"{self.kernel_size}"
            )
        self._shapes: tuple[tuple[int, ...], tuple[int, ...]] | None = None  # cache: x and padded x shapes

    def _geometry(self, x: Any) -> tuple[int, int]:
        if x.ndim != 4:
            raise ValueError(f"{self.name or type(self).__name__}: input shape {tuple(x.shape)} is not 4-D")
        _, _, h, w = x.shape
        (kh, kw), (sh, sw), (ph, pw) = self.kernel_size, self.stride, self.padding
        ho, wo = out_size(h, kh, sh, ph), out_size(w, kw, sw, pw)
        if ho < 1 or wo < 1:
            raise ValueError(f"{self.name or type(self).__name__}: input {h}x{w} is smaller than the kernel")
        return ho, wo

    def _offset(self, i: int, j: int, ho: int, wo: int) -> tuple[slice, ...]:
        """Index of the pixels at kernel offset ``(i, j)`` of every window: ``[:, :, Ho, Wo]``."""
        sh, sw = self.stride
        return (slice(None), slice(None), slice(i, i + sh * ho, sh), slice(j, j + sw * wo, sw))

    def _unpad(self, gxpad: Any) -> Any:
        """The gradient of the unpadded input, ``(N, C, H, W)``, from that of the padded one."""
        assert self._shapes is not None
        (_, _, h, w), _ = self._shapes
        ph, pw = self.padding
        if ph == 0 and pw == 0:
            return gxpad
        xp = get_array_module(gxpad)
        return xp.ascontiguousarray(gxpad[:, :, ph : ph + h, pw : pw + w])  # N, C, H, W

    def extra_repr(self) -> str:
        return f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}"


class MaxPool2d(_Pool2d):
    """Maximum over each window; padding counts as ``-inf`` (PyTorch's semantics).

    Ties go to the first maximum in the window (row-major), which receives the
    whole gradient.

    Args:
        kernel_size: ``k`` or ``(kh, kw)``.
        stride: Defaults to ``kernel_size``.
        padding: ``-inf`` padding on each side, at most half the kernel.
    """

    _cache = ("_shapes", "_argmax")

    def __init__(
        self,
        kernel_size: int | tuple[int, int],
        stride: int | tuple[int, int] | None = None,
        padding: int | tuple[int, int] = 0,
    ) -> None:
        super().__init__(kernel_size, stride, padding)
        self._argmax: Any = None  # cache: flat index kh*kw of the max in each window, N, C, Ho, Wo

    def forward(self, x: Any) -> Any:
        xp = get_array_module(x)
        ho, wo = self._geometry(x)
        (kh, kw), (ph, pw) = self.kernel_size, self.padding
        n, c, h, w = x.shape
        self._shapes = (tuple(x.shape), (n, c, h + 2 * ph, w + 2 * pw))
        if _kernel_takes(x):  # one compiled pass, the same maxima and offsets as the passes below
            y = xp.empty((n, c, ho, wo), dtype=x.dtype)  # N, C, Ho, Wo
            self._argmax = xp.empty((n, c, ho, wo), dtype=xp.int32)  # N, C, Ho, Wo
            _kernel.maxpool(x, y, self._argmax, kh, kw, *self.stride, ph, pw)
            return y
        xpad = pad2d(x, ph, pw, value=-xp.inf)  # N, C, Hp, Wp
        y = xpad[self._offset(0, 0, ho, wo)].copy()  # N, C, Ho, Wo
        argmax = xp.zeros(y.shape, dtype=xp.int32)  # N, C, Ho, Wo
        for k in range(1, kh * kw):  # one pass per kernel offset; ties keep the first
            v = xpad[self._offset(k // kw, k % kw, ho, wo)]  # N, C, Ho, Wo
            better = v > y  # N, C, Ho, Wo
            argmax = xp.where(better, k, argmax)  # N, C, Ho, Wo
            y = xp.where(better, v, y)  # N, C, Ho, Wo
        self._argmax = argmax
        return y  # N, C, Ho, Wo

    def backward(self, gy: Any) -> Any:
        if gy is None:
            return None
        if self._shapes is None:
            raise RuntimeError(f"{self.name or 'MaxPool2d'}: backward called before forward")
        xp = get_array_module(gy)
        x_shape, padded_shape = self._shapes
        kh, kw = self.kernel_size
        (sh, sw), (ph, pw) = self.stride, self.padding
        _, _, ho, wo = gy.shape
        apart = sh >= kh and sw >= kw  # windows that do not overlap: one contribution per pixel
        if apart and _kernel_takes(gy) and type(self._argmax) is type(gy) and self._argmax.flags.c_contiguous:
            gx = xp.empty(x_shape, dtype=gy.dtype)  # N, C, H, W
            _kernel.maxpool_backward(gy, self._argmax, gx, kh, kw, sh, sw, ph, pw)
            return gx
        gxpad = xp.zeros(padded_shape, dtype=gy.dtype)  # N, C, Hp, Wp
        for k in range(kh * kw):
            hit = self._argmax == k  # N, C, Ho, Wo
            gxpad[self._offset(k // kw, k % kw, ho, wo)] += gy * hit  # N, C, Ho, Wo
        return self._unpad(gxpad)  # N, C, H, W


class AvgPool2d(_Pool2d):
    """Mean over each window; zero padding counts in the mean (PyTorch's default).

    Args:
        kernel_size: ``k`` or ``(kh, kw)``.
        stride: Defaults to ``kernel_size``.
        padding: Zero padding on each side, at most half the kernel.
    """

    def forward(self, x: Any) -> Any:
        ho, wo = self._geometry(x)
        (kh, kw), (ph, pw) = self.kernel_size, self.padding
        xpad = pad2d(x, ph, pw)  # N, C, Hp, Wp
        self._shapes = (tuple(x.shape), tuple(xpad.shape))
        y = xpad[self._offset(0, 0, ho, wo)].copy()  # N, C, Ho, Wo
        for k in range(1, kh * kw):
            y += xpad[self._offset(k // kw, k % kw, ho, wo)]  # N, C, Ho, Wo
        y *= x.dtype.type(1.0 / (kh * kw))  # N, C, Ho, Wo
        return y

    def backward(self, gy: Any) -> Any:
        if gy is None:
            return None
        if self._shapes is None:
            raise RuntimeError(f"{self.name or 'AvgPool2d'}: backward called before forward")
        xp = get_array_module(gy)
        _, padded_shape = self._shapes
        kh, kw = self.kernel_size
        _, _, ho, wo = gy.shape
        g = gy * gy.dtype.type(1.0 / (kh * kw))  # N, C, Ho, Wo
        gxpad = xp.zeros(padded_shape, dtype=gy.dtype)  # N, C, Hp, Wp
        for k in range(kh * kw):
            gxpad[self._offset(k // kw, k % kw, ho, wo)] += g  # N, C, Ho, Wo
        return self._unpad(gxpad)  # N, C, H, W


class GlobalAvgPool2d(Layer):
    """Mean over the spatial axes: ``(N, C, H, W) -> (N, C)``."""

    _cache = ("_shape",)

    def __init__(self) -> None:
        super().__init__()
        self._shape: tuple[int, ...] | None = None  # cache: the input shape

    def forward(self, x: Any) -> Any:
        if x.ndim != 4:
            raise ValueError(f"{self.name or 'GlobalAvgPool2d'}: input shape {tuple(x.shape)} is not 4-D")
        self._shape = tuple(x.shape)
        return x.mean(axis=(2, 3))  # N, C

    def backward(self, gy: Any) -> Any:
        if gy is None:
            return None
        if self._shape is None:
            raise RuntimeError(f"{self.name or 'GlobalAvgPool2d'}: backward called before forward")
        xp = get_array_module(gy)
        n, c, h, w = self._shape
        g = gy * gy.dtype.type(1.0 / (h * w))  # N, C
        return xp.repeat(g.reshape(n, c, 1), h * w, axis=2).reshape(n, c, h, w)  # N, C, H, W
