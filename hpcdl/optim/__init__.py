"""Optimizers (SGD, Adam, AdamW), learning-rate schedules and rank scaling."""

from __future__ import annotations

from hpcdl.components import Declares, Key
from hpcdl.optim.adam import Adam, AdamW
from hpcdl.optim.optimizer import Optimizer
from hpcdl.optim.schedule import Schedule, scaled_lr
from hpcdl.optim.sgd import SGD

__all__ = ["DECLARES", "OPTIMIZERS", "SGD", "Adam", "AdamW", "Optimizer", "Schedule", "scaled_lr"]

#: ``optimizer.name`` values
OPTIMIZERS = ("sgd", "adam", "adamw")

#: the optimizer's and the learning-rate schedule's config sections
DECLARES = Declares(
    keys={
        "optimizer.name": Key(str, "sgd", "optimizer", choices=OPTIMIZERS),
        "optimizer.lr": Key(float, 0.1, "base learning rate (before rank scaling)", minimum=0.0),
        "optimizer.momentum": Key(float, 0.9, "sgd: momentum", minimum=0.0),
        "optimizer.nesterov": Key(bool, False, "sgd: Nesterov momentum"),
        "optimizer.weight_decay": Key(
            float, 0.0, "L2 (sgd, adam) or decoupled (adamw) weight decay", minimum=0.0
        ),
        "optimizer.beta1": Key(float, 0.9, "adam: first-moment decay", minimum=0.0, below=1.0),
        "optimizer.beta2": Key(float, 0.999, "adam: second-moment decay", minimum=0.0, below=1.0),
        "optimizer.eps": Key(float, 1e-8, "adam: denominator epsilon", above=0.0),
        "schedule.name": Key(
            str, "constant", "LR schedule after warm-up", choices=("constant", "step", "cosine")
        ),
        "schedule.warmup_epochs": Key(
            float, 0.0, "linear warm-up from lr/ranks-scale to the scaled lr", minimum=0.0
        ),
        "schedule.step_epochs": Key(float, 30.0, "step: epochs between decays", above=0.0),
        "schedule.gamma": Key(float, 0.1, "step: decay factor", above=0.0),
        "schedule.min_lr": Key(float, 0.0, "cosine: final learning rate", minimum=0.0),
        "schedule.scale": Key(
            str,
            "none",
            "scale lr with the rank count N: none, linear (x N) or sqrt (x sqrt N)",
            choices=("none", "linear", "sqrt"),
        ),
    },
)
