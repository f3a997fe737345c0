"""``ReLU``: ``y = max(x, 0)``, in place."""

from __future__ import annotations

from typing import Any

import numpy as np

from hpcdl.backend import get_array_module
from hpcdl.nn._util import is_writeable
from hpcdl.nn.layer import Layer

try:
    from hpcdl._ext import fused as _fused
except ImportError:  # not built: the array-module path does the same in two passes
    _fused = None

__all__ = ["ReLU"]


class ReLU(Layer):
    """Rectified linear unit.

    For speed, ``forward`` **overwrites its input** with the output (when the
    input is writeable) and ``backward`` overwrites the incoming gradient.
    That is safe after the layers of this package (none of them needs its own
    output in backward); pass ``inplace=False`` to work on copies.

    NumPy arrays of float32 or float64 (C-contiguous) take one compiled pass each way
    (``hpcdl._ext.fused``), bit for bit the array-module path's result.

    Args:
        inplace: Write the output into the input and ``gx`` into ``gy``.
    """

    _cache = ("_mask",)

    def __init__(self, *, inplace: bool = True) -> None:
        super().__init__()
        self.inplace = inplace
        self._mask: Any = None  # cache: x > 0, bool, same shape as x

    def forward(self, x: Any) -> Any:
        inplace = self.inplace and is_writeable(x)
        if _fused is not None and _fused.takes(x):
            y = x if inplace else np.empty_like(x)  # same shape as x
            mask = np.empty(x.shape, np.bool_)  # same shape as x
            if _fused.relu_forward(x, y, mask):
                self._mask = mask
                return y
        xp = get_array_module(x)
        self._mask = x > 0  # same shape as x, bool
        if inplace:
            return xp.maximum(x, 0, out=x)  # same shape as x
        return xp.maximum(x, 0)  # same shape as x

    def backward(self, gy: Any) -> Any:
        if gy is None:
            return None
        inplace = self.inplace and is_writeable(gy)
        if _fused is not None and _fused.takes(gy):
            gx = gy if inplace else np.empty_like(gy)  # same shape as x
            if _fused.relu_backward(gy, self._mask, gx):
                return gx
        xp = get_array_module(gy)
        if inplace:
            return xp.multiply(gy, self._mask, out=gy)  # same shape as x
        return xp.multiply(gy, self._mask)  # same shape as x

    def extra_repr(self) -> str:
        return "" if self.inplace else "inplace=False"
