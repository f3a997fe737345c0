"""Convert scikit-learn's copy of the UCI digits into ``data/digits.npz`` (provenance, run once).

This script is not part of the package: hpcdl never imports scikit-learn. It is kept so
that anyone can check how ``digits.npz`` was made, and regenerate it byte for byte::

    python data/make_digits.py            # writes data/digits.npz, prints its SHA-256
    python data/make_digits.py --check    # rebuilds in memory and compares with the file

The file holds (see ``data/README.md``):

* ``x_train`` uint8 (1437, 1, 8, 8), ``y_train`` uint8 (1437,),
* ``x_test``  uint8 (360, 1, 8, 8),  ``y_test``  uint8 (360,),
* ``idx_train`` / ``idx_test`` uint16: row numbers in ``sklearn.datasets.load_digits()``.

Pixel values are the original counts 0..16; labels are 0..9. The split is stratified:
for each class (in order 0..9) one seeded permutation of that class's rows; the first
``t_c`` go to test, where the ``t_c`` apportion exactly 360 test images over the classes
in proportion to their sizes (largest remainder, ties to the smaller class label), so
each class has 360/1797 (about 20%) of its images in the test part, within one image.
Within each part the rows keep scikit-learn's order.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import sys
import zipfile
from pathlib import Path

import numpy as np
from sklearn.datasets import load_digits

SEED = 1998  # the year of the data set; any fixed number would do
N_TEST = 360
OUT = Path(__file__).resolve().parent / "digits.npz"
ZIP_DATE = (1980, 1, 1, 0, 0, 0)  # fixed entry timestamps: the file is reproducible


def test_counts(class_sizes: np.ndarray, n_test: int) -> np.ndarray:
    """Apportion ``n_test`` over classes in proportion to their sizes (largest remainder)."""
    total = int(class_sizes.sum())
    quota = class_sizes.astype(np.int64) * n_test  # exact integer arithmetic
    counts = quota // total
    remainder = quota % total
    short = n_test - int(counts.sum())
    order = sorted(range(len(class_sizes)), key=lambda c: (-remainder[c], c))
    counts[order[:short]] += 1
    return counts


def split(y: np.ndarray, n_test: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Seeded stratified split: sorted row indices of the training and the test part."""
    classes = np.unique(y)
    sizes = np.array([(y == c).sum() for c in classes])
    counts = test_counts(sizes, n_test)
    rng = np.random.default_rng(seed)
    test_rows = []
    for c, t in zip(classes, counts, strict=True):
        rows = np.flatnonzero(y == c)
        test_rows.append(rng.permutation(rows)[:t])
    test_idx = np.sort(np.concatenate(test_rows))
    train_idx = np.setdiff1d(np.arange(len(y)), test_idx)
    return train_idx, test_idx


def build() -> bytes:
    """The bytes of ``digits.npz``."""
    bunch = load_digits()
    x = bunch.data.astype(np.int64)
    y = bunch.target.astype(np.int64)
    assert x.shape == (1797, 64) and x.min() == 0 and x.max() == 16
    assert np.array_equal(bunch.data, x)  # counts stored as floats: no rounding happened
    train_idx, test_idx = split(y, N_TEST, SEED)
    images = x.astype(np.uint8).reshape(-1, 1, 8, 8)
    labels = y.astype(np.uint8)
    arrays = {
        "x_train": images[train_idx],
        "y_train": labels[train_idx],
        "x_test": images[test_idx],
        "y_test": labels[test_idx],
        "idx_train": train_idx.astype(np.uint16),
        "idx_test": test_idx.astype(np.uint16),
    }
    # np.savez_compressed stamps entries with the current time; write the same
    # .npz layout (one .npy per key in a deflated zip) with a fixed date instead.
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for key, arr in arrays.items():
            info = zipfile.ZipInfo(key + ".npy", date_time=ZIP_DATE)
            info.compress_type = zipfile.ZIP_DEFLATED
            npy = io.BytesIO()
            np.lib.format.write_array(npy, np.ascontiguousarray(arr), allow_pickle=False)
            zf.writestr(info, npy.getvalue(), compresslevel=9)
    return buf.getvalue()


def main(argv: list[str] | None = None) -> int:
    """Write (or with ``--check``, verify) ``data/digits.npz``; print its size and SHA-256."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the existing file")
    args = parser.parse_args(argv)
    data = build()
    digest = hashlib.sha256(data).hexdigest()
    if args.check:
        same = OUT.is_file() and OUT.read_bytes() == data
        print(f"{OUT}: {'matches' if same else 'DIFFERS from'} a fresh build (sha256 {digest})")
        return 0 if same else 1
    OUT.write_bytes(data)
    print(f"wrote {OUT} ({len(data)} bytes), sha256 {digest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
