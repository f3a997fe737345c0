"""``load_dataset``: dispatch by name, errors, the per-process cache."""

from __future__ import annotations

import numpy as np
import pytest

from hpcdl.data import DATASETS, clear_cache, load_dataset
from hpcdl.errors import DataError


def test_names():
    assert set(DATASETS) == {"digits", "mnist", "fashion-mnist", "cifar10", "npz", "hdf5", "synthetic"}


def test_unknown_name_lists_valid_names():
    with pytest.raises(DataError, match="unknown data set 'imagenet'.*digits.*fashion-mnist.*synthetic"):
        load_dataset("imagenet", None, seed=0)


@pytest.mark.parametrize("name", ["mnist", "fashion-mnist", "cifar10", "npz", "hdf5"])
def test_path_required(name):
    with pytest.raises(DataError, match="data.path"):
        load_dataset(name, None, seed=0)


def test_cache_shares_one_copy(tmp_path):
    a = load_dataset("digits", None, seed=0)
    assert load_dataset("digits", None, seed=7) is a  # the readers ignore the seed
    s = load_dataset("synthetic", None, seed=0, shape=[1, 4, 4], train_size=64, test_size=8)
    assert load_dataset("synthetic", None, seed=0, shape=(1, 4, 4), train_size=64, test_size=8) is s
    assert load_dataset("synthetic", None, seed=1, shape=(1, 4, 4), train_size=64, test_size=8) is not s
    x = np.zeros((4, 1, 2, 2), np.uint8)
    y = np.arange(4)
    np.savez(tmp_path / "d.npz", x_train=x, y_train=y, x_test=x, y_test=y)
    n = load_dataset("npz", str(tmp_path / "d.npz"), seed=0)
    assert load_dataset("npz", str(tmp_path / ".." / tmp_path.name / "d.npz"), seed=0) is n
    clear_cache()
    assert load_dataset("digits", None, seed=0) is not a


def test_errors_are_not_cached(tmp_path):
    f = tmp_path / "late.npz"
    with pytest.raises(DataError, match="not found"):
        load_dataset("npz", str(f), seed=0)
    x = np.zeros((2, 3), np.float32)
    np.savez(f, x_train=x, y_train=np.array([0, 1]), x_test=x, y_test=np.array([1, 0]))
    assert load_dataset("npz", str(f), seed=0).num_classes == 2
