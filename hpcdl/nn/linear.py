"""``Linear``: ``y = x W^T + b``."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

from hpcdl.backend import get_array_module
from hpcdl.nn.init import default_rng, kaiming_normal, zeros
from hpcdl.nn.layer import Layer
from hpcdl.nn.parameter import Parameter

__all__ = ["Linear"]


class Linear(Layer):
    """Fully connected layer on ``(N, in_features)`` inputs.

    ``weight`` is ``(out_features, in_features)`` with He-normal initialisation
    (fan_in, gain ``sqrt(2)``), ``bias`` is ``(out_features,)`` and starts at zero.

    Set ``needs_input_grad = False`` on the first layer of a model: ``backward``
    then skips the ``gy @ W`` product and returns ``None``.

    Args:
        in_features: Size of each input row.
        out_features: Size of each output row.
        bias: Whether to learn an additive bias.
        rng: Stream for the weight initialisation (default ``default_rng(0)``).
        dtype: Parameter dtype.
        xp: Array module holding the parameters (``numpy`` or ``cupy``).
    """

    _cache = ("_x",)

    _params = ("weight", "bias")

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        rng: np.random.Generator | None = None,
        dtype: Any = np.float32,
        xp: ModuleType = np,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        shape = (out_features, in_features)
        self.weight = Parameter(kaiming_normal(shape, in_features, rng=default_rng(rng), dtype=dtype, xp=xp))
        self.bias = Parameter(zeros((out_features,), dtype, xp)) if bias else None
        self._x: Any = None  # cache: the input, N, in

    def forward(self, x: Any) -> Any:
        xp = get_array_module(x)
        if x.ndim != 2 or x.shape[1] != self.in_features:
            raise ValueError(
                f"{self.name or 'Linear'}: input shape {tuple(x.shape)} is not (N, {self.in_features})"
            )
        w = self.weight.data  # out, in
        self._x = x  # N, in
        y = xp.matmul(x, w.T)  # N, out
        if self.bias is not None:
            y += self.bias.data  # N, out
        return y

    def backward(self, gy: Any) -> Any:
        xp = get_array_module(gy)
        x = self._x  # N, in
        if x is None:
            raise RuntimeError(f"{self.name or 'Linear'}: backward called before forward")
        xp.matmul(gy.T, x, out=self.weight.grad)  # out, in
        if self.bias is not None:
            xp.sum(gy, axis=0, out=self.bias.grad)  # out
        if not self.needs_input_grad:
            return None
        return xp.matmul(gy, self.weight.data)  # N, in

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, bias={self.bias is not None}"
