"""``hpcdl.nn.activation``: ReLU gradients, in-place behaviour, dtypes."""

from __future__ import annotations

import numpy as np
import pytest

from hpcdl.nn import ReLU


@pytest.mark.parametrize("inplace", [True, False])
def test_gradcheck(fd, rng, inplace):
    fd.check_layer(ReLU(inplace=inplace), fd.away_from_zero(rng, (4, 5)))


def test_values_and_inplace(rng):
    x0 = rng.standard_normal((3, 4))
    ref = np.maximum(x0, 0)
    x = x0.copy()
    relu = ReLU()
    y = relu.forward(x)
    np.testing.assert_array_equal(y, ref)
    assert y is x  # the input was overwritten (documented)
    gy = np.ones_like(y)
    gx = relu.backward(gy)
    assert gx is gy
    np.testing.assert_array_equal(gx, ref > 0)


def test_not_inplace_leaves_input(rng):
    x = rng.standard_normal((3, 4))
    x0 = x.copy()
    y = ReLU(inplace=False).forward(x)
    np.testing.assert_array_equal(x, x0)
    np.testing.assert_array_equal(y, np.maximum(x0, 0))


def test_readonly_input_is_not_written(rng):
    x = rng.standard_normal((3, 4))
    x.flags.writeable = False
    relu = ReLU()
    y = relu.forward(x)
    np.testing.assert_array_equal(y, np.maximum(x, 0))
    gy = np.ones_like(x)
    gy.flags.writeable = False
    np.testing.assert_array_equal(relu.backward(gy), x > 0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_preserves_dtype(dtype):
    relu = ReLU()
    y = relu.forward(np.linspace(-1, 1, 6, dtype=dtype).reshape(2, 3))
    assert y.dtype == dtype
    assert relu.backward(np.ones_like(y)).dtype == dtype


def test_none_gradient_passes_through():
    relu = ReLU()
    relu.forward(np.ones((2, 2), np.float32))
    assert relu.backward(None) is None
