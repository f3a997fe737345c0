"""``hpcdl.nn.flatten``: shapes, gradient, dtypes."""

from __future__ import annotations

import numpy as np
import pytest

from hpcdl.nn import Flatten


def test_gradcheck(fd, rng):
    fd.check_layer(Flatten(), rng.standard_normal((2, 3, 2, 2)))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_shapes_and_dtype(dtype):
    flat = Flatten()
    x = np.arange(2 * 3 * 4 * 5, dtype=dtype).reshape(2, 3, 4, 5)
    y = flat.forward(x)
    assert y.shape == (2, 60) and y.dtype == dtype
    np.testing.assert_array_equal(y[1], x[1].ravel())
    gx = flat.backward(np.ones_like(y))
    assert gx.shape == x.shape and gx.dtype == dtype
