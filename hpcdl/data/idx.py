"""MNIST and Fashion-MNIST from their IDX files (gzipped or not) in a directory."""

from __future__ import annotations

import gzip
import math
import os
import struct
import zlib
from pathlib import Path

import numpy as np

from hpcdl.data.dataset import Dataset, labels, scaled
from hpcdl.data.labels import class_count
from hpcdl.errors import DataError

__all__ = ["load_mnist", "read_idx", "find_idx"]

UBYTE = 0x08  # IDX type code of unsigned bytes, the only one MNIST-like sets use
PARTS = {"train": "train", "test": "t10k"}


def _read_bytes(file: Path) -> bytes:
    try:
        if file.suffix == ".gz":
            with gzip.open(file, "rb") as f:
                return f.read()
        return file.read_bytes()
    except (OSError, EOFError, zlib.error) as err:  # BadGzipFile is an OSError
        raise DataError(f"{file}: cannot read ({err}); download the file again") from None


def read_idx(path: str | os.PathLike[str], ndim: int) -> np.ndarray:
    """The uint8 array of an IDX file (``.gz`` files are decompressed first).

    Args:
        path: The file.
        ndim: Number of dimensions expected (3 for images, 1 for labels).

    Returns:
        A read-only uint8 array of the shape the header declares.

    Raises:
        DataError: The file is unreadable, its magic number is not that of an unsigned
            byte IDX file of ``ndim`` dimensions, or its size does not match the header
            (the message names the file and says "expected X bytes, found Y").
    """
    file = Path(path)
    data = _read_bytes(file)
    what = " (after decompression)" if file.suffix == ".gz" else ""
    header = 4 + 4 * ndim
    if len(data) >= 4:
        magic = int.from_bytes(data[:4], "big")
        expected_magic = UBYTE << 8 | ndim
        if magic != expected_magic:
            raise DataError(
                f"{file}: magic number 0x{magic:08x}, expected 0x{expected_magic:08x} "
                f"(an IDX file of unsigned bytes with {ndim} dimension(s)); is it the right file?"
            )
    if len(data) < header:
        raise DataError(
            f"{file}: expected at least {header} bytes{what} for an IDX header, found {len(data)}; "
            f"the file is truncated, download it again"
        )
    dims = struct.unpack(f">{ndim}I", data[4:header])
    expected = header + math.prod(dims)
    if len(data) != expected:
        problem = "truncated" if len(data) < expected else "longer than its header says"
        raise DataError(
            f"{file}: expected {expected} bytes{what}, found {len(data)} (header: shape {dims}); "
            f"the file is {problem}, download it again"
        )
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(dims)


def find_idx(directory: Path, part: str, kind: str) -> Path:
    """The IDX file of a part (``"train"``/``"test"``) and kind (``"images"``/``"labels"``).

    Accepts ``train-images-idx3-ubyte`` and ``train-images.idx3-ubyte``, each plain or
    with ``.gz`` (the names of the original and of common mirrors).

    Raises:
        DataError: No such file in ``directory``.
    """
    code = "idx3" if kind == "images" else "idx1"
    prefix = PARTS[part]
    names = [f"{prefix}-{kind}{sep}{code}-ubyte{gz}" for sep in ("-", ".") for gz in ("", ".gz")]
    for name in names:
        if (directory / name).is_file():
            return directory / name
    raise DataError(
        f"{directory}: no {names[0]} or {names[1]} found; set data.path to the directory holding it"
    )


def load_mnist(path: str | os.PathLike[str] | None, name: str = "mnist", num_classes: int = 0) -> Dataset:
    """MNIST or Fashion-MNIST: images (N, 1, H, W) float32 in [0, 1] (bytes divided by 255).

    Args:
        path: The directory holding ``train-images-idx3-ubyte[.gz]``,
            ``train-labels-idx1-ubyte[.gz]``, ``t10k-images-idx3-ubyte[.gz]`` and
            ``t10k-labels-idx1-ubyte[.gz]``.
        name: The name given to the data set (``"mnist"`` or ``"fashion-mnist"``: both
            use the same file names and format).
        num_classes: The class count asked for (``data.num_classes``): 10, or 0 for the
            data set's own (10).

    Returns:
        A `Dataset` with 10 classes.

    Raises:
        DataError: ``path`` is not a directory, a file is missing or malformed, or the
            image and label counts disagree, or ``num_classes`` is neither 10 nor 0.
    """
    if path is None:
        raise DataError(f"{name} needs data.path: the directory holding train-images-idx3-ubyte[.gz] etc.")
    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise DataError(
            f"{name}: {directory} is not a directory; set data.path to the directory of IDX files"
        )
    arrays, label_files = {}, {}
    for part in PARTS:
        image_file, label_file = find_idx(directory, part, "images"), find_idx(directory, part, "labels")
        x, y = read_idx(image_file, 3), read_idx(label_file, 1)
        if len(x) != len(y):
            raise DataError(f"{image_file} holds {len(x)} images but {label_file} {len(y)} labels")
        if y.size and y.max() > 9:
            raise DataError(f"{label_file}: label {int(y.max())} out of range 0..9")
        arrays[part] = (scaled(x[:, None], 255.0), labels(y))
        label_files[label_file.name] = y
    shape = arrays["train"][0].shape[1:]
    if arrays["test"][0].shape[1:] != shape:
        raise DataError(
            f"{directory}: training images are {shape[1:]} but test images {arrays['test'][0].shape[2:]}"
        )
    return Dataset(
        x_train=arrays["train"][0],
        y_train=arrays["train"][1],
        x_test=arrays["test"][0],
        y_test=arrays["test"][1],
        name=name,
        input_shape=tuple(int(d) for d in shape),
        num_classes=class_count(label_files, directory, num_classes, own=10),
    )
