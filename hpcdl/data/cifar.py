"""CIFAR-10 from its binary batches (``data_batch_1.bin`` .. ``data_batch_5.bin``, ``test_batch.bin``)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from hpcdl.data.dataset import Dataset, labels, scaled
from hpcdl.data.labels import class_count
from hpcdl.errors import DataError

__all__ = ["load_cifar10", "read_cifar_batch"]

RECORD = 1 + 3 * 32 * 32  # one label byte, then 1024 red, 1024 green, 1024 blue bytes
TRAIN_FILES = tuple(f"data_batch_{i}.bin" for i in range(1, 6))
TEST_FILES = ("test_batch.bin",)
SUBDIR = "cifar-10-batches-bin"  # what the official archive unpacks to


def read_cifar_batch(path: str | os.PathLike[str]) -> tuple[np.ndarray, np.ndarray]:
    """The images (N, 3, 32, 32) uint8 and labels (N,) uint8 of one binary batch file.

    Raises:
        DataError: The file is unreadable, its size is not a multiple of 3,073 bytes,
            or a label is not in 0..9.
    """
    file = Path(path)
    try:
        data = np.fromfile(file, dtype=np.uint8)
    except OSError as err:
        raise DataError(f"{file}: cannot read ({err})") from None
    if data.size % RECORD:
        raise DataError(
            f"{file}: {data.size} bytes is not a multiple of the {RECORD}-byte CIFAR-10 record "
            f"(expected {data.size // RECORD * RECORD + RECORD} bytes for {data.size // RECORD + 1} "
            f"records, found {data.size}); the file is truncated or not a CIFAR-10 binary batch"
        )
    records = data.reshape(-1, RECORD)
    y = records[:, 0]
    if y.size and y.max() > 9:
        raise DataError(f"{file}: label {int(y.max())} out of range 0..9; is it a CIFAR-10 (not -100) batch?")
    return records[:, 1:].reshape(-1, 3, 32, 32), y


def load_cifar10(path: str | os.PathLike[str] | None, num_classes: int = 0) -> Dataset:
    """CIFAR-10: images (N, 3, 32, 32) float32 in [0, 1] (bytes divided by 255), 10 classes.

    Args:
        path: The directory holding the six ``.bin`` files, or its parent holding
            ``cifar-10-batches-bin/``.
        num_classes: The class count asked for (``data.num_classes``): 10, or 0 for the
            data set's own (10).

    Returns:
        A `Dataset` named ``"cifar10"`` (50,000 training and 10,000 test images for the
        official files).

    Raises:
        DataError: ``path`` is not a directory, a file is missing or malformed, or
            ``num_classes`` is neither 10 nor 0.
    """
    if path is None:
        raise DataError("cifar10 needs data.path: the directory holding data_batch_1.bin .. test_batch.bin")
    directory = Path(path).expanduser()
    if not (directory / TRAIN_FILES[0]).is_file() and (directory / SUBDIR).is_dir():
        directory = directory / SUBDIR
    if not directory.is_dir():
        raise DataError(
            f"cifar10: {directory} is not a directory; set data.path to the CIFAR-10 binary batches"
        )
    missing = [n for n in TRAIN_FILES + TEST_FILES if not (directory / n).is_file()]
    if missing:
        raise DataError(
            f"{directory}: missing {', '.join(missing)}; set data.path to the directory of "
            f"the CIFAR-10 binary version (cifar-10-binary.tar.gz)"
        )
    parts, ys = {}, {}
    for part, names in (("train", TRAIN_FILES), ("test", TEST_FILES)):
        batches = [read_cifar_batch(directory / n) for n in names]
        x = np.concatenate([b[0] for b in batches])
        y = np.concatenate([b[1] for b in batches])
        parts[part] = (scaled(x, 255.0), labels(y))
        ys[f"{names[0]} .. {names[-1]}" if len(names) > 1 else names[0]] = y
    return Dataset(
        x_train=parts["train"][0],
        y_train=parts["train"][1],
        x_test=parts["test"][0],
        y_test=parts["test"][1],
        name="cifar10",
        input_shape=(3, 32, 32),
        num_classes=class_count(ys, directory, num_classes, own=10),
    )
