"""Weight initialisation: drawn with NumPy, then moved to the array module.

Drawing on the host from a ``numpy.random.Generator`` makes CPU and GPU
initialisations bit-identical, and every rank that shares the (seed, "init")
stream gets the same weights (docs/design.md, training semantics).
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any

import numpy as np

__all__ = ["default_rng", "kaiming_normal", "ones", "zeros"]


def default_rng(rng: np.random.Generator | None) -> np.random.Generator:
    """``rng`` itself, or ``numpy.random.default_rng(0)`` when it is ``None``."""
    return np.random.default_rng(0) if rng is None else rng


def kaiming_normal(
    shape: tuple[int, ...],
    fan_in: int,
    *,
    rng: np.random.Generator,
    dtype: Any = np.float32,
    xp: ModuleType = np,
    gain: float = math.sqrt(2.0),
) -> Any:
    """He (Kaiming) normal initialisation: ``N(0, (gain / sqrt(fan_in))**2)``.

    Args:
        shape: Shape of the weight.
        fan_in: Number of inputs feeding one output (``in`` or ``in * kh * kw``).
        rng: Stream to draw from (drawn in float64, then cast).
        dtype: Floating dtype of the result.
        xp: Array module of the result (``numpy`` or ``cupy``).
        gain: ``sqrt(2)`` for ReLU networks.

    Returns:
        An array of ``shape`` and ``dtype`` on ``xp``.

    Raises:
        ValueError: ``fan_in`` is not positive.
    """
    if fan_in <= 0:
        raise ValueError(f"fan_in must be positive ({fan_in} <= 0)")
    std = gain / math.sqrt(fan_in)
    w = rng.standard_normal(shape) * std  # shape, float64 on the host
    return xp.asarray(w.astype(dtype))


def zeros(shape: tuple[int, ...], dtype: Any = np.float32, xp: ModuleType = np) -> Any:
    """An array of zeros on ``xp``."""
    return xp.zeros(shape, dtype=dtype)


def ones(shape: tuple[int, ...], dtype: Any = np.float32, xp: ModuleType = np) -> Any:
    """An array of ones on ``xp``."""
    return xp.ones(shape, dtype=dtype)
