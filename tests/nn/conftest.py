"""Finite-difference gradient checks shared by the ``hpcdl.nn`` tests.

Every check runs in float64 with central differences and the criterion
``max|analytic - numeric| / max(max|analytic|, max|numeric|) <= 1e-6``, on the
random projection loss ``L = sum(y * R)`` so that every output matters.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

TOL = 1e-6
STEP = 1e-5


def rel_err(analytic: np.ndarray, numeric: np.ndarray) -> float:
    """``max|a - n| / max(max|a|, max|n|)`` (0 when both are zero)."""
    scale = max(float(np.max(np.abs(analytic))), float(np.max(np.abs(numeric))))
    if scale == 0.0:
        return 0.0
    return float(np.max(np.abs(analytic - numeric))) / scale


def numeric_grad(f: Callable[[], float], a: np.ndarray, h: float = STEP) -> np.ndarray:
    """Central differences of the scalar ``f()`` with respect to ``a`` (perturbed in place, restored)."""
    g = np.zeros_like(a)
    for idx in np.ndindex(a.shape):
        old = a[idx]
        a[idx] = old + h
        fp = f()
        a[idx] = old - h
        fm = f()
        a[idx] = old
        g[idx] = (fp - fm) / (2 * h)
    return g


def check_layer(
    layer: Any,
    x: np.ndarray,
    *,
    seed: int = 0,
    before_forward: Callable[[], None] | None = None,
    check_input: bool = True,
) -> dict[str, float]:
    """Check ``layer.backward`` (input and every parameter) against finite differences.

    ``before_forward`` runs before every forward (to reset a random stream).
    The layer sees a copy of ``x`` each time (ReLU works in place).

    Returns:
        The relative error of each checked gradient, by name (``"x"`` for the input).
    """
    assert x.dtype == np.float64
    rng = np.random.default_rng(seed)

    def run(inp: np.ndarray) -> np.ndarray:
        if before_forward is not None:
            before_forward()
        return layer.forward(inp.copy())

    y = run(x)
    r = rng.standard_normal(y.shape)
    gx = layer.backward(r.copy())
    grads = {name: p.grad.copy() for name, p in layer.named_parameters()}

    errors = {}
    xv = x.copy()
    if check_input:
        ngx = numeric_grad(lambda: float(np.sum(run(xv) * r)), xv)
        assert gx.shape == x.shape
        errors["x"] = rel_err(gx, ngx)
    for name, p in layer.named_parameters():
        ng = numeric_grad(lambda: float(np.sum(run(xv) * r)), p.data)
        errors[name] = rel_err(grads[name], ng)
    bad = {k: v for k, v in errors.items() if not v <= TOL}
    assert not bad, f"gradient check failed (relative errors > {TOL}): {bad}"
    return errors


def check_loss(loss: Any, pred: np.ndarray, target: np.ndarray) -> float:
    """Check ``loss.backward()`` against finite differences of ``loss.forward(pred, target)``."""
    loss.forward(pred, target)
    g = loss.backward()
    pv = pred.copy()
    ng = numeric_grad(lambda: loss.forward(pv, target), pv)
    err = rel_err(g, ng)
    assert err <= TOL, f"loss gradient relative error {err} > {TOL}"
    return err


def away_from_zero(rng: np.random.Generator, shape: tuple[int, ...], margin: float = 0.1) -> np.ndarray:
    """Float64 values with ``|x| >= margin`` (no ReLU kink within reach of the FD step)."""
    x = rng.standard_normal(shape)
    return np.where(x >= 0, x + margin, x - margin)


def distinct(rng: np.random.Generator, shape: tuple[int, ...], gap: float = 0.1) -> np.ndarray:
    """Float64 values that differ pairwise by at least ``gap`` (no max-pool ties)."""
    n = int(np.prod(shape))
    return (rng.permutation(n).reshape(shape) - n / 2) * gap


@pytest.fixture
def rng() -> np.random.Generator:
    """A fixed stream for test inputs."""
    return np.random.default_rng(1234)


@pytest.fixture
def fd() -> SimpleNamespace:
    """The finite-difference helpers of this module (``fd.check_layer(...)``)."""
    return SimpleNamespace(
        check_layer=check_layer,
        check_loss=check_loss,
        numeric_grad=numeric_grad,
        rel_err=rel_err,
        away_from_zero=away_from_zero,
        distinct=distinct,
        tol=TOL,
    )
