"""``Dropout``: inverted dropout with a mask from a per-rank stream."""

from __future__ import annotations

from typing import Any

import numpy as np

from hpcdl.backend import get_array_module
from hpcdl.nn.init import default_rng
from hpcdl.nn.layer import Layer

__all__ = ["Dropout"]


class Dropout(Layer):
    """Zeroes each element with probability ``p`` and scales the rest by ``1 / (1 - p)``.

    The identity in evaluation mode. The mask is drawn on the host from ``rng``
    (a stream that differs between ranks, e.g. ``hpcdl.rng.generator(seed,
    rank, "dropout")``) in float32 whatever the data dtype, so CPU, GPU, float32
    and float64 runs drop the same elements.

    Args:
        p: Drop probability, in ``[0, 1]``.
        rng: Stream for the masks (default ``default_rng(0)``).

    Raises:
        ValueError: ``p`` is outside ``[0, 1]``.
    """

    _cache = ("_mask",)

    def __init__(self, p: float = 0.5, *, rng: np.random.Generator | None = None) -> None:
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability must be in [0, 1] (got {p})")
        self.p = float(p)
        self.rng = default_rng(rng)
        self._mask: Any = None  # cache: 0 or 1/(1-p), same shape and dtype as x; None = identity

    def forward(self, x: Any) -> Any:
        if not self.training or self.p == 0.0:
            self._mask = None
            return x
        xp = get_array_module(x)
        keep = self.rng.random(x.shape, dtype=np.float32) >= self.p  # same shape as x, bool (host)
        scale = 0.0 if self.p == 1.0 else 1.0 / (1.0 - self.p)
        mask = xp.asarray(keep.astype(x.dtype) * x.dtype.type(scale))  # same shape as x
        self._mask = mask
        return x * mask  # same shape as x

    def backward(self, gy: Any) -> Any:
        if gy is None or self._mask is None:
            return gy
        return gy * self._mask  # same shape as x

    def extra_repr(self) -> str:
        return f"p={self.p}"
