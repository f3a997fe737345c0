"""Gather one batch of samples by index and move it to the device."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

__all__ = ["gather_batch"]


def gather_batch(
    x: np.ndarray,
    y: np.ndarray,
    indices: np.ndarray,
    xp: ModuleType = np,
    out: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[Any, Any]:
    """The samples ``x[indices], y[indices]`` as arrays of ``xp`` (NumPy or CuPy).

    Args:
        x: Host inputs, shape (N, ...), such as ``Dataset.x_train``.
        y: Host labels, shape (N,).
        indices: Sample indices (from `DistributedSampler`); repeats are allowed.
        xp: The array module of the device (``hpcdl.backend.array_module(device)``).
        out: Optional host buffers of shapes ``(len(indices), *x.shape[1:])`` and
            ``(len(indices),)`` to gather into, reused from step to step. With NumPy the
            returned arrays ARE these buffers, overwritten by the next call: pass
            ``out`` only if nothing keeps a batch past the next call.

    Returns:
        ``(x_batch, y_batch)`` on the device of ``xp``.
    """
    if out is None:
        xb, yb = np.take(x, indices, axis=0), np.take(y, indices, axis=0)
    else:
        xb, yb = out
        np.take(x, indices, axis=0, out=xb)
        np.take(y, indices, axis=0, out=yb)
    return xp.asarray(xb), xp.asarray(yb)
