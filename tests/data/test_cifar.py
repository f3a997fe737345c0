"""CIFAR-10 binary batches."""

from __future__ import annotations

import numpy as np
import pytest

from hpcdl.data import load_cifar10
from hpcdl.data.cifar import TEST_FILES, TRAIN_FILES, read_cifar_batch
from hpcdl.errors import DataError


def records(n: int, seed: int) -> tuple[np.ndarray, np.ndarray, bytes]:
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, size=(n, 3, 32, 32), dtype=np.uint8)
    y = rng.integers(0, 10, size=n, dtype=np.uint8)
    raw = np.concatenate([y[:, None], x.reshape(n, -1)], axis=1).tobytes()
    return x, y, raw


def make_cifar(directory) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    directory.mkdir(parents=True, exist_ok=True)
    out = {}
    for i, name in enumerate(TRAIN_FILES + TEST_FILES):
        x, y, raw = records(2 + i % 2, seed=i)
        (directory / name).write_bytes(raw)
        out[name] = (x, y)
    return out


def test_load_cifar10(tmp_path):
    files = make_cifar(tmp_path)
    ds = load_cifar10(tmp_path)
    assert ds.input_shape == (3, 32, 32) and ds.num_classes == 10 and ds.name == "cifar10"
    assert ds.x_train.shape == (2 + 3 + 2 + 3 + 2, 3, 32, 32) and ds.x_test.shape == (3, 3, 32, 32)
    x1, y1 = files["data_batch_1.bin"]
    # channel planes R, G, B in record order, row-major 32 x 32
    np.testing.assert_allclose(ds.x_train[:2] * 255, x1, atol=1e-4)
    assert np.array_equal(ds.y_train[:2], y1) and np.array_equal(ds.y_test, files["test_batch.bin"][1])


def test_archive_subdirectory(tmp_path):
    make_cifar(tmp_path / "cifar-10-batches-bin")
    assert load_cifar10(tmp_path).train_size == 12


def test_record_layout(tmp_path):
    rec = bytes([7]) + bytes(range(256)) * 12
    f = tmp_path / "b.bin"
    f.write_bytes(rec)
    x, y = read_cifar_batch(f)
    assert y.tolist() == [7] and x[0, 0, 0, :3].tolist() == [0, 1, 2] and x[0, 1, 0, 0] == 0
    assert x[0, 2, 31, 31] == 255


def test_size_not_multiple_of_record(tmp_path):
    make_cifar(tmp_path)
    f = tmp_path / "data_batch_3.bin"
    f.write_bytes(f.read_bytes()[:-1])
    with pytest.raises(DataError, match="3073") as err:
        load_cifar10(tmp_path)
    assert str(f) in str(err.value)


def test_missing_batches(tmp_path):
    make_cifar(tmp_path)
    (tmp_path / "data_batch_5.bin").unlink()
    (tmp_path / "test_batch.bin").unlink()
    with pytest.raises(DataError, match="missing data_batch_5.bin, test_batch.bin"):
        load_cifar10(tmp_path)


def test_bad_label(tmp_path):
    make_cifar(tmp_path)
    (tmp_path / "test_batch.bin").write_bytes(bytes([42]) + bytes(3072))
    with pytest.raises(DataError, match="label 42"):
        load_cifar10(tmp_path)
