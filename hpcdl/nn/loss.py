"""Losses (``SoftmaxCrossEntropy``, ``MSELoss``) and ``accuracy``.

Losses are not layers but follow the same explicit style: ``forward`` returns
the mean loss as a Python float and keeps a cache, ``backward()`` returns the
gradient with respect to the prediction.
"""

from __future__ import annotations

from typing import Any

from hpcdl.backend import get_array_module

__all__ = ["MSELoss", "SoftmaxCrossEntropy", "accuracy"]


class SoftmaxCrossEntropy:
    """Mean cross entropy of integer labels under ``softmax(logits)``.

    The log-softmax subtracts each row's maximum first, so it is stable for
    any logits.
    """

    def __init__(self) -> None:
        self._prob: Any = None  # cache: softmax(logits), N, K
        self._labels: Any = None  # cache: N, int

    def forward(self, logits: Any, labels: Any) -> float:
        """Mean loss over the batch.

        Args:
            logits: ``(N, K)`` scores.
            labels: ``(N,)`` integer classes in ``[0, K)``.

        Returns:
            ``mean(logsumexp(logits) - logits[label])``.

        Raises:
            ValueError: The shapes do not match.
        """
        xp = get_array_module(logits)
        if logits.ndim != 2 or labels.shape != (logits.shape[0],):
            raise ValueError(
                f"SoftmaxCrossEntropy: logits {tuple(logits.shape)} must be (N, K) and labels "
                f"{tuple(labels.shape)} must be (N,)"
            )
        n = logits.shape[0]
        rows = xp.arange(n)  # N
        z = logits - logits.max(axis=1, keepdims=True)  # N, K
        e = xp.exp(z)  # N, K
        s = e.sum(axis=1, keepdims=True)  # N, 1
        loss = (xp.log(s[:, 0]) - z[rows, labels]).mean()  # scalar
        e /= s  # N, K (softmax)
        self._prob, self._labels = e, labels
        return float(loss)

    def backward(self) -> Any:
        """Gradient of the mean loss with respect to the logits, ``(N, K)``.

        Raises:
            RuntimeError: Called before ``forward``.
        """
        if self._prob is None:
            raise RuntimeError("SoftmaxCrossEntropy: backward called before forward")
        xp = get_array_module(self._prob)
        n = self._prob.shape[0]
        inv_n = self._prob.dtype.type(1.0 / n)
        g = self._prob * inv_n  # N, K
        g[xp.arange(n), self._labels] -= inv_n  # N, K
        return g


class MSELoss:
    """Mean squared error over all elements (PyTorch's ``reduction="mean"``)."""

    def __init__(self) -> None:
        self._diff: Any = None  # cache: pred - target, same shape as pred

    def forward(self, pred: Any, target: Any) -> float:
        """Mean of ``(pred - target) ** 2``.

        Raises:
            ValueError: The shapes differ.
        """
        if tuple(pred.shape) != tuple(target.shape):
            raise ValueError(f"MSELoss: pred {tuple(pred.shape)} and target {tuple(target.shape)} differ")
        diff = pred - target  # same shape as pred
        self._diff = diff
        return float((diff * diff).mean())

    def backward(self) -> Any:
        """Gradient of the mean loss with respect to ``pred``.

        Raises:
            RuntimeError: Called before ``forward``.
        """
        if self._diff is None:
            raise RuntimeError("MSELoss: backward called before forward")
        return self._diff * self._diff.dtype.type(2.0 / self._diff.size)  # same shape as pred


def accuracy(logits: Any, labels: Any) -> float:
    """Fraction of rows whose largest logit is at the label."""
    return float((logits.argmax(axis=1) == labels).mean())
