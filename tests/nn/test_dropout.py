"""``hpcdl.nn.dropout``: fixed-mask gradients, inverted scaling, streams, evaluation mode."""

from __future__ import annotations

import numpy as np
import pytest

from hpcdl.nn import Dropout


def test_gradcheck_with_fixed_mask(fd, rng):
    drop = Dropout(0.3)

    def same_mask() -> None:
        drop.rng = np.random.default_rng(42)

    fd.check_layer(drop, rng.standard_normal((4, 6)), before_forward=same_mask)


def test_inverted_scaling_and_mask_relation(rng):
    drop = Dropout(0.25, rng=np.random.default_rng(7))
    x = rng.uniform(1, 2, (200, 50))
    y = drop.forward(x)
    kept = y != 0
    np.testing.assert_allclose(y[kept], x[kept] / 0.75, rtol=1e-15)
    assert abs(kept.mean() - 0.75) < 0.02
    gy = rng.standard_normal(x.shape)
    gx = drop.backward(gy)
    np.testing.assert_array_equal(gx == 0, ~kept)
    np.testing.assert_allclose(gx[kept], gy[kept] / 0.75, rtol=1e-15)


def test_streams_decide_the_mask():
    x = np.ones((8, 8), np.float32)
    a = Dropout(0.5, rng=np.random.default_rng(1)).forward(x)
    b = Dropout(0.5, rng=np.random.default_rng(1)).forward(x)
    c = Dropout(0.5, rng=np.random.default_rng(2)).forward(x)
    np.testing.assert_array_equal(a, b)
    assert np.any(a != c)
    # float32 and float64 inputs drop the same elements for the same stream.
    d = Dropout(0.5, rng=np.random.default_rng(1)).forward(x.astype(np.float64))
    np.testing.assert_array_equal(a != 0, d != 0)


def test_eval_is_identity(rng):
    drop = Dropout(0.9).eval()
    x = rng.standard_normal((3, 4))
    assert drop.forward(x) is x
    gy = rng.standard_normal((3, 4))
    assert drop.backward(gy) is gy


def test_edge_probabilities(rng):
    x = rng.standard_normal((3, 4))
    np.testing.assert_array_equal(Dropout(0.0).forward(x), x)
    np.testing.assert_array_equal(Dropout(1.0).forward(x), 0)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        Dropout(1.5)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_preserves_dtype(dtype):
    drop = Dropout(0.5)
    y = drop.forward(np.ones((4, 4), dtype))
    assert y.dtype == dtype
    assert drop.backward(np.ones_like(y)).dtype == dtype
