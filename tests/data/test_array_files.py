"""Data sets from NPZ and HDF5 files of arrays."""

from __future__ import annotations

import h5py
import numpy as np
import pytest

from hpcdl.data import load_hdf5, load_npz
from hpcdl.errors import DataError


def arrays(x_dtype=np.uint8):
    rng = np.random.default_rng(0)
    return {
        "x_train": rng.integers(0, 256, size=(6, 2, 3, 3)).astype(x_dtype),
        "y_train": np.array([0, 1, 2, 3, 4, 0]),
        "x_test": rng.integers(0, 256, size=(4, 2, 3, 3)).astype(x_dtype),
        "y_test": np.array([1, 2, 3, 4], np.int32),
    }


def save_h5(path, data):
    with h5py.File(path, "w") as f:
        for k, v in data.items():
            f[k] = v


@pytest.mark.parametrize("fmt", ["npz", "hdf5"])
def test_load(tmp_path, fmt):
    data = arrays()
    if fmt == "npz":
        f = tmp_path / "d.npz"
        np.savez_compressed(f, **data)
        ds = load_npz(f)
    else:
        f = tmp_path / "d.h5"
        save_h5(f, data)
        ds = load_hdf5(f)
    assert ds.name == fmt and ds.input_shape == (2, 3, 3) and ds.num_classes == 5
    np.testing.assert_allclose(ds.x_train * 255, data["x_train"], atol=1e-4)
    assert ds.y_test.dtype == np.int64 and ds.y_test.tolist() == [1, 2, 3, 4]
    assert not ds.x_test.flags.writeable


def test_float_inputs_kept(tmp_path):
    data = arrays(np.float64)
    np.savez(tmp_path / "d.npz", **data)
    ds = load_npz(tmp_path / "d.npz")
    assert ds.x_train.dtype == np.float32 and ds.x_train.max() > 1  # not rescaled


@pytest.mark.parametrize("fmt", ["npz", "hdf5"])
def test_missing_key_lists_keys_found(tmp_path, fmt):
    data = arrays()
    data["labels"] = data.pop("y_test")
    f = tmp_path / f"d.{fmt}"
    np.savez(f, **data) if fmt == "npz" else save_h5(f, data)
    with pytest.raises(DataError, match=r"missing array\(s\) y_test; found .*labels") as err:
        load_npz(f) if fmt == "npz" else load_hdf5(f)
    assert str(f) in str(err.value)


@pytest.mark.parametrize("fmt", ["npz", "hdf5"])
def test_malformed_file(tmp_path, fmt):
    good, f = tmp_path / f"good.{fmt}", tmp_path / f"d.{fmt}"
    np.savez(good, **arrays()) if fmt == "npz" else save_h5(good, arrays())
    f.write_bytes(good.read_bytes()[:300])  # truncated
    with pytest.raises(DataError, match=str(f)):
        load_npz(f) if fmt == "npz" else load_hdf5(f)
    f.write_bytes(b"neither zip nor HDF5")
    with pytest.raises(DataError, match="not a readable"):
        load_npz(f) if fmt == "npz" else load_hdf5(f)


def test_single_array_file(tmp_path):
    f = tmp_path / "x.npz"
    with open(f, "wb") as fh:
        np.save(fh, np.zeros(3))
    with pytest.raises(DataError, match="single array"):
        load_npz(f)


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match="not found"):
        load_npz(tmp_path / "none.npz")
    with pytest.raises(DataError, match="not found"):
        load_hdf5(tmp_path / "none.h5")


def test_bad_arrays(tmp_path):
    data = arrays()
    data["x_test"] = data["x_test"][:, :1]
    np.savez(tmp_path / "a.npz", **data)
    with pytest.raises(DataError, match="must agree"):
        load_npz(tmp_path / "a.npz")
    data = arrays()
    data["y_train"] = data["y_train"].astype(np.float32)
    np.savez(tmp_path / "b.npz", **data)
    with pytest.raises(DataError, match="integer class labels"):
        load_npz(tmp_path / "b.npz")
    data = arrays()
    data["y_train"] = data["y_train"][:-1]
    np.savez(tmp_path / "c.npz", **data)
    with pytest.raises(DataError, match=r"y_train has shape \(5,\), expected \(6,\)"):
        load_npz(tmp_path / "c.npz")
    data = arrays(np.int32)
    np.savez(tmp_path / "d.npz", **data)
    with pytest.raises(DataError, match="dtype int32"):
        load_npz(tmp_path / "d.npz")
