"""Synthetic data of any shape and class count, labelled by a fixed random linear teacher."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from hpcdl.data.dataset import Dataset
from hpcdl.errors import DataError
from hpcdl.rng import generator

__all__ = ["synthetic"]


def _part(
    seed: int, part: str, n: int, shape: tuple[int, ...], teacher: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    x = generator(seed, "synthetic", part).standard_normal((n, *shape), dtype=np.float32)
    y = np.argmax(x.reshape(n, -1) @ teacher, axis=1).astype(np.int64)  # N,D @ D,K -> N,K -> N
    return x, y


def synthetic(
    shape: Sequence[int] = (1, 28, 28),
    num_classes: int = 10,
    train_size: int = 4096,
    test_size: int = 1024,
    seed: int = 0,
) -> Dataset:
    """A learnable synthetic data set for throughput runs.

    Inputs are standard normal float32; the label of ``x`` is ``argmax(W^T x)`` for a
    teacher matrix ``W`` (D x num_classes, standard normal) drawn from
    ``generator(seed, "synthetic", "teacher")``, so a linear model can reach 100 %
    accuracy. Training and test inputs come from separate streams
    (``generator(seed, "synthetic", "train" | "test")``): changing one size leaves the
    other part unchanged. The result depends only on the arguments.

    Args:
        shape: Per-sample shape, N,C,H,W layout for images (``(1, 28, 28)``) or any other.
        num_classes: Number of classes (at least 2).
        train_size: Number of training samples.
        test_size: Number of test samples.
        seed: The run's seed.

    Returns:
        A `Dataset` named ``"synthetic"``.

    Raises:
        DataError: A size or the class count is out of range.
    """
    shape = tuple(int(d) for d in shape)
    if not shape or any(d < 1 for d in shape):
        raise DataError(f"synthetic data: shape must be non-empty with positive sizes (got {shape})")
    if num_classes < 2:
        raise DataError(f"synthetic data: num_classes must be at least 2 ({num_classes} < 2)")
    if train_size < 1 or test_size < 0:
        raise DataError(
            f"synthetic data: train_size must be positive and test_size non-negative "
            f"(got {train_size} and {test_size})"
        )
    teacher = generator(seed, "synthetic", "teacher").standard_normal(
        (math.prod(shape), num_classes), dtype=np.float32
    )
    x_train, y_train = _part(seed, "train", train_size, shape, teacher)
    x_test, y_test = _part(seed, "test", test_size, shape, teacher)
    return Dataset(
        x_train=x_train,
        y_train=y_train,
        x_test=x_test,
        y_test=y_test,
        name="synthetic",
        input_shape=shape,
        num_classes=num_classes,
    )
