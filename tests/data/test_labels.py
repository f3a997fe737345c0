"""Class labels: integers in 0 .. C - 1, the class count given (data.num_classes) or inferred (0)."""

from __future__ import annotations

import struct

import h5py
import numpy as np
import pytest

from hpcdl.data import clear_cache, load_cifar10, load_dataset, load_digits, load_hdf5, load_mnist, load_npz
from hpcdl.data.cifar import TEST_FILES, TRAIN_FILES
from hpcdl.data.labels import class_count
from hpcdl.errors import DataError


def ys(train, test=()) -> dict[str, np.ndarray]:
    return {"y_train": np.asarray(train), "y_test": np.asarray(test, dtype=np.asarray(train).dtype)}


def make_mnist(directory) -> None:
    """Four IDX files: 12 training and 5 test images of 4x3, labels 0..9."""
    for prefix, n in (("train", 12), ("t10k", 5)):
        for kind, a in (
            ("images", np.zeros((n, 4, 3), np.uint8)),
            ("labels", np.arange(n, dtype=np.uint8) % 10),
        ):
            header = struct.pack(">BBBB", 0, 0, 0x08, a.ndim) + struct.pack(f">{a.ndim}I", *a.shape)
            (directory / f"{prefix}-{kind}-idx{a.ndim}-ubyte").write_bytes(header + a.tobytes())


def make_cifar(directory) -> None:
    """The six binary batches, three records each, labels 0..9."""
    for name in TRAIN_FILES + TEST_FILES:
        y = np.array([0, 5, 9], np.uint8)
        records = np.concatenate([y[:, None], np.zeros((3, 3 * 32 * 32), np.uint8)], axis=1)
        (directory / name).write_bytes(records.tobytes())


def save(path, y_train, y_test, fmt="npz"):
    rng = np.random.default_rng(0)
    arrays = {
        "x_train": rng.integers(0, 256, size=(len(y_train), 1, 2, 2)).astype(np.uint8),
        "y_train": np.asarray(y_train),
        "x_test": rng.integers(0, 256, size=(len(y_test), 1, 2, 2)).astype(np.uint8),
        "y_test": np.asarray(y_test),
    }
    if fmt == "npz":
        np.savez(path, **arrays)
    else:
        with h5py.File(path, "w") as f:
            for k, v in arrays.items():
                f[k] = v
    return path


# -- class_count: the rules, one by one ------------------------------------------------------


def test_given_count_accepts_labels_below_it():
    assert class_count(ys([0, 1, 2], [2, 0]), "f.npz", 3) == 3
    assert class_count(ys([0, 1, 2], [2, 0]), "f.npz", 10) == 10  # unused outputs are the config's call


def test_inferred_count_is_largest_label_plus_one():
    assert class_count(ys([0, 1, 2, 3], [3, 0]), "f.npz", 0) == 4
    assert class_count(ys([1, 0], []), "f.npz") == 2  # an empty test part is fine


@pytest.mark.parametrize(
    ("train", "test", "num_classes", "fragments"),
    [
        # the case: labels 5..14 and the default count of 10
        (
            np.arange(5, 15),
            [5],
            10,
            ["f.npz", "y_train", "labels 5..14", "expected 0..9", "data.num_classes = 15"],
        ),
        # the same labels, count inferred: 15 classes of which 0..4 never occur
        (np.arange(5, 15), [5], 0, ["f.npz", "labels run 5..14", "0..14", "0..4 never occur"]),
        # 1-based labels (MATLAB-style), inferred
        (np.arange(1, 11), [1], 0, ["f.npz", "labels run 1..10", "class(es) 0 never occur", "0..10"]),
        # a gap in the middle, inferred
        ([0, 2, 4, 0], [4], 0, ["f.npz", "class(es) 1, 3 never occur", "0..4"]),
        # the test part is checked too
        ([0, 1, 2], [0, 7], 3, ["f.npz", "y_test", "labels 0..7", "expected 0..2", "or 0 to infer"]),
        (np.array([0, -1, 3]), [0], 10, ["f.npz", "y_train", "labels -1..3", "expected 0..9"]),
        (np.array([0, -1, 3]), [0], 0, ["f.npz", "y_train", "labels -1..3", "expected from 0"]),
        (
            np.array([0.0, 1.0, 9.0]),
            [],
            10,
            ["f.npz", "y_train", "float64", "values 0..9", "expected integer class labels 0..9", "astype"],
        ),
        (np.array([0.0, 1.5]), [], 0, ["float64", "values 0..1.5", "integer class labels"]),
        (np.array([True, False]), [], 0, ["bool", "integer class labels"]),
        ([0, 0, 0], [0], 0, ["f.npz", "every label is 0", "at least 2", "C >= 2"]),
        (np.zeros(0, np.int64), [], 0, ["f.npz", "no labels", "data.num_classes"]),
    ],
)
def test_bad_labels_name_the_file_the_range_found_and_expected(train, test, num_classes, fragments):
    with pytest.raises(DataError) as info:
        class_count(ys(train, test), "f.npz", num_classes)
    msg = str(info.value)
    assert "\n" not in msg
    for fragment in fragments:
        assert fragment in msg, msg


def test_uint_labels_above_int64_are_reported_not_wrapped():
    big = np.array([0, 1, 2**63 + 5], dtype=np.uint64)
    with pytest.raises(DataError, match=r"labels 0\.\.9223372036854775813, expected 0\.\.9"):
        class_count({"y_train": big}, "f.npz", 10)


def test_fixed_count_data_sets_take_only_their_count():
    labels = ys(np.arange(10), np.arange(10))
    assert class_count(labels, "d", 0, own=10) == 10
    assert class_count(labels, "d", 10, own=10) == 10
    with pytest.raises(
        DataError, match=r"y_train has labels 0\.\.9, expected 0\.\.4 \(data.num_classes = 5\)"
    ):
        class_count(labels, "d", 5, own=10)
    with pytest.raises(
        DataError, match=r"d: the data set has 10 classes .*data.num_classes = 12: set .* = 10"
    ):
        class_count(labels, "d", 12, own=10)
    with pytest.raises(DataError, match=r"labels 0\.\.11, expected 0\.\.9 \(the data set has 10 classes\)"):
        class_count(ys(np.arange(12)), "d", 0, own=10)


@pytest.mark.parametrize("num_classes", [1, -2])
def test_count_itself_out_of_range(num_classes):
    with pytest.raises(DataError, match=rf"at least 2, or 0 .*\(got {num_classes}\)"):
        class_count(ys([0, 1]), "f", num_classes)


# -- every reader honours num_classes -------------------------------------------------------


@pytest.mark.parametrize("fmt", ["npz", "hdf5"])
def test_array_files_honour_the_given_count(tmp_path, fmt):
    f = save(tmp_path / f"d.{fmt}", np.arange(5, 15), np.arange(5, 15), fmt)
    load = load_npz if fmt == "npz" else load_hdf5
    with pytest.raises(DataError) as info:
        load(f, 10)
    assert str(f) in str(info.value) and "labels 5..14, expected 0..9" in str(info.value)
    with pytest.raises(DataError, match=r"0\.\.4 never occur"):
        load(f)  # inferred
    assert load(f, 15).num_classes == 15
    g = save(tmp_path / f"e.{fmt}", np.arange(4), np.arange(4), fmt)
    assert load(g).num_classes == 4 and load(g, 6).num_classes == 6


def test_label_shape_names_the_file(tmp_path):
    f = save(tmp_path / "d.npz", np.zeros((3, 1), np.int64), [0, 1])
    with pytest.raises(DataError, match=r"d\.npz: y_train has shape \(3, 1\), expected \(3,\)"):
        load_npz(f)


def test_digits_count():
    assert load_digits(None, 0).num_classes == 10 and load_digits(None, 10).num_classes == 10
    with pytest.raises(DataError, match=r"digits\.npz: y_train has labels 0\.\.9, expected 0\.\.6"):
        load_digits(None, 7)
    with pytest.raises(DataError, match=r"digits\.npz: the data set has 10 classes"):
        load_digits(None, 11)


def test_mnist_count_names_the_label_file(tmp_path):
    make_mnist(tmp_path)
    assert load_mnist(tmp_path, "mnist", 0).num_classes == 10
    with pytest.raises(DataError, match=r"train-labels-idx1-ubyte has labels 0\.\.\d, expected 0\.\.1"):
        load_mnist(tmp_path, "mnist", 2)


def test_cifar_count(tmp_path):
    make_cifar(tmp_path)
    assert load_cifar10(tmp_path, 10).num_classes == 10
    with pytest.raises(DataError, match=r"the data set has 10 classes .* data.num_classes = 100"):
        load_cifar10(tmp_path, 100)


def test_load_dataset_caches_per_count(tmp_path):
    f = str(save(tmp_path / "d.npz", np.arange(4), np.arange(4)))
    a = load_dataset("npz", f, seed=0, num_classes=0)
    assert a.num_classes == 4 and load_dataset("npz", f, seed=0, num_classes=0) is a
    b = load_dataset("npz", f, seed=0, num_classes=8)
    assert b.num_classes == 8 and b is not a
    assert load_dataset("npz", f, seed=0) is a  # the library default: the data set's own count
    s = load_dataset("synthetic", None, seed=0, shape=(2,), num_classes=0, train_size=50, test_size=5)
    assert s.num_classes == 10  # synthetic's own count
    assert load_dataset("synthetic", None, seed=0, shape=(2,), num_classes=3, train_size=50).num_classes == 3
    clear_cache()
