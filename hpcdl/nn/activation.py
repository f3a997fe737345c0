"""``ReLU``: ``y = max(x, 0)``, in place."""

from __future__ import annotations

from typing import Any

from hpcdl.backend import get_array_module
from hpcdl.nn._util import is_writeable
from hpcdl.nn.layer import Layer

__all__ = ["ReLU"]


class ReLU(Layer):
    """Rectified linear unit.

    For speed, ``forward`` **overwrites its input** with the output (when the
    input is writeable) and ``backward`` overwrites the incoming gradient.
    That is safe after the layers of this package (none of them needs its own
    output in backward); pass ``inplace=False`` to work on copies.

    Args:
        inplace: Write the output into the input and ``gx`` into ``gy``.
    """

    _cache = ("_mask",)

    def __init__(self, *, inplace: bool = True) -> None:
        super().__init__()
        self.inplace = inplace
        self._mask: Any = None  # cache: x > 0, bool, same shape as x

    def forward(self, x: Any) -> Any:
        xp = get_array_module(x)
        self._mask = x > 0  # same shape as x, bool
        if self.inplace and is_writeable(x):
            return xp.maximum(x, 0, out=x)  # same shape as x
        return xp.maximum(x, 0)  # same shape as x

    def backward(self, gy: Any) -> Any:
        if gy is None:
            return None
        xp = get_array_module(gy)
        if self.inplace and is_writeable(gy):
            return xp.multiply(gy, self._mask, out=gy)  # same shape as x
        return xp.multiply(gy, self._mask)  # same shape as x

    def extra_repr(self) -> str:
        return "" if self.inplace else "inplace=False"
