"""MNIST-style IDX files, plain and gzipped, and their failure modes."""

from __future__ import annotations

import gzip
import struct

import numpy as np
import pytest

from hpcdl.data import load_mnist, read_idx
from hpcdl.errors import DataError


def idx_bytes(a: np.ndarray) -> bytes:
    return struct.pack(">BBBB", 0, 0, 0x08, a.ndim) + struct.pack(f">{a.ndim}I", *a.shape) + a.tobytes()


def write(path, data: bytes, gz: bool):
    if gz:
        path = path.with_name(path.name + ".gz")
        path.write_bytes(gzip.compress(data))
    else:
        path.write_bytes(data)
    return path


def make_mnist(directory, gz: bool, n_train=12, n_test=5, hw=(4, 3)):
    rng = np.random.default_rng(0)
    arrays = {}
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        x = rng.integers(0, 256, size=(n, *hw), dtype=np.uint8)
        y = rng.integers(0, 10, size=n, dtype=np.uint8)
        write(directory / f"{prefix}-images-idx3-ubyte", idx_bytes(x), gz)
        write(directory / f"{prefix}-labels-idx1-ubyte", idx_bytes(y), gz)
        arrays[prefix] = (x, y)
    return arrays


@pytest.mark.parametrize("gz", [False, True])
def test_load_mnist(tmp_path, gz):
    arrays = make_mnist(tmp_path, gz)
    ds = load_mnist(tmp_path, "fashion-mnist")
    assert ds.name == "fashion-mnist" and ds.input_shape == (1, 4, 3) and ds.num_classes == 10
    assert ds.x_train.shape == (12, 1, 4, 3) and ds.x_test.shape == (5, 1, 4, 3)
    np.testing.assert_allclose(ds.x_train[:, 0] * 255, arrays["train"][0], atol=1e-4)
    assert np.array_equal(ds.y_test, arrays["t10k"][1])
    assert ds.x_test.dtype == np.float32 and ds.y_test.dtype == np.int64


def test_read_idx_roundtrip(tmp_path):
    a = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    f = write(tmp_path / "a-idx3-ubyte", idx_bytes(a), gz=True)
    assert np.array_equal(read_idx(f, 3), a)


@pytest.mark.parametrize("gz", [False, True])
def test_truncated_file(tmp_path, gz):
    a = np.zeros((3, 4, 4), np.uint8)
    f = write(tmp_path / "train-images-idx3-ubyte", idx_bytes(a)[:-5], gz)
    with pytest.raises(DataError, match=r"expected 64 bytes( \(after decompression\))?, found 59") as err:
        read_idx(f, 3)
    assert str(f) in str(err.value)


def test_trailing_bytes(tmp_path):
    f = write(tmp_path / "x", idx_bytes(np.zeros(3, np.uint8)) + b"\0", gz=False)
    with pytest.raises(DataError, match=r"expected 11 bytes, found 12"):
        read_idx(f, 1)


def test_shorter_than_header(tmp_path):
    f = write(tmp_path / "x", b"\0\0\x08", gz=False)
    with pytest.raises(DataError, match=str(f)):
        read_idx(f, 1)


def test_bad_magic(tmp_path):
    labels = idx_bytes(np.zeros(3, np.uint8))
    f = write(tmp_path / "x", labels, gz=False)
    with pytest.raises(DataError, match=r"magic number 0x00000801, expected 0x00000803"):
        read_idx(f, 3)  # a label file where images were expected
    g = write(tmp_path / "y", b"\0\0\x0d\x01" + labels[4:], gz=False)  # float type code
    with pytest.raises(DataError, match="magic number"):
        read_idx(g, 1)


def test_corrupt_gzip(tmp_path):
    f = tmp_path / "t10k-labels-idx1-ubyte.gz"
    f.write_bytes(gzip.compress(idx_bytes(np.zeros(100, np.uint8)))[:-20])
    with pytest.raises(DataError, match=str(f)):
        read_idx(f, 1)
    f.write_bytes(b"not gzip at all")
    with pytest.raises(DataError, match=str(f)):
        read_idx(f, 1)


def test_missing_file_and_count_mismatch(tmp_path):
    make_mnist(tmp_path, gz=False)
    (tmp_path / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(DataError, match="t10k-labels-idx1-ubyte"):
        load_mnist(tmp_path)
    write(tmp_path / "t10k-labels-idx1-ubyte", idx_bytes(np.zeros(4, np.uint8)), gz=False)
    with pytest.raises(DataError, match="5 images but .* 4 labels"):
        load_mnist(tmp_path)


def test_label_out_of_range(tmp_path):
    make_mnist(tmp_path, gz=False)
    write(tmp_path / "t10k-labels-idx1-ubyte", idx_bytes(np.full(5, 10, np.uint8)), gz=False)
    with pytest.raises(DataError, match="label 10"):
        load_mnist(tmp_path)


def test_not_a_directory(tmp_path):
    with pytest.raises(DataError, match="not a directory"):
        load_mnist(tmp_path / "nowhere")
    with pytest.raises(DataError, match="data.path"):
        load_mnist(None)
