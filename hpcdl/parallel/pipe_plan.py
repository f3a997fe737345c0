"""Plans of the pipeline strategy, as pure functions: schedules, their timing, partitions.

docs/design.md's "plans are data" (torchgpipe's ``clock_cycles``): nothing here runs a model or
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
    "METHODS",
    "SCHEDULES",
    "LayerInfo",
    "Op",
    "Partition",
    "Schedule",
    "Timeline",
    "balance_by_cost",
    "bubble_fraction",
    "gpipe",
    "interleaved",
    "one_f_one_b",
    "partition",
    "schedule",
    "simulate",
]


@dataclass(frozen=True)
class Op:
    """One operation of a stage: ``kind`` ``"F"`` (forward) or ``"B"`` (backward) of ``microbatch``,
    on the stage's model chunk ``chunk`` (0 unless the schedule is interleaved)."""

    kind: str
    microbatch: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}"


@dataclass(frozen=True)
class Schedule:
    """Each stage's ordered operations (``stages[s]``) for ``microbatches`` microbatches.

    With ``chunks = v > 1`` (interleaved) stage s holds the model chunks of virtual stages
    ``s, s + p, ..., s + (v - 1) p`` (chunk c is virtual stage ``c p + s``), and an
    operation names its chunk.
    """

    name: str
    microbatches: int
    stages: tuple[tuple[Op, ...], ...]
    chunks: int = 1

    def virtual(self, stage: int, chunk: int) -> int:
        """The virtual stage of ``stage``'s chunk ``chunk``: its place in the model's order."""
        return chunk * len(self.stages) + stage

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
        """One line per stage, operations in columns (``--plan``); interleaved: ``F3.1`` is the
        forward of microbatch 3 on chunk 1."""

        def name(op: Op) -> str:
            return f"{op}.{op.chunk}" if self.chunks > 1 else str(op)

        width = max(len(name(op)) for ops in self.stages for op in ops)
        return "\n".join(
            f"stage {s}: " + " ".join(f"{name(op):<{width}}" for op in ops).rstrip()
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


def interleaved(stages: int, microbatches: int, chunks: int) -> Schedule:
    """Interleaved 1F1B (Narayanan et al. 2021, Megatron-LM): each stage holds ``v = chunks``
    model chunks, and the microbatches go through the chunks in groups of p.

    The j-th forward of stage s (0-based, of ``m v``) is of chunk ``(j mod p v) // p`` and
    microbatch ``(j // p v) p + j mod p``; its j-th backward the same with the chunks in
    reverse order. Stage s warms up with ``min(2 (p - s - 1) + (v - 1) p, m v)`` forwards
    (all of them when m = p), then alternates one forward and one backward, then drains.
    With equal stage costs the bubble is ``(p - 1) / (v m + p - 1)``: v times smaller than
    1F1B's in time, for v times as many messages.

    Raises:
        ConfigError: fewer than 2 stages or chunks, or m not a multiple of p.
    """
    _check(stages, microbatches)
    p, m, v = stages, microbatches, chunks
    if p < 2 or v < 2 or m % p:
        raise ConfigError(
            f"the interleaved schedule needs at least 2 stages, pipeline.virtual_stages >= 2 and "
            f"pipeline.microbatches a multiple of the {p} stages (got {v} virtual stages, {m} microbatches)"
        )

    def op(kind: str, j: int) -> Op:
        group, place = divmod(j, p * v)
        chunk = place // p if kind == "F" else v - 1 - place // p
        return Op(kind, group * p + place % p, chunk)

    plan = []
    total = m * v
    for s in range(p):
        warm = total if m == p else min(2 * (p - s - 1) + (v - 1) * p, total)
        ops = [op("F", j) for j in range(warm)]
        for j in range(total - warm):
            ops += [op("F", warm + j), op("B", j)]
        ops += [op("B", j) for j in range(total - warm, total)]
        plan.append(tuple(ops))
    return Schedule("interleaved", m, tuple(plan), v)


#: ``pipeline.schedule`` names
SCHEDULES = ("gpipe", "1f1b", "interleaved")


def schedule(name: str, stages: int, microbatches: int, chunks: int = 1) -> Schedule:
    """The schedule ``name`` (``pipeline.schedule``): ``gpipe``, ``1f1b``, or ``interleaved``
    with ``chunks`` (``pipeline.virtual_stages``) model chunks per stage.

    Raises:
        ConfigError: an unknown name, fewer than one stage or microbatch, chunks given to a
            schedule without them, or an interleaving that does not fit.
    """
    if name not in SCHEDULES:
        raise ConfigError(
            f"pipeline.schedule = {name!r} is not a schedule; schedules: {', '.join(SCHEDULES)}"
        )
    if name == "interleaved":
        return interleaved(stages, microbatches, chunks)
    if chunks != 1:
        raise ConfigError(
            f"pipeline.virtual_stages = {chunks} needs pipeline.schedule = 'interleaved' ({name!r} runs one "
            "chunk per stage)"
        )
    return gpipe(stages, microbatches) if name == "gpipe" else one_f_one_b(stages, microbatches)


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
        forward: per virtual stage (per stage unless interleaved), a forward's cost (one
            microbatch).
        backward: per virtual stage, a backward's cost.
        transfer: the time an activation or its gradient takes to reach another stage.

    Raises:
        ValueError: the costs do not give one value per virtual stage, or the schedule
            deadlocks (an operation waits for one that waits for it).
    """
    p = len(plan.stages)
    n = p * plan.chunks  # virtual stages
    if len(forward) != n or len(backward) != n:
        raise ValueError(f"costs for {len(forward)}/{len(backward)} stages, the schedule has {n}")
    done: dict[tuple[str, int, int], float] = {}  # (kind, virtual stage, microbatch) -> end
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
                k, v = op.microbatch, plan.virtual(s, op.chunk)
                if op.kind == "F":
                    deps = [("F", v - 1, k)] if v > 0 else []
                    cost = forward[v]
                else:
                    deps = [("F", v, k)] + ([("B", v + 1, k)] if v < n - 1 else [])
                    cost = backward[v]
                if any(d not in done for d in deps):
                    break
                ready = max([clock[s], *(done[d] + (transfer if d[1] % p != s else 0.0) for d in deps)])
                start[s].append(ready)
                clock[s] = ready + cost
                end[s].append(clock[s])
                done[(op.kind, v, k)] = clock[s]
                nxt[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {s: str(plan.stages[s][nxt[s]]) for s in range(p) if nxt[s] < len(plan.stages[s])}
            raise ValueError(f"schedule {plan.name} deadlocks: stages wait at {stuck}")
    return Timeline(plan, tuple(map(tuple, start)), tuple(map(tuple, end)))


def bubble_fraction(stages: int, microbatches: int, chunks: int = 1) -> float:
    """GPipe's and 1F1B's idle fraction with equal stage costs, ``(p - 1) / (m + p - 1)``;
    interleaved with v chunks per stage (equal virtual stages), ``(p - 1) / (v m + p - 1)``."""
    return (stages - 1) / (chunks * microbatches + stages - 1)


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


# -- the partition description ---------------------------------------------------------------

#: automatic balance methods: what a layer costs
METHODS = ("uniform", "params", "time", "memory")


@dataclass(frozen=True)
class LayerInfo:
    """What the partitioner knows of one top-level layer (a residual block is one).

    Attributes:
        name: its name in the model (``"3"``, ``"layer2.0"``).
        params: trainable parameters.
        forward_s: profiled forward time (0 when unknown).
        backward_s: profiled backward time.
        output_bytes: bytes of its output (what a stage ending with it sends on).
    """

    name: str
    params: int = 0
    forward_s: float = 0.0
    backward_s: float = 0.0
    output_bytes: int = 0


@dataclass(frozen=True)
class Partition:
    """Which top-level layers each stage holds: ``balance[s]`` of them, in order."""

    layers: tuple[LayerInfo, ...]
    balance: tuple[int, ...]
    method: str

    @property
    def stages(self) -> list[tuple[LayerInfo, ...]]:
        """Each stage's layers."""
        out, start = [], 0
        for n in self.balance:
            out.append(self.layers[start : start + n])
            start += n
        return out

    def table(self) -> str:
        """The partition as ``--plan`` prints it: stage, layers, parameters, times, bytes sent on."""
        lines = [
            f"partition ({self.method}): balance = {list(self.balance)}",
            f"{'stage':<7}{'layers':<24}{'params':>12}{'forward ms':>12}{'backward ms':>13}"
            f"{'sends bytes':>13}",
        ]
        stages = self.stages
        timed = any(x.forward_s or x.backward_s for x in self.layers)  # else "-": not profiled
        for s, layers in enumerate(stages):
            names = layers[0].name if len(layers) == 1 else f"{layers[0].name} .. {layers[-1].name}"
            sent = layers[-1].output_bytes if s < len(stages) - 1 else 0
            fwd = f"{1e3 * sum(x.forward_s for x in layers):>12.3f}" if timed else f"{'-':>12}"
            bwd = f"{1e3 * sum(x.backward_s for x in layers):>13.3f}" if timed else f"{'-':>13}"
            lines.append(f"{s:<7}{names:<24}{sum(x.params for x in layers):>12,}{fwd}{bwd}{sent:>13,}")
        return "\n".join(lines)


def _cost(layer: LayerInfo, method: str) -> float:
    if method == "uniform":
        return 1.0
    if method == "params":
        return float(layer.params)
    if method == "time":
        return layer.forward_s + layer.backward_s
    return float(layer.output_bytes)  # memory: the activations a stage keeps per microbatch


def partition(
    layers: Sequence[LayerInfo],
    stages: int | None = None,
    *,
    balance: Sequence[int] | str | None = None,
    split: Sequence[str] | None = None,
) -> Partition:
    """Cut a model's top-level layers into pipeline stages, as ``[pipeline]`` describes.

    Exactly one of:

    * ``balance = [n1, ..., np]``: top-level layers per stage (torchgpipe's convention);
    * ``split = ["name", ...]``: a new stage starts at each named layer (torch pipelining's
      split points), so there are ``len(split) + 1`` stages;
    * ``balance = "uniform" | "params" | "time" | "memory"`` with ``stages``: the
      contiguous cut that minimises the most expensive stage, layers costing 1, their
      parameters, their profiled forward + backward time, or their output bytes
      (:func:`balance_by_cost`).

    Raises:
        ConfigError: one line naming what does not fit: counts that do not sum to the
            layers, an empty stage, an unknown or repeated or out-of-order split name, a
            first layer as a split point, more stages than layers, an unknown method, a
            ``time`` balance without a profile, or a stage count that disagrees.
    """
    layers = tuple(layers)
    n = len(layers)
    if (balance is None) == (split is None):
        raise ConfigError("describe the partition by pipeline.balance or by pipeline.split (one of them)")
    if split is not None:
        index = {layer.name: i for i, layer in enumerate(layers)}
        unknown = [name for name in split if name not in index]
        if unknown:
            raise ConfigError(
                f"pipeline.split names {unknown[0]!r}, not a top-level layer of the model; layers: "
                + ", ".join(x.name for x in layers[:12])
                + (" ..." if n > 12 else "")
            )
        starts = [index[name] for name in split]
        if starts != sorted(set(starts)) or (starts and starts[0] == 0):
            raise ConfigError(
                f"pipeline.split = {list(split)}: the names must follow the model's order, once each, "
                "and not name its first layer (where stage 0 starts anyway)"
            )
        bounds = [0, *starts, n]
        sizes = [b - a for a, b in zip(bounds, bounds[1:])]
        return _fitting(layers, sizes, stages, "split")
    if isinstance(balance, str):
        if balance not in METHODS:
            raise ConfigError(
                f"pipeline.balance = {balance!r} is not a method; methods: {', '.join(METHODS)}, or a list"
            )
        if stages is None:
            raise ConfigError(f"pipeline.balance = {balance!r} needs the number of stages")
        if balance == "time" and not any(x.forward_s or x.backward_s for x in layers):
            raise ConfigError(
                'pipeline.balance = "time" needs per-layer times: give pipeline.profile (a run file '
                "made with profile.layers = true, or a cost table)"
            )
        if stages > n:
            raise ConfigError(
                f"{stages} pipeline stages for a model of {n} top-level layers: use at most {n}"
            )
        sizes = balance_by_cost([_cost(x, balance) for x in layers], stages)
        return Partition(layers, tuple(sizes), balance)
    sizes = [int(b) for b in balance]
    if sum(sizes) != n:
        raise ConfigError(
            f"pipeline.balance = {sizes} sums to {sum(sizes)}; the model has {n} top-level layers"
        )
    return _fitting(layers, sizes, stages, "balance")


def _fitting(layers: tuple[LayerInfo, ...], sizes: list[int], stages: int | None, method: str) -> Partition:
    if any(size < 1 for size in sizes):
        raise ConfigError(
            f"pipeline.{method} gives stage {sizes.index(min(sizes))} no layer: every stage needs one"
        )
    if stages is not None and len(sizes) != stages:
        raise ConfigError(f"pipeline.{method} describes {len(sizes)} stages; the run has {stages}")
    return Partition(layers, tuple(sizes), method)
