"""Optimizers (SGD, Adam, AdamW, K-FAC), learning-rate schedules and rank scaling."""

from __future__ import annotations

from hpcdl.components import Declares, Key
from hpcdl.optim.adam import Adam, AdamW
from hpcdl.optim.kfac import KFAC
from hpcdl.optim.optimizer import Optimizer
from hpcdl.optim.schedule import Schedule, scaled_lr
from hpcdl.optim.sgd import SGD

__all__ = [
    "DECLARES", "ELEMENTWISE", "KFAC", "OPTIMIZERS", "SGD", "Adam", "AdamW", "Optimizer", "Schedule",
    "elementwise", "scaled_lr",
]  # fmt: skip

#: ``optimizer.name`` values
OPTIMIZERS = ("sgd", "adam", "adamw", "kfac")
#: the optimizers whose update of a parameter element reads that element's gradient and state
#: only: they can be split into shards of parameters (a parameter server's); K-FAC cannot
ELEMENTWISE = ("sgd", "adam", "adamw")


def elementwise(name: str) -> bool:
    """Whether ``optimizer.name = name`` updates element by element (:data:`ELEMENTWISE`)."""
    return name in ELEMENTWISE


#: the optimizer's and the learning-rate schedule's config sections
DECLARES = Declares(
    keys={
        "optimizer.name": Key(str, "sgd", "optimizer", choices=OPTIMIZERS),
        "optimizer.lr": Key(float, 0.1, "base learning rate (before rank scaling)", minimum=0.0),
        "optimizer.momentum": Key(float, 0.9, "sgd, kfac: momentum", minimum=0.0),
        "optimizer.nesterov": Key(bool, False, "sgd: Nesterov momentum"),
        "optimizer.weight_decay": Key(
            float, 0.0, "L2 (sgd, adam, kfac) or decoupled (adamw) weight decay", minimum=0.0
        ),
        "kfac.damping": Key(float, 1e-3, "kfac: added to every product of eigenvalues", above=0.0),
        "kfac.factor_decay": Key(
            float,
            0.95,
            "kfac: running-average decay of the factors (0: the last batch's)",
            minimum=0.0,
            below=1.0,
        ),
        "kfac.factor_every": Key(int, 1, "kfac: collect the factors every this many steps", minimum=1),
        "kfac.inv_every": Key(
            int,
            10,
            "kfac: eigendecompose the factors every this many steps (>= kfac.factor_every)",
            minimum=1,
        ),
        "kfac.kl_clip": Key(
            float, 1e-3, "kfac: KL clipping of the preconditioned gradients (0: off)", minimum=0.0
        ),
        "kfac.grad_workers": Key(
            int,
            0,
            "kfac: ranks that precondition each layer, dividing N (0: N, eigenbases to every rank; 1: "
            "one rank per layer, its preconditioned gradient broadcast)",
            minimum=0,
        ),
        "kfac.average_factors": Key(
            bool,
            False,
            "kfac under parallel.strategy = 'local': average the running factors in each "
            "round too (false: each rank's own, heterogeneous and outdated)",
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
