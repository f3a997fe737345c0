"""Plans of the pipeline strategy, as pure functions: schedules, their timing, partitions.

DESIGN.md's "plans are data" (torchgpipe's ``clock_cycles``): nothing here runs a model or
communicates. Each function is tested against literal tables.

* **Schedules.** A schedule gives each stage its ordered operations on microbatches:
  ``F k`` (forward of microbatch k) and ``B k`` (its backward). The executor runs a
  stage's list in order, receiving a forward's input from the previous stage and a
  backward's output gradient from the next one.

  - GPipe (Huang et al. 2019): every forward, then every backward in reverse order.
  - 1F1B (PipeDream-Flush, Narayanan et al. 2021): stage s of p runs ``p - s - 1``
    forwards to fill the pipe, then alternates one forward and one backward, then drains
    the backwards. The bubble is GPipe's, but a stage holds at most ``p - s``
    microbatches' activations at once, not m.

* **Timing** (:func:`simulate`): when each operation starts and ends, given per-stage
  forward and backward costs, with a forward of k on stage s after the forward of k on
  s - 1 and a backward of k on s after the backward of k on s + 1 (and after its own
  forward). With equal costs GPipe's and 1F1B's bubble fraction is
  ``(p - 1) / (m + p - 1)``.

* **Partitions** (:func:`balance_by_cost`): the contiguous cut of n layers into p stages
  that minimises the most expensive stage, exactly (dynamic programming over prefix
  sums).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hpcdl.errors import ConfigError

__all__ = [
    "Op",
    "Schedule",
    "Timeline",
    "balance_by_cost",
    "bubble_fraction",
    "gpipe",
    "one_f_one_b",
    "schedule",
    "simulate",
]


@dataclass(frozen=True)
class Op:
    """One operation of a stage: ``kind`` ``"F"`` (forward) or ``"B"`` (backward) of ``microbatch``."""

    kind: str
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}"


@dataclass(frozen=True)
class Schedule:
    """Each stage's ordered operations (``stages[s]``) for ``microbatches`` microbatches."""

    name: str
    microbatches: int
    stages: tuple[tuple[Op, ...], ...]

    def in_flight(self) -> list[int]:
        """Per stage, the most microbatches whose forward ran and whose backward did not yet."""
        peaks = []
        for ops in self.stages:
            held = peak = 0
            for op in ops:
                held += 1 if op.kind == "F" else -1
                peak = max(peak, held)
            peaks.append(peak)
        return peaks

    def __str__(self) -> str:
        """One line per stage, operations in columns (``--plan``)."""
        width = max(len(str(op)) for ops in self.stages for op in ops)
        return "\n".join(
            f"stage {s}: " + " ".join(f"{op!s:<{width}}" for op in ops).rstrip()
            for s, ops in enumerate(self.stages)
        )


def _check(stages: int, microbatches: int) -> None:
    if stages < 1 or microbatches < 1:
        raise ConfigError(
            f"a pipeline needs at least 1 stage and 1 microbatch (got {stages} stages, "
            f"{microbatches} microbatches)"
        )


def gpipe(stages: int, microbatches: int) -> Schedule:
    """GPipe: on every stage all m forwards in order, then the m backwards in reverse order."""
    _check(stages, microbatches)
    m = microbatches
    ops = tuple(Op("F", k) for k in range(m)) + tuple(Op("B", k) for k in reversed(range(m)))
    return Schedule("gpipe", m, tuple(ops for _ in range(stages)))


def one_f_one_b(stages: int, microbatches: int) -> Schedule:
    """1F1B: stage s runs ``min(p - s - 1, m)`` warm-up forwards, then one forward and one
    backward at a time, then the remaining backwards (microbatches in order throughout)."""
    _check(stages, microbatches)
    p, m = stages, microbatches
    plan = []
    for s in range(p):
        warm = min(p - s - 1, m)
        ops = [Op("F", k) for k in range(warm)]
        f, b = warm, 0
        while f < m:
            ops += [Op("F", f), Op("B", b)]
            f, b = f + 1, b + 1
        ops += [Op("B", k) for k in range(b, m)]
        plan.append(tuple(ops))
    return Schedule("1f1b", m, tuple(plan))


def schedule(name: str, stages: int, microbatches: int) -> Schedule:
    """The schedule ``name`` (``pipeline.schedule``): ``gpipe`` or ``1f1b``.

    Raises:
        ConfigError: an unknown name, or fewer than one stage or microbatch.
    """
    makers = {"gpipe": gpipe, "1f1b": one_f_one_b}
    if name not in makers:
        raise ConfigError(f"pipeline.schedule = {name!r} is not a schedule; schedules: {', '.join(makers)}")
    return makers[name](stages, microbatches)


@dataclass(frozen=True)
class Timeline:
    """When each operation ran: ``start[s][i]``/``end[s][i]`` of ``schedule.stages[s][i]``."""

    schedule: Schedule
    start: tuple[tuple[float, ...], ...]
    end: tuple[tuple[float, ...], ...]

    @property
    def makespan(self) -> float:
        """The step's length: the last operation's end."""
        return max(max(e) for e in self.end)

    def busy(self, stage: int) -> float:
        """Time ``stage`` spent computing."""
        return sum(e - s for s, e in zip(self.start[stage], self.end[stage]))

    def bubble(self, stage: int) -> float:
        """The idle fraction of ``stage`` over the step: ``1 - busy / makespan``."""
        return 1.0 - self.busy(stage) / self.makespan


def simulate(
    plan: Schedule, forward: Sequence[float], backward: Sequence[float], transfer: float = 0.0
) -> Timeline:
    """Run ``plan`` in time: each stage executes its operations in order, each as soon as
    its inputs are there.

    Args:
        plan: the schedule.
        forward: per stage, a forward's cost (one microbatch).
        backward: per stage, a backward's cost.
        transfer: the time an activation or its gradient takes to reach the neighbour.

    Raises:
        ValueError: the costs do not give one value per stage, or the schedule deadlocks
            (an operation waits for one that waits for it).
    """
    p = len(plan.stages)
    if len(forward) != p or len(backward) != p:
        raise ValueError(f"costs for {len(forward)}/{len(backward)} stages, the schedule has {p}")
    done: dict[tuple[str, int, int], float] = {}  # (kind, stage, microbatch) -> end
    nxt = [0] * p
    clock = [0.0] * p
    start: list[list[float]] = [[] for _ in range(p)]
    end: list[list[float]] = [[] for _ in range(p)]
    remaining = sum(len(ops) for ops in plan.stages)
    while remaining:
        progressed = False
        for s in range(p):
            while nxt[s] < len(plan.stages[s]):
                op = plan.stages[s][nxt[s]]
                k = op.microbatch
                if op.kind == "F":
                    deps = [("F", s - 1, k)] if s > 0 else []
                    cost = forward[s]
                else:
                    deps = [("F", s, k)] + ([("B", s + 1, k)] if s < p - 1 else [])
                    cost = backward[s]
                if any(d not in done for d in deps):
                    break
                ready = max([clock[s], *(done[d] + (transfer if d[1] != s else 0.0) for d in deps)])
                start[s].append(ready)
                clock[s] = ready + cost
                end[s].append(clock[s])
                done[(op.kind, s, k)] = clock[s]
                nxt[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {s: str(plan.stages[s][nxt[s]]) for s in range(p) if nxt[s] < len(plan.stages[s])}
            raise ValueError(f"schedule {plan.name} deadlocks: stages wait at {stuck}")
    return Timeline(plan, tuple(map(tuple, start)), tuple(map(tuple, end)))


def bubble_fraction(stages: int, microbatches: int) -> float:
    """GPipe's (and 1F1B's) idle fraction with equal stage costs: ``(p - 1) / (m + p - 1)``."""
    return (stages - 1) / (microbatches + stages - 1)


def balance_by_cost(costs: Sequence[float], stages: int) -> list[int]:
    """The contiguous partition of layers with ``costs`` into ``stages`` non-empty stages that
    minimises the most expensive stage (torchgpipe's ``balance``: layers per stage).

    Exact: ``best[j][i]`` is the least possible maximum for the first i layers in j stages,
    over the last cut; O(p n^2). Among cuts with the same maximum the earliest is kept at
    each step, so the result is deterministic.

    Raises:
        ConfigError: more stages than layers, fewer than one stage, or a negative cost.
    """
    n = len(costs)
    if stages < 1 or stages > n:
        raise ConfigError(f"{stages} pipeline stages for {n} layers: every stage needs at least one layer")
    if any(c < 0 for c in costs):
        raise ConfigError("a layer's cost is negative: check the profile")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for j in range(1, stages + 1):
        for i in range(j, n - (stages - j) + 1):
            for c in range(j - 1, i):  # the last stage holds layers c .. i-1
                value = max(best[j - 1][c], prefix[i] - prefix[c])
                if value < best[j][i]:
                    best[j][i], cut[j][i] = value, c
    sizes, i = [], n
    for j in range(stages, 0, -1):
        c = cut[j][i]
        sizes.append(i - c)
        i = c
    return sizes[::-1]
