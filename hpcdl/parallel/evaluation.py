"""Evaluation on the test set, once for every strategy: the test batches and their tally.

Every evaluator of hpcdl — the driver's sharded one (:meth:`RunContext.evaluate`), a
parameter server's in parts between messages, a pipeline's through its stages — takes the
test images in batches of :data:`EVAL_BATCH` (:func:`test_batches`) and sums the correct
answers and the loss with a :class:`Tally`, so that their figures are computed alike.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from hpcdl.backend import to_numpy
from hpcdl.nn import SoftmaxCrossEntropy

__all__ = ["EVAL_BATCH", "Tally", "test_batches"]

#: the most test images one evaluation runs through a model at once (a memory estimate's too)
EVAL_BATCH = 512


def test_batches(images: int, rank: int = 0, size: int = 1, batch: int = EVAL_BATCH) -> Iterator[np.ndarray]:
    """The test images ``rank, rank + size, ...`` of ``images``, ``batch`` at a time (indices)."""
    idx = np.arange(rank, images, size)
    for start in range(0, len(idx), batch):
        yield idx[start : start + batch]


@dataclass
class Tally:
    """Correct answers and the loss summed over the test batches seen so far."""

    correct: int = 0
    loss_sum: float = 0.0
    images: int = 0

    def __post_init__(self) -> None:
        self._loss = SoftmaxCrossEntropy()

    def add(self, logits: Any, labels: Any) -> None:
        """One batch's ``logits`` and ``labels`` (the loss is the batch mean: weighted by its size)."""
        count = len(labels)
        self.loss_sum += self._loss.forward(logits, labels) * count
        self.correct += int(to_numpy(logits.argmax(axis=1) == labels).sum())
        self.images += count

    def counts(self) -> np.ndarray:
        """``[correct, loss sum, images]``: what ranks sum to pool their shares."""
        return np.array([self.correct, self.loss_sum, self.images])

    def result(self) -> tuple[float, float]:
        """Test accuracy and mean loss."""
        return float(self.correct / max(1, self.images)), float(self.loss_sum / max(1, self.images))
