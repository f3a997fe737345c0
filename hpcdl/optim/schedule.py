"""Learning-rate schedules (pure functions of the step) and scaling with the rank count."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Schedule", "scaled_lr"]


def scaled_lr(lr: float, ranks: int, rule: str) -> float:
    """The base learning rate adapted to ``ranks`` data-parallel ranks.

    ``linear`` multiplies by N (Goyal et al., 2017), ``sqrt`` by sqrt(N)
    (Krizhevsky, 2014), ``none`` leaves it.
    """
    if rule == "none":
        return lr
    if rule == "linear":
        return lr * ranks
    if rule == "sqrt":
        return lr * math.sqrt(ranks)
    raise ValueError(f"LR scaling rule must be none, linear or sqrt (got {rule!r})")


@dataclass(frozen=True)
class Schedule:
    """``lr(step)``: linear warm-up, then constant, step decay or cosine decay.

    Warm-up rises linearly over ``warmup_steps`` from ``start_lr`` to ``peak_lr``
    (with rank scaling, ``start_lr`` is the unscaled lr, as in Goyal et al.;
    otherwise ``peak_lr / warmup_steps``). After it, ``step`` multiplies by
    ``gamma`` every ``step_size`` steps and ``cosine`` falls to ``min_lr`` at
    ``total_steps``.
    """

    peak_lr: float
    total_steps: int
    name: str = "constant"
    warmup_steps: int = 0
    start_lr: float | None = None
    step_size: int = 1
    gamma: float = 0.1
    min_lr: float = 0.0

    def __post_init__(self) -> None:
        if self.name not in ("constant", "step", "cosine"):
            raise ValueError(f"schedule must be constant, step or cosine (got {self.name!r})")
        if self.total_steps < 1:
            raise ValueError(f"total_steps must be positive ({self.total_steps} < 1)")

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            start = self.peak_lr / self.warmup_steps if self.start_lr is None else self.start_lr
            return start + (self.peak_lr - start) * step / self.warmup_steps
        t = step - self.warmup_steps
        if self.name == "step":
            return self.peak_lr * self.gamma ** (t // max(1, self.step_size))
        if self.name == "cosine":
            span = max(1, self.total_steps - self.warmup_steps)
            frac = min(1.0, t / span)
            return self.min_lr + 0.5 * (self.peak_lr - self.min_lr) * (1.0 + math.cos(math.pi * frac))
        return self.peak_lr
