"""Synthetic data: shape, determinism, learnability."""

from __future__ import annotations

import numpy as np
import pytest

from hpcdl.data import synthetic
from hpcdl.errors import DataError


def test_shape_and_determinism():
    a = synthetic((3, 5, 4), num_classes=7, train_size=50, test_size=20, seed=3)
    b = synthetic((3, 5, 4), num_classes=7, train_size=50, test_size=20, seed=3)
    c = synthetic((3, 5, 4), num_classes=7, train_size=50, test_size=20, seed=4)
    assert a.x_train.shape == (50, 3, 5, 4) and a.x_test.shape == (20, 3, 5, 4)
    assert a.input_shape == (3, 5, 4) and a.num_classes == 7 and a.x_train.dtype == np.float32
    assert np.array_equal(a.x_train, b.x_train) and np.array_equal(a.y_test, b.y_test)
    assert not np.array_equal(a.x_train, c.x_train)


def test_parts_independent_of_other_size():
    a = synthetic((4,), train_size=30, test_size=10, seed=0)
    b = synthetic((4,), train_size=30, test_size=99, seed=0)
    assert np.array_equal(a.x_train, b.x_train) and np.array_equal(a.y_train, b.y_train)


def test_labels_come_from_a_linear_teacher():
    ds = synthetic((2, 3), num_classes=4, train_size=2000, test_size=500, seed=1)
    assert set(np.unique(ds.y_train)) == {0, 1, 2, 3}
    # least squares on one-hot targets recovers a linear separator well above chance
    x = ds.x_train.reshape(len(ds.x_train), -1)
    w, *_ = np.linalg.lstsq(x, np.eye(4)[ds.y_train], rcond=None)
    acc = (np.argmax(ds.x_test.reshape(500, -1) @ w, axis=1) == ds.y_test).mean()
    assert acc > 0.8


def test_bad_arguments():
    with pytest.raises(DataError, match="num_classes"):
        synthetic(num_classes=1)
    with pytest.raises(DataError, match="shape"):
        synthetic(shape=(0, 3))
    with pytest.raises(DataError, match="train_size"):
        synthetic(train_size=0)
