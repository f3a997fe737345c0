"""The parameter-server tests' config (not shipped): a small MLP in float64, a constant learning rate.

Shared by ``test_ps.py`` (the simulator) and ``test_ps_mpi.py`` (mpiexec): a constant
schedule without scaling keeps the parameter-server modes on the trajectory of their
simpler equivalents (single-process training, sync data parallel), whose epochs count
other steps.
"""

from __future__ import annotations

from typing import Any

from hpcdl.config import load_config

COMMON = [
    "dtype=float64", "model.depth=2", "model.width=32", "data.batch_size=16", "optimizer.lr=0.05",
    "optimizer.momentum=0.9", "schedule.scale=none", "schedule.name=constant", "schedule.warmup_epochs=0",
    "checkpoint.every=0", "parallel.strategy=ps",
]  # fmt: skip


def cfg(*sets: str) -> Any:
    """digits-mlp with :data:`COMMON`, then ``sets`` (``key=value``)."""
    return load_config("digits-mlp", [*COMMON, *sets])
