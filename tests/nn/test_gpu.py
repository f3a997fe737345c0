"""The same layer code on CuPy: results match NumPy (needs CuPy and a GPU)."""

from __future__ import annotations

import numpy as np
import pytest

from hpcdl import nn

pytestmark = pytest.mark.gpu


def _build(xp):
    rng = np.random.default_rng(0)
    kw = {"rng": rng, "dtype": np.float64, "xp": xp}
    return nn.Sequential(
        [
            nn.Conv2d(2, 4, 3, padding=1, bias=False, **kw),
            nn.BatchNorm2d(4, dtype=np.float64, xp=xp),
            nn.ReLU(),
            nn.MaxPool2d(3, 2, 1),
            nn.BasicBlock(4, 6, 2, **kw),
            nn.AvgPool2d(2, 1),
            nn.GlobalAvgPool2d(),
            nn.Dropout(0.3, rng=np.random.default_rng(1)),
            nn.Linear(6, 3, **kw),
        ]
    )


def test_cupy_matches_numpy():
    cp = pytest.importorskip("cupy")
    try:
        cp.cuda.runtime.getDeviceCount()
    except cp.cuda.runtime.CUDARuntimeError:
        pytest.skip("no GPU")
    x = np.random.default_rng(2).standard_normal((4, 2, 8, 8))
    labels = np.array([0, 1, 2, 0])
    results = []
    for xp in (np, cp):
        model, loss = _build(xp), nn.SoftmaxCrossEntropy()
        value = loss.forward(model.forward(xp.asarray(x)), xp.asarray(labels))
        gx = model.backward(loss.backward())
        grads = {n: cp.asnumpy(p.grad) if xp is cp else p.grad for n, p in model.named_parameters()}
        results.append((value, cp.asnumpy(gx) if xp is cp else gx, grads))
    (v0, gx0, g0), (v1, gx1, g1) = results
    assert v1 == pytest.approx(v0, rel=1e-10)
    np.testing.assert_allclose(gx1, gx0, rtol=1e-8, atol=1e-12)
    for name, g in g0.items():
        np.testing.assert_allclose(g1[name], g, rtol=1e-8, atol=1e-12, err_msg=name)
