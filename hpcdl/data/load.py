"""``load_dataset``: one entry point for every data set, with a per-process read-only cache."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from pathlib import Path

from hpcdl.data.arrays import load_hdf5, load_npz
from hpcdl.data.cifar import load_cifar10
from hpcdl.data.dataset import Dataset
from hpcdl.data.digits import find_digits, load_digits
from hpcdl.data.idx import load_mnist
from hpcdl.data.synthetic import synthetic
from hpcdl.errors import DataError

__all__ = ["load_dataset", "clear_cache", "DATASETS"]

_READERS: dict[str, Callable[[Path | None, int], Dataset]] = {
    "digits": load_digits,
    "mnist": lambda p, c: load_mnist(p, "mnist", c),
    "fashion-mnist": lambda p, c: load_mnist(p, "fashion-mnist", c),
    "cifar10": load_cifar10,
    "npz": load_npz,
    "hdf5": load_hdf5,
}
DATASETS: tuple[str, ...] = (*_READERS, "synthetic")
"""The names `load_dataset` accepts."""

_NEEDS_PATH = {"npz": "the .npz file", "hdf5": "the HDF5 file"}

#: the class count of ``"synthetic"`` data when none is asked for (``num_classes = 0``)
SYNTHETIC_CLASSES = 10


def load_dataset(
    name: str,
    path: str | None = None,
    *,
    seed: int,
    shape: Sequence[int] = (1, 28, 28),
    num_classes: int = 0,
    train_size: int = 4096,
    test_size: int = 1024,
) -> Dataset:
    """Load a data set by name, sharing one read-only copy per process.

    Results are cached (``functools.lru_cache``, the last 8 data sets) by the name, the
    file or directory resolved from ``path`` and the class count; for ``"synthetic"`` by
    the generator arguments instead. Every simulated rank of a process that asks for the same data set
    thus gets the same `Dataset` object, whose arrays are read-only. The cache is the
    package's only module-level state; `clear_cache` empties it. Files changed on disk
    during the process are not noticed.

    Args:
        name: One of `DATASETS`: ``"digits"`` (bundled), ``"mnist"``, ``"fashion-mnist"``,
            ``"cifar10"`` (a directory), ``"npz"``, ``"hdf5"`` (a file), ``"synthetic"``.
        path: The file or directory to read; optional for ``"digits"`` (see
            `hpcdl.data.digits.find_digits`), ignored for ``"synthetic"``.
        seed: The run's seed (used by ``"synthetic"`` only; the readers are deterministic).
        shape: Per-sample shape of ``"synthetic"`` data.
        num_classes: The class count (``data.num_classes``): every label must lie in
            ``0 .. num_classes - 1``. 0: the data set's own: inferred from the labels of
            ``"npz"``/``"hdf5"`` files (every class below the largest label must occur),
            10 for the others. Data sets with a fixed count (digits, MNIST, CIFAR-10)
            accept only that count or 0.
        train_size: Training samples of ``"synthetic"`` data.
        test_size: Test samples of ``"synthetic"`` data.

    Returns:
        The `Dataset`.

    Raises:
        DataError: ``name`` is unknown (the message lists the valid names), a required
            path is missing, the files are missing or malformed, or the labels do not fit
            the class count (the message names the file, the labels found and the range
            expected).
    """
    if name == "synthetic":
        classes = int(num_classes) or SYNTHETIC_CLASSES
        params = (int(seed), tuple(int(d) for d in shape), classes, int(train_size), int(test_size))
        return _synthetic_cached(*params)
    if name not in _READERS:
        raise DataError(f"unknown data set {name!r}: data.name must be one of {', '.join(DATASETS)}")
    if name == "digits":
        resolved = find_digits(path)
    elif path is None:
        what = _NEEDS_PATH.get(name, "the directory of its files")
        raise DataError(f"data set {name!r} needs data.path: {what}")
    else:
        resolved = Path(path).expanduser().resolve()
    return _load_cached(name, resolved, int(num_classes))


@functools.lru_cache(maxsize=8)
def _load_cached(name: str, resolved: Path, num_classes: int) -> Dataset:
    return _READERS[name](resolved, num_classes)


@functools.lru_cache(maxsize=8)
def _synthetic_cached(
    seed: int, shape: tuple[int, ...], num_classes: int, train_size: int, test_size: int
) -> Dataset:
    return synthetic(shape, num_classes, train_size, test_size, seed)


def clear_cache() -> None:
    """Forget the cached data sets (their memory is freed once no rank holds them)."""
    _load_cached.cache_clear()
    _synthetic_cached.cache_clear()
