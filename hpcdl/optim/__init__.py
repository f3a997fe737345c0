"""Optimizers (SGD, Adam, AdamW), learning-rate schedules and rank scaling."""

from __future__ import annotations

from hpcdl.optim.adam import Adam, AdamW
from hpcdl.optim.optimizer import Optimizer
from hpcdl.optim.schedule import Schedule, scaled_lr
from hpcdl.optim.sgd import SGD

__all__ = ["SGD", "Adam", "AdamW", "Optimizer", "Schedule", "scaled_lr"]
