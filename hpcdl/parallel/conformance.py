"""What a strategy tells the conformance suite (``tests/strategies/``) about itself: :class:`Conformance`.

The suite is parametrized over every registered strategy (and the tests' toy) and reads
each class's :attr:`~hpcdl.parallel.Strategy.conformance`: a few small runs (:class:`Case`),
the worlds in which each repeats bit for bit after a stop and ``--resume auto``, and the
simpler equivalent run each must agree with. Registering a strategy with this attribute
puts it into the suite; nothing else names it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["WORLDS", "Case", "Conformance", "Reference"]

#: the two worlds a strategy runs in: under mpiexec, and on the simulator's virtual ranks
WORLDS = ("mpi", "sim")

#: ``reference(cfg, world)`` -> ``(settings, ranks)`` of the simpler equivalent run, or None
#: where the strategy has none at that world; ``cfg`` gives a config value by dotted key
Reference = Callable[[Any, int], "tuple[dict[str, Any], int] | None"]


@dataclass(frozen=True)
class Case:
    """One small valid run of a strategy, and what the suite checks of it.

    Attributes:
        sets: dotted config settings (``{"ps.mode": "sync"}``) on top of the suite's base
            config (the ``digits-mlp`` preset in float64, a small MLP, a few steps, a
            checkpoint every few steps, a constant learning rate). ``train.steps`` and
            ``checkpoint.every`` may be set here; the suite stops at the first checkpoint.
        deterministic: the worlds (of :data:`WORLDS`) in which a run stopped at a
            checkpoint and continued with ``--resume auto`` ends with the uninterrupted
            run's checkpoint and non-timing metrics, bit for bit; () for none.
        compute: the simulator's compute model for the case: ``"none"`` (computing costs no
            virtual time) or ``"table"`` (every layer costs the same, from a cost table the
            suite writes: ``--compute table:FILE``).
        reference: the simpler equivalent run (:data:`Reference`): its settings on top of the
            case's and its rank count, for a run of the case on ``world`` ranks. None: no
            reference; the suite skips the agreement check for the case.
        tolerance: the largest difference between the run's final parameters and the
            reference's, relative to the reference's largest magnitude (0: bit for bit).
    """

    sets: Mapping[str, Any] = field(default_factory=dict)
    deterministic: tuple[str, ...] = WORLDS
    compute: str = "none"
    reference: Reference | None = None
    tolerance: float = 0.0

    def __post_init__(self) -> None:
        unknown = sorted(set(self.deterministic) - set(WORLDS))
        if unknown:
            raise ValueError(f"deterministic names {unknown}: the worlds are {list(WORLDS)}")
        if self.compute not in ("none", "table"):
            raise ValueError(f"compute = {self.compute!r}: 'none' or 'table'")
        if self.tolerance < 0:
            raise ValueError(f"tolerance = {self.tolerance}: must be >= 0")


@dataclass(frozen=True)
class Conformance:
    """How the conformance suite exercises a strategy (:attr:`Strategy.conformance`).

    Attributes:
        cases: the strategy's small runs by name (``"sync"``, ``"async"``); the first is its
            main case, whose ``--plan`` and refused resumes the suite checks.
        min_ranks: the fewest ranks a run of the strategy takes (the suite runs each case
            on 2 and 3 ranks, and skips fewer than this).
        parameters: ``parameters(pieces, names)`` -> the model's parameters as one vector
            in the model's order, from a final checkpoint's pieces (piece -> ``params`` ->
            arrays) and the model's parameter names in order. None: the pieces hold the
            parameters under the model's names (a piece may hold some or all of them).
        timing: the strategy's own metric columns and table columns (``"table/column"``)
            that measure time: a resumed run need not repeat them.
    """

    cases: Mapping[str, Case]
    min_ranks: int = 1
    parameters: Callable[[Mapping[str, Any], Sequence[str]], np.ndarray] | None = None
    timing: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.cases:
            raise ValueError("a strategy's conformance declares at least one case")
        if self.min_ranks < 1:
            raise ValueError(f"min_ranks = {self.min_ranks}: must be >= 1")

    @property
    def main(self) -> tuple[str, Case]:
        """The first case, by name."""
        return next(iter(self.cases.items()))
