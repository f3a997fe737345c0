"""``gather_batch``."""

from __future__ import annotations

import numpy as np

from hpcdl.data import gather_batch


def test_gather_batch():
    x = np.arange(40, dtype=np.float32).reshape(10, 1, 2, 2)
    y = np.arange(10) * 3
    idx = np.array([3, 3, 9])
    xb, yb = gather_batch(x, y, idx, np)
    assert np.array_equal(xb, x[idx]) and np.array_equal(yb, y[idx])
    out = (np.empty((3, 1, 2, 2), np.float32), np.empty(3, np.int64))
    xb2, yb2 = gather_batch(x, y, idx[::-1], np, out=out)
    assert xb2 is out[0] and np.array_equal(xb2, x[idx[::-1]]) and np.array_equal(yb2, y[idx[::-1]])
