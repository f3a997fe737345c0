"""The bundled digits file: contents, split, checksum, and where the loader finds it."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import numpy as np
import pytest

from hpcdl.data import find_digits, load_digits
from hpcdl.errors import DataError

DATA = Path(__file__).resolve().parents[2] / "data"
FILE = DATA / "digits.npz"


def test_checksum_matches_readme():
    readme = (DATA / "README.md").read_text()
    (recorded,) = re.findall(r"SHA-256 \| `([0-9a-f]{64})`", readme)
    assert hashlib.sha256(FILE.read_bytes()).hexdigest() == recorded


def test_raw_file_layout():
    with np.load(FILE) as z:
        assert z["x_train"].shape == (1437, 1, 8, 8) and z["x_train"].dtype == np.uint8
        assert z["x_test"].shape == (360, 1, 8, 8) and z["x_test"].dtype == np.uint8
        assert z["x_train"].max() == 16 and z["x_test"].min() == 0
        # the two parts are a partition of scikit-learn's 1,797 rows
        rows = np.concatenate([z["idx_train"], z["idx_test"]])
        assert np.array_equal(np.sort(rows), np.arange(1797))


def test_load_digits():
    ds = load_digits()
    assert ds.name == "digits" and ds.input_shape == (1, 8, 8) and ds.num_classes == 10
    assert ds.x_train.shape == (1437, 1, 8, 8) and ds.x_test.shape == (360, 1, 8, 8)
    assert ds.x_train.dtype == np.float32 and ds.y_train.dtype == np.int64
    assert 0.0 == ds.x_train.min() and ds.x_train.max() == 1.0
    assert set(np.unique(ds.y_train)) == set(range(10))
    assert not ds.x_train.flags.writeable and not ds.y_test.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        ds.x_train[0, 0, 0, 0] = 1.0


def test_split_is_stratified():
    ds = load_digits()
    for c in range(10):
        n_test = int((ds.y_test == c).sum())
        n_all = n_test + int((ds.y_train == c).sum())
        assert abs(n_test - 0.2 * n_all) <= 1, (c, n_test, n_all)


def test_explicit_path_file_and_directory(tmp_path):
    assert find_digits(FILE) == FILE
    assert find_digits(DATA) == FILE
    with pytest.raises(DataError, match=str(tmp_path / "digits.npz")):
        find_digits(tmp_path)  # an explicit path never falls back to the bundled copy


def test_hpcdl_data_env_is_listed_when_missing(tmp_path, monkeypatch):
    from hpcdl.data import digits

    monkeypatch.setattr(digits, "__file__", str(tmp_path / "a" / "b" / "digits.py"))
    monkeypatch.setenv("HPCDL_DATA", str(tmp_path / "env"))
    with pytest.raises(DataError) as err:
        find_digits()
    assert str(tmp_path / "data" / "digits.npz") in str(err.value)
    assert str(tmp_path / "env" / "digits.npz") in str(err.value)
    (tmp_path / "env").mkdir()
    (tmp_path / "env" / "digits.npz").write_bytes(FILE.read_bytes())
    assert find_digits() == (tmp_path / "env" / "digits.npz").resolve()


def test_wrong_file_is_rejected(tmp_path):
    bad = tmp_path / "digits.npz"
    x = np.zeros((10, 1, 8, 8), np.uint8)
    np.savez(bad, x_train=x, y_train=np.zeros(10, np.uint8), x_test=x, y_test=np.zeros(10, np.uint8))
    with pytest.raises(DataError, match="make_digits"):
        load_digits(bad)
