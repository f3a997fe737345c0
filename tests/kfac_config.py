"""The small float64 K-FAC run the distributed K-FAC tests share (under mpiexec and simulated)."""

from __future__ import annotations

from typing import Any

import numpy as np

#: digits-mlp, float64, a small MLP (no dropout, no BatchNorm), K-FAC decomposing every other step
COMMON = [
    "dtype=float64", "model.depth=3", "model.width=24", "data.batch_size=8", "optimizer.name=kfac",
    "optimizer.lr=0.05", "schedule.name=constant", "schedule.warmup_epochs=0", "checkpoint.every=0",
    "kfac.inv_every=2", "train.steps=5", "train.eval_every=5",
]  # fmt: skip


def flat(result: Any) -> np.ndarray:
    """A run's parameters, in the model's order, as one vector."""
    return np.concatenate([np.asarray(p.data).ravel() for p in result.strategy.model.parameters()])
