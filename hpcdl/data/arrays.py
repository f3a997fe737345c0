"""Data sets stored as arrays ``x_train, y_train, x_test, y_test`` in an NPZ or HDF5 file."""

from __future__ import annotations

import os
import zipfile
import zlib
from pathlib import Path

import numpy as np

from hpcdl.data.dataset import Dataset, labels, scaled
from hpcdl.data.labels import class_count
from hpcdl.errors import DataError

__all__ = ["load_npz", "load_hdf5", "read_npz", "read_hdf5", "KEYS"]

KEYS = ("x_train", "y_train", "x_test", "y_test")


def _existing(path: str | os.PathLike[str], kind: str) -> Path:
    p = Path(path).expanduser()
    if not p.is_file():
        raise DataError(f"{kind} file {p} not found: set data.path to an existing file")
    return p


def _missing(file: Path, found: list[str]) -> DataError:
    missing = [k for k in KEYS if k not in found]
    return DataError(
        f"{file}: missing array(s) {', '.join(missing)}; found {', '.join(found) or 'none'} "
        f"(expected {', '.join(KEYS)})"
    )


def read_npz(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """The four arrays ``x_train, y_train, x_test, y_test`` of an NPZ file, as stored.

    Raises:
        DataError: The file is missing, unreadable, or lacks one of the keys (the
            message lists the keys found).
    """
    file = _existing(path, "NPZ")
    try:
        # open the file here: np.load(path) leaks its handle when the zip is corrupt
        with open(file, "rb") as fh:
            z = np.load(fh, allow_pickle=False)
            if not isinstance(z, np.lib.npyio.NpzFile):
                raise DataError(f"{file}: holds a single array, expected an NPZ archive with {KEYS}")
            with z:
                found = list(z.files)
                if any(k not in found for k in KEYS):
                    raise _missing(file, found)
                return {k: z[k] for k in KEYS}
    except DataError:
        raise
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as err:
        raise DataError(f"{file}: not a readable NPZ file ({err})") from None


def read_hdf5(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """The four datasets ``x_train, y_train, x_test, y_test`` at the root of an HDF5 file.

    Raises:
        DataError: The file is missing, unreadable, or lacks one of the datasets (the
            message lists the names found).
    """
    import h5py

    file = _existing(path, "HDF5")
    try:
        with h5py.File(file, "r") as f:
            found = list(f.keys())
            if any(k not in found for k in KEYS):
                raise _missing(file, found)
            out = {}
            for k in KEYS:
                if not isinstance(f[k], h5py.Dataset):
                    raise DataError(f"{file}: {k} is a group, expected an array (an HDF5 dataset)")
                out[k] = f[k][()]
            return out
    except DataError:
        raise
    except (OSError, ValueError, KeyError) as err:
        raise DataError(f"{file}: not a readable HDF5 file ({err})") from None


def from_arrays(
    arrays: dict[str, np.ndarray], name: str, source: Path | str, num_classes: int = 0
) -> Dataset:
    """A `Dataset` from stored arrays: uint8 inputs are divided by 255, floats kept.

    Inputs keep their stored per-sample shape (images should be N,C,H,W); labels must
    be integers in ``0 .. C - 1``, where C is ``num_classes``, or with 0 the largest label
    plus one (and then every class below it must occur; see `class_count`).

    Raises:
        DataError: Inputs are neither uint8 nor floating point, train and test shapes
            disagree, a label array is not one label per sample, or the labels are not
            integers in the expected range (the message names ``source``, the range of
            labels found and the range expected).
    """
    xs = {}
    for part in ("train", "test"):
        x, y = arrays[f"x_{part}"], arrays[f"y_{part}"]
        if x.ndim < 1:
            raise DataError(f"{source}: x_{part} is a scalar, expected an array of samples")
        if x.dtype == np.uint8:
            xs[part] = scaled(x, 255.0)
        elif np.issubdtype(x.dtype, np.floating):
            xs[part] = x.astype(np.float32)
        else:
            raise DataError(
                f"{source}: x_{part} has dtype {x.dtype}, expected uint8 (scaled by 1/255) "
                f"or floating point; convert it before saving"
            )
        if y.ndim != 1 or len(y) != len(x):
            raise DataError(
                f"{source}: y_{part} has shape {y.shape}, expected ({len(x)},) "
                f"(one label per sample of x_{part})"
            )
    if xs["train"].shape[1:] != xs["test"].shape[1:]:
        raise DataError(
            f"{source}: x_train samples have shape {xs['train'].shape[1:]} but x_test samples "
            f"{xs['test'].shape[1:]}; they must agree"
        )
    ys = {k: arrays[k] for k in ("y_train", "y_test")}
    return Dataset(
        x_train=xs["train"],
        y_train=labels(arrays["y_train"]),
        x_test=xs["test"],
        y_test=labels(arrays["y_test"]),
        name=name,
        input_shape=tuple(int(d) for d in xs["train"].shape[1:]),
        num_classes=class_count(ys, source, num_classes),
    )


def load_npz(path: str | os.PathLike[str], num_classes: int = 0) -> Dataset:
    """A data set from an NPZ file with arrays ``x_train, y_train, x_test, y_test``.

    Args:
        path: The ``.npz`` file (as written by ``np.savez`` or ``np.savez_compressed``).
        num_classes: The class count (``data.num_classes``); 0: inferred from the labels.

    Returns:
        A `Dataset` named ``"npz"``; see `from_arrays` for the conversion.

    Raises:
        DataError: The file is missing, unreadable, lacks a key, or holds bad arrays or labels.
    """
    file = _existing(path, "NPZ")
    return from_arrays(read_npz(file), "npz", file, num_classes)


def load_hdf5(path: str | os.PathLike[str], num_classes: int = 0) -> Dataset:
    """A data set from an HDF5 file with root datasets ``x_train, y_train, x_test, y_test``.

    Args:
        path: The HDF5 file.
        num_classes: The class count (``data.num_classes``); 0: inferred from the labels.

    Returns:
        A `Dataset` named ``"hdf5"``; see `from_arrays` for the conversion.

    Raises:
        DataError: The file is missing, unreadable, lacks a dataset, or holds bad arrays.
    """
    file = _existing(path, "HDF5")
    return from_arrays(read_hdf5(file), "hdf5", file, num_classes)
