"""Batch normalisation: ``BatchNorm1d`` (N, C) and ``BatchNorm2d`` (N, C, H, W)."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

from hpcdl.backend import get_array_module
from hpcdl.nn.init import ones, zeros
from hpcdl.nn.layer import Layer
from hpcdl.nn.parameter import Parameter

try:
    from hpcdl._ext import fused as _fused
except ImportError:  # not built: the array-module path computes the same, up to rounding
    _fused = None

__all__ = ["BatchNorm1d", "BatchNorm2d"]


class _BatchNorm(Layer):
    """Normalises each channel over the batch (and spatial) axes.

    In training mode the batch statistics are used and the running statistics
    are updated in place (``running = (1 - momentum) * running + momentum *
    batch``, the variance unbiased as in PyTorch); in evaluation mode the
    running statistics are used. Statistics stay local to the rank (docs/design.md, training semantics).

    In training, NumPy inputs of float32 or float64 (C-contiguous, parameters of the same
    dtype) take compiled kernels (``hpcdl._ext.fused``): the forward in three passes over
    the input, the backward in two, without temporaries. Their per-channel sums accumulate
    in float64, so their results differ from the array-module path's (pairwise sums in the
    input's dtype) in the last bits.
    """

    _cache = ("_xhat", "_inv_std", "_batch_stats")

    _params = ("weight", "bias")
    _buffers = ("running_mean", "running_var")
    _ndims: tuple[int, ...] = ()

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float = 0.1,
        *,
        dtype: Any = np.float32,
        xp: ModuleType = np,
    ) -> None:
        super().__init__()
        self.num_features = num_features
        self.eps = float(eps)
        self.momentum = float(momentum)
        self.weight = Parameter(ones((num_features,), dtype, xp))  # gamma, C
        self.bias = Parameter(zeros((num_features,), dtype, xp))  # beta, C
        self.running_mean = zeros((num_features,), dtype, xp)  # C
        self.running_var = ones((num_features,), dtype, xp)  # C
        self._xhat: Any = None  # cache: normalised input, same shape as x
        self._inv_std: Any = None  # cache: 1 / sqrt(var + eps), broadcastable (1, C, 1, ...)
        self._batch_stats = True  # cache: whether forward used batch statistics

    def _axes_and_shape(self, x: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The reduction axes of ``x`` and the broadcast shape of a per-channel vector."""
        if x.ndim not in self._ndims or x.shape[1] != self.num_features:
            raise ValueError(
                f"{self.name or type(self).__name__}: input shape {tuple(x.shape)} does not have "
                f"{' or '.join(map(str, self._ndims))} axes with {self.num_features} channels on axis 1"
            )
        axes = (0, *range(2, x.ndim))
        return axes, (1, self.num_features) + (1,) * (x.ndim - 2)

    def forward(self, x: Any) -> Any:
        xp = get_array_module(x)
        axes, cshape = self._axes_and_shape(x)
        gamma = self.weight.data.reshape(cshape)  # 1, C, 1, 1
        beta = self.bias.data.reshape(cshape)  # 1, C, 1, 1
        self._batch_stats = self.training
        if self.training:
            m = x.size // self.num_features  # values per channel
            if m < 2:
                raise ValueError(
                    f"{self.name or type(self).__name__}: training needs more than one value per "
                    f"channel (input shape {tuple(x.shape)})"
                )
            if _fused is not None and _fused.takes(x):
                y = self._forward_fused(x, m, cshape)
                if y is not None:
                    return y
            mean = x.mean(axis=axes, keepdims=True)  # 1, C, 1, 1
            xc = x - mean  # N, C, H, W
            var = (xc * xc).mean(axis=axes, keepdims=True)  # 1, C, 1, 1 (biased)
            inv_std = 1.0 / xp.sqrt(var + self.eps)  # 1, C, 1, 1
            xhat = xc * inv_std  # N, C, H, W
            self._update_running(mean.reshape(-1), var.reshape(-1), m)
        else:
            inv_std = 1.0 / xp.sqrt(self.running_var.reshape(cshape) + self.eps)  # 1, C, 1, 1
            xhat = (x - self.running_mean.reshape(cshape)) * inv_std  # N, C, H, W
        self._xhat = xhat
        self._inv_std = inv_std.astype(x.dtype, copy=False)
        return xhat * gamma + beta  # N, C, H, W

    def _forward_fused(self, x: Any, m: int, cshape: tuple[int, ...]) -> Any:
        """The training forward by the compiled kernel; None when it does not take the arrays."""
        xhat, y = np.empty_like(x), np.empty_like(x)  # N, C, H, W
        mean, var, inv_std = (np.empty(self.num_features, x.dtype) for _ in range(3))  # C
        if not _fused.batchnorm_forward(
            x, self.weight.data, self.bias.data, self.eps, xhat, y, mean, var, inv_std
        ):
            return None
        self._update_running(mean, var, m)
        self._xhat = xhat
        self._inv_std = inv_std.reshape(cshape)  # 1, C, 1, 1
        return y

    def _update_running(self, mean: Any, var: Any, m: int) -> None:
        """Blend the batch ``mean`` and biased ``var`` (C) of ``m`` values per channel into the
        running statistics (the variance made unbiased)."""
        mom = self.momentum
        self.running_mean *= 1.0 - mom  # C
        self.running_mean += mom * mean  # C
        self.running_var *= 1.0 - mom  # C
        self.running_var += (mom * m / (m - 1)) * var  # C (unbiased)

    def backward(self, gy: Any) -> Any:
        xp = get_array_module(gy)
        xhat, inv_std = self._xhat, self._inv_std  # N, C, H, W; 1, C, 1, 1
        if xhat is None:
            raise RuntimeError(f"{self.name or type(self).__name__}: backward called before forward")
        axes, cshape = self._axes_and_shape(gy)
        if self._batch_stats and _fused is not None and _fused.takes(gy):
            gx = np.empty_like(gy) if self.needs_input_grad else None  # N, C, H, W
            if _fused.batchnorm_backward(
                gy, xhat, self.weight.data, inv_std.reshape(-1), self.bias.grad, self.weight.grad, gx
            ):
                return gx
        xp.sum(gy, axis=axes, out=self.bias.grad)  # C
        xp.sum(gy * xhat, axis=axes, out=self.weight.grad)  # C
        if not self.needs_input_grad:
            return None
        gxhat = gy * self.weight.data.reshape(cshape)  # N, C, H, W
        if not self._batch_stats:
            return gxhat * inv_std  # N, C, H, W
        mean_g = gxhat.mean(axis=axes, keepdims=True)  # 1, C, 1, 1
        mean_gx = (gxhat * xhat).mean(axis=axes, keepdims=True)  # 1, C, 1, 1
        return (gxhat - mean_g - xhat * mean_gx) * inv_std  # N, C, H, W

    def extra_repr(self) -> str:
        return f"{self.num_features}, eps={self.eps}, momentum={self.momentum}"


class BatchNorm1d(_BatchNorm):
    """Batch normalisation over ``(N, C)`` (or ``(N, C, L)``) inputs.

    Args:
        num_features: Channels C.
        eps: Added to the variance.
        momentum: Weight of the batch statistics in the running ones.
        dtype: Parameter and buffer dtype.
        xp: Array module.
    """

    _ndims = (2, 3)


class BatchNorm2d(_BatchNorm):
    """Batch normalisation over ``(N, C, H, W)`` inputs.

    Args:
        num_features: Channels C.
        eps: Added to the variance.
        momentum: Weight of the batch statistics in the running ones.
        dtype: Parameter and buffer dtype.
        xp: Array module.
    """

    _ndims = (4,)
