"""Weight initialisation: drawn with NumPy, then moved to the array module.

Drawing on the host from a ``numpy.random.Generator`` makes CPU and GPU
initialisations bit-identical, and every rank that shares the (seed, "init")
stream gets the same weights (docs/design.md, training semantics). The simulator's
virtual ranks share one process: under :func:`shared_draws` a draw from a stream in a
state already drawn from is copied, not drawn again.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import numpy as np

__all__ = ["default_rng", "kaiming_normal", "ones", "shared_draws", "zeros"]

#: the memories of the open shared_draws: (stream state, shape, std, dtype) -> (the weight
#: drawn, the state after); the innermost last
_shared: list[dict[tuple[Any, ...], tuple[np.ndarray, dict[str, Any]]]] = []


@contextmanager
def shared_draws() -> Iterator[None]:
    """Within it, :func:`kaiming_normal` remembers what it drew from each stream state.

    Every virtual rank of a simulation builds the same model from the same (seed, "init")
    stream: the first draws, the others copy the weights and move their stream to the same
    state after, as if they had drawn (bit for bit). The memory is one model's, freed on exit.
    """
    _shared.append(_shared[-1] if _shared else {})
    try:
        yield
    finally:
        _shared.pop()


def _state_key(rng: np.random.Generator) -> Any:
    """A hashable copy of ``rng``'s state."""
    state = rng.bit_generator.state

    def freeze(v: Any) -> Any:
        if isinstance(v, dict):
            return tuple((k, freeze(x)) for k, x in v.items())
        if isinstance(v, np.ndarray):
            return (v.dtype.str, v.tobytes())
        return v

    return freeze(state)


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
    if not _shared:
        w = rng.standard_normal(shape) * std  # shape, float64 on the host
        return xp.asarray(w.astype(dtype))
    draws, key = _shared[-1], (_state_key(rng), tuple(shape), std, np.dtype(dtype).str)
    if key not in draws:
        w = rng.standard_normal(shape) * std  # shape, float64 on the host
        draws[key] = (w.astype(dtype), rng.bit_generator.state)
    drawn, after = draws[key]
    rng.bit_generator.state = after
    return xp.array(drawn)  # a copy of its own


def zeros(shape: tuple[int, ...], dtype: Any = np.float32, xp: ModuleType = np) -> Any:
    """An array of zeros on ``xp``."""
    return xp.zeros(shape, dtype=dtype)


def ones(shape: tuple[int, ...], dtype: Any = np.float32, xp: ModuleType = np) -> Any:
    """An array of ones on ``xp``."""
    return xp.ones(shape, dtype=dtype)
