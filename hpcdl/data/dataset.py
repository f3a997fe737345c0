"""The ``Dataset`` record every reader returns: read-only train and test arrays."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hpcdl.errors import DataError

__all__ = ["Dataset"]


@dataclass(frozen=True, eq=False)
class Dataset:
    """A labelled data set split into a training and a test part, held in host memory.

    Images are float32 in layout N,C,H,W (scaled to [0, 1] for the image readers);
    labels are int64 class numbers in ``0 .. num_classes - 1``. The arrays are marked
    read-only on construction (``flags.writeable = False``), so one copy can be shared by
    every simulated rank of a process; a model that needs flat input flattens itself.

    Attributes:
        x_train: Training inputs, shape ``(n_train, *input_shape)``.
        y_train: Training labels, shape ``(n_train,)``.
        x_test: Test inputs, shape ``(n_test, *input_shape)``.
        y_test: Test labels, shape ``(n_test,)``.
        name: A short name for logs and the run file (``"digits"``, ``"mnist"``, ...).
        input_shape: Per-sample shape, such as ``(1, 8, 8)``.
        num_classes: Number of classes.
    """

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    name: str
    input_shape: tuple[int, ...]
    num_classes: int

    def __post_init__(self) -> None:
        for part in ("train", "test"):
            x, y = getattr(self, f"x_{part}"), getattr(self, f"y_{part}")
            if x.shape[1:] != tuple(self.input_shape):
                raise DataError(
                    f"{self.name}: x_{part} has samples of shape {x.shape[1:]}, "
                    f"expected {tuple(self.input_shape)}"
                )
            if y.ndim != 1 or len(y) != len(x):
                raise DataError(
                    f"{self.name}: y_{part} has shape {y.shape}, expected ({len(x)},) "
                    f"(one label per sample of x_{part})"
                )
            if len(y) and (y.min() < 0 or y.max() >= self.num_classes):
                raise DataError(
                    f"{self.name}: y_{part} has labels in {int(y.min())}..{int(y.max())}, "
                    f"expected 0..{self.num_classes - 1}"
                )
            x.flags.writeable = False
            y.flags.writeable = False

    @property
    def train_size(self) -> int:
        """Number of training samples."""
        return len(self.y_train)

    @property
    def test_size(self) -> int:
        """Number of test samples."""
        return len(self.y_test)

    def __repr__(self) -> str:
        return (
            f"Dataset(name={self.name!r}, train_size={self.train_size}, test_size={self.test_size}, "
            f"input_shape={tuple(self.input_shape)}, num_classes={self.num_classes})"
        )


def scaled(x: np.ndarray, scale: float) -> np.ndarray:
    """``x`` as float32 divided by ``scale`` (a new array)."""
    out = x.astype(np.float32)
    out /= np.float32(scale)
    return out


def labels(y: np.ndarray) -> np.ndarray:
    """``y`` as int64 class numbers."""
    return y.astype(np.int64)
