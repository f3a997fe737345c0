"""What the steps of every strategy share: the forward and backward of a batch, and the metrics
of the steps since a meeting averaged over the ranks that contributed to them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from hpcdl import comm as ops  # ops.SUM resolved at use: importing this module starts no MPI
from hpcdl.backend import to_numpy
from hpcdl.comm import Communicator
from hpcdl.nn import Sequential, SoftmaxCrossEntropy
from hpcdl.parallel.strategy import Agreement, StepStats

__all__ = ["forward_backward", "mean_over_contributors"]


def forward_backward(model: Sequential, loss_fn: SoftmaxCrossEntropy, x: Any, y: Any) -> tuple[float, int]:
    """Forward, loss, backward; the local loss and the number of correct predictions."""
    logits = model.forward(x)
    loss = loss_fn.forward(logits, y)
    correct = int(to_numpy(logits.argmax(axis=1) == y).sum())
    model.backward(loss_fn.backward())
    return float(loss), correct


def mean_over_contributors(
    comm: Communicator, stats: Sequence[StepStats], stop: bool, buf: np.ndarray | None = None
) -> Agreement:
    """Per step, the mean loss over the ranks that contributed a loss (trained on samples in it) and
    the accuracy over all their samples; and the stop.

    A rank contributes to a step when it trained on samples in it (``samples > 0``): every
    member under sync data parallel, the last stage of a pipeline, the workers but not the
    keeper of the toy strategy — and, when ranks drop out, only those that stayed. The mean
    divides by them, not by a width fixed in advance. One ``Allreduce`` of ``[loss, correct,
    samples, contributed] x steps + [stop]``: the stop votes travel with the metrics, so
    agreeing on a stop costs nothing extra (a sum > 0 is the MAX of the flags > 0).

    Args:
        comm: every rank of the world (collective).
        stats: this rank's steps since the last meeting (the same number on every rank).
        stop: this rank asks to stop.
        buf: scratch of at least ``2 (4 k + 1)`` doubles, reused across calls.

    Returns:
        The rows (``loss``, ``train_accuracy``; NaN for a step nobody trained in) and the stop
        votes, the same on every rank.
    """
    k = len(stats)
    n = 4 * k + 1
    if buf is None or buf.size < 2 * n:
        buf = np.zeros(2 * n)
    mine, total = buf[:n], buf[n : 2 * n]
    for i, s in enumerate(stats):
        member = s.samples > 0
        mine[4 * i : 4 * i + 4] = (s.loss if member else 0.0, s.correct, s.samples, float(member))
    mine[-1] = float(stop)
    if comm.Get_size() == 1:
        total[:] = mine
    else:
        comm.Allreduce(mine, total, op=ops.SUM)
    rows = []
    for i in range(k):
        loss, correct, samples, contributed = total[4 * i : 4 * i + 4]
        rows.append({
            "loss": float(loss) / int(contributed) if contributed else float("nan"),
            "train_accuracy": float(correct / samples) if samples else float("nan"),
        })  # fmt: skip
    return Agreement(rows=rows, stop_votes=int(total[-1]))
