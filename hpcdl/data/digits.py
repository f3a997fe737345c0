"""The bundled UCI handwritten digits (8x8, 1,437 training and 360 test images)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

from hpcdl.data.arrays import read_npz
from hpcdl.data.dataset import Dataset, labels, scaled
from hpcdl.data.labels import class_count
from hpcdl.errors import DataError

__all__ = ["load_digits", "find_digits"]

FILENAME = "digits.npz"
TRAIN_SIZE, TEST_SIZE = 1437, 360


def find_digits(path: str | os.PathLike[str] | None = None) -> Path:
    """The location of ``digits.npz``.

    Args:
        path: A file, or a directory holding ``digits.npz``. When given, only this
            place is tried (an explicit path that is wrong is an error, never
            silently replaced by the bundled copy).

    Returns:
        Without ``path``, the first that exists of: ``<repo>/data/digits.npz`` next to
        the package (a source checkout or an editable install); ``hpcdl/data/digits.npz``
        and ``<sys.prefix>/share/hpcdl/digits.npz`` (where a non-editable build may ship
        it, as package data or as data files); ``$HPCDL_DATA/digits.npz``.

    Raises:
        DataError: The file is in none of the places tried; the message lists them.
    """
    if path is not None:
        p = Path(path).expanduser()
        tried = [p / FILENAME if p.is_dir() else p]
    else:
        here = Path(__file__).resolve()
        tried = [here.parents[2] / "data" / FILENAME, here.parent / FILENAME]
        tried.append(Path(sys.prefix) / "share" / "hpcdl" / FILENAME)
        if os.environ.get("HPCDL_DATA"):
            tried.append(Path(os.environ["HPCDL_DATA"]).expanduser() / FILENAME)
    for candidate in tried:
        if candidate.is_file():
            return candidate.resolve()
    where = ", ".join(str(p) for p in tried)
    raise DataError(
        f"digits data set not found (tried {where}): set data.path to the file "
        f"or set HPCDL_DATA to the directory holding {FILENAME}"
    )


def load_digits(path: str | os.PathLike[str] | None = None, num_classes: int = 0) -> Dataset:
    """The bundled digits: images (N, 1, 8, 8) float32 in [0, 1] (counts 0..16 divided by 16).

    Args:
        path: Where ``digits.npz`` is, if not in the default places (see `find_digits`).
        num_classes: The class count asked for (``data.num_classes``): 10, or 0 for the
            data set's own (10).

    Returns:
        A `Dataset` named ``"digits"`` with 1,437 training and 360 test images, 10 classes.

    Raises:
        DataError: The file is missing, its arrays are not the bundled digits, or
            ``num_classes`` is neither 10 nor 0.
    """
    file = find_digits(path)
    arrays = read_npz(file)
    x_train, y_train, x_test, y_test = (arrays[k] for k in ("x_train", "y_train", "x_test", "y_test"))
    expected = {"x_train": (TRAIN_SIZE, 1, 8, 8), "x_test": (TEST_SIZE, 1, 8, 8)}
    for key, shape in expected.items():
        x = arrays[key]
        if x.shape != shape or x.dtype != np.uint8 or (x.size and x.max() > 16):
            raise DataError(
                f"{file}: {key} is {x.dtype} {x.shape}, expected uint8 {shape} with values 0..16; "
                f"regenerate it with data/make_digits.py"
            )
    return Dataset(
        x_train=scaled(x_train, 16.0),
        y_train=labels(y_train),
        x_test=scaled(x_test, 16.0),
        y_test=labels(y_test),
        name="digits",
        input_shape=(1, 8, 8),
        num_classes=class_count({"y_train": y_train, "y_test": y_test}, file, num_classes, own=10),
    )
