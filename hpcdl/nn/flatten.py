"""``Flatten``: ``(N, ...) -> (N, -1)``."""

from __future__ import annotations

from typing import Any

from hpcdl.nn.layer import Layer

__all__ = ["Flatten"]


class Flatten(Layer):
    """Keeps the batch axis and flattens the rest (a view when possible)."""

    _cache = ("_shape",)

    def __init__(self) -> None:
        super().__init__()
        self._shape: tuple[int, ...] | None = None  # cache: the input shape

    def forward(self, x: Any) -> Any:
        self._shape = tuple(x.shape)
        return x.reshape(x.shape[0], -1)  # N, prod(rest)

    def backward(self, gy: Any) -> Any:
        if gy is None:
            return None
        return gy.reshape(self._shape)  # N, ...
