"""Staleness compensation of the parameter servers (``ps.compensation``), as pure arithmetic.

``lr`` divides a push's learning rate by ``max(tau, 1)`` (Zhang et al., IJCAI 2016); ``dc``
applies ``g + lambda g*g*(w_now - w_used)`` (DC-ASGD, Zheng et al., ICML 2017), where
``w_used`` is the shard the worker computed its gradient from.
"""

from __future__ import annotations

import numpy as np

__all__ = ["compensated_lr", "dc_gradient"]


def compensated_lr(lr: float, tau: int, compensation: str) -> float:
    """The learning rate a push of staleness ``tau`` is applied with: ``lr / max(tau, 1)`` for ``lr``."""
    return lr / max(tau, 1) if compensation == "lr" else lr


def dc_gradient(
    grad: np.ndarray, now: np.ndarray, used: np.ndarray, lam: float, out: np.ndarray
) -> np.ndarray:
    """DC-ASGD's compensated gradient ``g + lambda g*g*(w_now - w_used)``, computed into ``out``."""
    np.subtract(now, used, out=out)
    out *= grad
    out *= grad
    out *= out.dtype.type(lam)
    out += grad
    return out
