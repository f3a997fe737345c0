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

* **Replicated stages** (:func:`replicated`): stage s run by r_s ranks, microbatch k on
  replica ``k mod r_s``; each replica runs its share of the stage's GPipe or 1F1B order,
  then the stage's gradient allreduce (``AR``). A stage r times as heavy as its
  neighbours, on r replicas, keeps their pace.

* **Timing** (:func:`simulate`): when each operation starts and ends, given per-stage
  forward and backward costs, with a forward of k on stage s after the forward of k on
  s - 1 and a backward of k on s after the backward of k on s + 1 (and after its own
  forward); a replicated stage's allreduce after all its backwards. With equal costs
  GPipe's and 1F1B's bubble fraction is ``(p - 1) / (m + p - 1)``.

* **Partitions** (:func:`balance_by_cost`): the contiguous cut of n layers into p stages
  that minimises the most expensive stage, exactly (dynamic programming over prefix
  sums).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from hpcdl.errors import ConfigError

__all__ = [
    "EXCHANGE",
    "METHODS",
    "SCHEDULES",
    "LayerInfo",
    "Op",
    "Partition",
    "ReplicatedSchedule",
    "ReplicatedTimeline",
    "Schedule",
    "Timeline",
    "balance_by_cost",
    "bubble_fraction",
    "gpipe",
    "interleaved",
    "one_f_one_b",
    "partition",
    "replica_windows",
    "replicated",
    "schedule",
    "simulate",
]


@dataclass(frozen=True)
class Op:
    """One operation of a stage: ``kind`` ``"F"`` (forward) or ``"B"`` (backward) of ``microbatch``,
    on the stage's model chunk ``chunk`` (0 unless the schedule is interleaved); or ``"AR"``, a
    replicated stage's gradient allreduce over its replicas (:data:`EXCHANGE`, microbatch -1)."""

    kind: str
    microbatch: int
    chunk: int = 0

    def __str__(self) -> str:
        return self.kind if self.microbatch < 0 else f"{self.kind}{self.microbatch}"


#: a replicated stage's last operation: its replicas sum their gradients (an allreduce)
EXCHANGE = Op("AR", -1)


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
    return Schedule("1f1b", m, tuple(_one_f_one_b_order(m, min(p - s - 1, m)) for s in range(p)))


def _one_f_one_b_order(m: int, warm: int) -> tuple[Op, ...]:
    """``warm`` forwards, then one forward and one backward at a time, then the remaining backwards."""
    ops = [Op("F", k) for k in range(warm)]
    f, b = warm, 0
    while f < m:
        ops += [Op("F", f), Op("B", b)]
        f, b = f + 1, b + 1
    ops += [Op("B", k) for k in range(b, m)]
    return tuple(ops)


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


# -- replicated stages -----------------------------------------------------------------------


@dataclass(frozen=True)
class ReplicatedSchedule:
    """Each (stage, replica)'s ordered operations: ``stages[s][j]`` is replica j of stage s.

    Microbatch k of stage s runs on replica ``k mod replicas[s]``; a stage with more than one
    replica ends with :data:`EXCHANGE`, the allreduce of its gradients over its replicas.
    """

    name: str
    microbatches: int
    replicas: tuple[int, ...]
    stages: tuple[tuple[tuple[Op, ...], ...], ...]

    def replica(self, stage: int, microbatch: int) -> int:
        """The replica of ``stage`` that runs ``microbatch`` (and sends its activation and gradient)."""
        return microbatch % self.replicas[stage]

    def in_flight(self) -> list[list[int]]:
        """Per stage and replica, the most microbatches whose forward ran and whose backward did not yet."""
        computing = [
            tuple(tuple(op for op in ops if op.kind != "AR") for ops in lanes) for lanes in self.stages
        ]
        return [Schedule(self.name, self.microbatches, lanes).in_flight() for lanes in computing]

    def __str__(self) -> str:
        """One line per (stage, replica), operations in columns (``--plan``); a stage of one replica
        prints as :class:`Schedule` prints it."""
        return self.table()

    def table(self, shown: int | None = None) -> str:
        """:meth:`__str__`'s table; with ``shown``, a stage of more replicas than that prints its
        first ``shown - 1`` and its last, and a line saying how many it skipped."""
        labels: list[str] = []
        rows: list[tuple[Op, ...]] = []
        for s, lanes in enumerate(self.stages):
            keep = list(range(len(lanes)))
            if shown is not None and len(lanes) > max(shown, 2):
                keep = [*range(max(shown, 2) - 1), len(lanes) - 1]
            for j in keep:
                if j == len(lanes) - 1 and len(keep) < len(lanes):
                    labels.append(f"  ({len(lanes) - len(keep)} replicas more)")
                    rows.append(())
                labels.append(f"stage {s}" + (f" replica {j}" if len(lanes) > 1 else "") + ":")
                rows.append(lanes[j])
        width = max(len(str(op)) for ops in rows for op in ops)
        label = max(len(x) for x, ops in zip(labels, rows) if ops)
        return "\n".join(
            (f"{name:<{label}} " + " ".join(f"{op!s:<{width}}" for op in ops)).rstrip()
            for name, ops in zip(labels, rows)
        )


def replica_windows(replicas: Sequence[int]) -> list[int]:
    """Per stage, ``h_s``: how many microbatches a replica of stage s holds at most under
    replicated 1F1B (:func:`replicated`; fewer when it has fewer, ``m / r_s``).

    ``h_{p-1} = 1`` and ``h_s = 1 + ceil(h_{s+1} r_{s+1} / r_s)``: stage s + 1 takes in
    ``W_{s+1} = h_{s+1} r_{s+1}`` consecutive microbatches before it sends back the first
    gradient, so stage s must have sent all of them (its r_s replicas share them) and be
    working on one more. With every ``r_s = 1`` it is 1F1B's ``p - s``.
    """
    windows: list[int] = []
    below = 0  # W_{s+1}
    for r in reversed(replicas):
        h = 1 + -(-below // r) if below else 1
        windows.append(h)
        below = h * r
    return windows[::-1]


def replicated(name: str, microbatches: int, replicas: Sequence[int]) -> ReplicatedSchedule:
    """GPipe or 1F1B over stages run by several ranks each (PipeDream's replicated stages,
    DAPPLE's per-stage device counts): stage s of ``p = len(replicas)`` has ``r_s =
    replicas[s]`` replicas, and its replica ``k mod r_s`` runs microbatch k.

    **The order.** Each stage first gets one order over all m microbatches, the one an
    unreplicated stage would run: GPipe's (every forward in increasing k, then every
    backward in decreasing k), or 1F1B's with ``min(W_s - 1, m)`` warm-up forwards, where
    ``W_s = h_s r_s`` and ``h_s`` is :func:`replica_windows`'s (forwards and backwards each
    in increasing k). Replica j runs the subsequence of its microbatches (``k = j, j + r_s,
    ...``), then, when ``r_s > 1``, :data:`EXCHANGE`. Under 1F1B that subsequence is itself
    1F1B over the replica's m / r_s microbatches with ``h_s - 1`` warm-up forwards. With
    every ``r_s = 1``, ``W_s = p - s`` and this is exactly :func:`gpipe` and
    :func:`one_f_one_b`.

    **Why a replicated stage keeps its neighbours busy.** A replica's microbatch costs what
    the unreplicated stage's does, but r_s replicas work on r_s consecutive microbatches at
    once, so the stage takes in and passes on one microbatch every ``(forward + backward) /
    r_s``: a stage r times as heavy as its neighbours, run by r replicas, keeps their pace,
    and each further microbatch adds to the step what it adds to a balanced pipeline
    (``max_s (forward_s + backward_s) / r_s``, GPipe and 1F1B alike). The price is latency:
    a microbatch still spends the full cost on one replica, so filling and draining take
    longer (two stages of pace c, the first twice as heavy on 2 replicas: ``(m + 2) c``,
    against ``(m + 1) c`` for the balanced pipeline). For 1F1B this is why the windows
    count replicas: with ``W_s = W_{s+1} + r_s`` unrounded, a replica would wait for a
    gradient that waits for a forward its stage has not sent yet, and the pace drops.

    **What it holds in flight.** GPipe: every replica all of its ``m / r_s`` microbatches.
    1F1B: a replica at most ``min(h_s, m / r_s)``, with ``h_{p-1} = 1`` and ``h_s = 1 +
    ceil(h_{s+1} r_{s+1} / r_s)`` (derivation at :func:`replica_windows`): ``p - s``
    unreplicated; a heavy stage with r replicas early in the pipe holds about 1/r of
    what the stages after it hold in all, per rank.

    **Deadlock-free by construction.** The unreplicated order of stage s is deadlock-free
    for the dependencies "F k on s - 1 before F k on s, B k on s + 1 before B k on s, F k
    before B k": GPipe's trivially, 1F1B's because its windows shrink along the pipe
    (``W_s >= W_{s+1} + r_s``), so whatever forwards stage s + 1 runs before B k, stage s
    ran before waiting for B k. A replica runs a subsequence of its stage's order, which
    only drops program-order constraints, so a cycle among replicas would be a cycle among
    the stages' orders: there is none. The exchange is each replica's last operation and
    nothing waits for it. Messages match in order too: the replica of s that sends
    activation k (``k mod r_s``) and the one of s + 1 that receives it (``k mod r_{s+1}``)
    take their common microbatches in the same order (increasing k for forwards; for
    gradients the schedule's one backward order), so receives posted in schedule order
    meet the sends in the order they were made (MPI's non-overtaking rule, one tag per
    direction).

    Args:
        name: ``gpipe`` or ``1f1b``.
        microbatches: m, a multiple of every replica count.
        replicas: per stage, its ranks (``pipeline.replicas``).

    Raises:
        ConfigError: another schedule (``interleaved`` is not built for replicas), no stage
            or microbatch, a replica count below 1, or m not a multiple of every replica
            count (naming the nearest m that is).
    """
    reps = tuple(int(r) for r in replicas)
    p, m = len(reps), microbatches
    _check(p, m)
    if name not in ("gpipe", "1f1b"):
        raise ConfigError(
            f"pipeline.schedule = {name!r} cannot run replicated stages (pipeline.replicas = {list(reps)}): "
            "use gpipe or 1f1b"
        )
    if min(reps) < 1:
        raise ConfigError(f"pipeline.replicas = {list(reps)}: every stage needs at least 1 replica")
    whole = math.lcm(*reps)
    if m % whole:
        below, above = m - m % whole, m - m % whole + whole
        if below == 0 or m - below > above - m:
            nearest = f"{above}"
        elif m - below < above - m:
            nearest = f"{below}"
        else:
            nearest = f"{below} or {above}"
        raise ConfigError(
            f"pipeline.microbatches = {m} is not a multiple of every stage's replicas (pipeline.replicas = "
            f"{list(reps)}, multiples of {whole}): use {nearest}"
        )
    windows = replica_windows(reps)
    plan = []
    for s, r in enumerate(reps):
        if name == "gpipe":
            order = tuple(Op("F", k) for k in range(m)) + tuple(Op("B", k) for k in reversed(range(m)))
        else:
            order = _one_f_one_b_order(m, min(windows[s] * r - 1, m))
        tail = (EXCHANGE,) if r > 1 else ()
        plan.append(tuple(tuple(op for op in order if op.microbatch % r == j) + tail for j in range(r)))
    return ReplicatedSchedule(name, m, reps, tuple(plan))


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


@dataclass(frozen=True)
class ReplicatedTimeline:
    """When each operation of a replicated schedule ran: ``start[s][j][i]``/``end[s][j][i]`` of
    ``schedule.stages[s][j][i]`` (replica j of stage s)."""

    schedule: ReplicatedSchedule
    start: tuple[tuple[tuple[float, ...], ...], ...]
    end: tuple[tuple[tuple[float, ...], ...], ...]

    @property
    def makespan(self) -> float:
        """The step's length: the last operation's end, gradient exchanges included."""
        return max(max(e) for lanes in self.end for e in lanes)

    def busy(self, stage: int, replica: int = 0) -> float:
        """Time replica ``replica`` of ``stage`` spent computing (forwards, backwards; not the exchange)."""
        ops = self.schedule.stages[stage][replica]
        times = zip(ops, self.start[stage][replica], self.end[stage][replica])
        return sum(e - s for op, s, e in times if op.kind != "AR")

    def bubble(self, stage: int, replica: int = 0) -> float:
        """The idle fraction of that replica over the step: ``1 - busy / makespan``."""
        return 1.0 - self.busy(stage, replica) / self.makespan


def simulate(
    plan: Schedule | ReplicatedSchedule,
    forward: Sequence[float],
    backward: Sequence[float],
    transfer: float = 0.0,
    *,
    exchange: Sequence[float] | None = None,
) -> Timeline | ReplicatedTimeline:
    """Run ``plan`` in time: each stage (each replica of a stage) executes its operations in
    order, each as soon as its inputs are there.

    A replicated stage's :data:`EXCHANGE` starts when its last replica has ended its last
    backward (an allreduce waits for all its ranks) and ends on every replica
    ``exchange[s]`` later.

    Args:
        plan: the schedule: a :class:`Schedule` gives a :class:`Timeline`, a
            :class:`ReplicatedSchedule` a :class:`ReplicatedTimeline`.
        forward: per virtual stage (per stage unless interleaved), a forward's cost (one
            microbatch, on one replica).
        backward: per virtual stage, a backward's cost.
        transfer: the time an activation or its gradient takes to reach another stage.
        exchange: per stage, its gradient allreduce over its replicas (ignored for a stage
            of one replica, which has none); default 0.

    Raises:
        ValueError: the costs do not give one value per virtual stage (exchanges: per
            stage), or the schedule deadlocks (an operation waits for one that waits for it).
    """
    rep = isinstance(plan, ReplicatedSchedule)
    p = len(plan.stages)
    n = p if rep else p * plan.chunks  # virtual stages
    if len(forward) != n or len(backward) != n:
        raise ValueError(f"costs for {len(forward)}/{len(backward)} stages, the schedule has {n}")
    if exchange is not None and len(exchange) != p:
        raise ValueError(f"exchange costs for {len(exchange)} stages, the schedule has {p}")
    swap = [0.0] * p if exchange is None else list(exchange)
    # lanes: one per rank, (stage, label in a deadlock message, its operations)
    if rep:
        lanes = [(s, (s, j), ops) for s, stage in enumerate(plan.stages) for j, ops in enumerate(stage)]
    else:
        lanes = [(s, s, ops) for s, ops in enumerate(plan.stages)]
    m = plan.microbatches
    done: dict[tuple[str, int, int], float] = {}  # (kind, virtual stage, microbatch) -> end
    nxt = [0] * len(lanes)
    clock = [0.0] * len(lanes)
    start: list[list[float]] = [[] for _ in lanes]
    end: list[list[float]] = [[] for _ in lanes]
    remaining = sum(len(ops) for _, _, ops in lanes)
    while remaining:
        progressed = False
        for i, (s, _, ops) in enumerate(lanes):
            while nxt[i] < len(ops):
                op = ops[nxt[i]]
                k, v = op.microbatch, s + op.chunk * p  # Schedule.virtual
                if op.kind == "F":
                    deps = [("F", v - 1, k)] if v > 0 else []
                    cost = forward[v]
                elif op.kind == "B":
                    deps = [("F", v, k)] + ([("B", v + 1, k)] if v < n - 1 else [])
                    cost = backward[v]
                else:  # the exchange: after every backward of the stage, on whichever replica
                    deps = [("B", v, j) for j in range(m)]
                    cost = swap[s]
                if any(d not in done for d in deps):
                    break
                ready = max([clock[i], *(done[d] + (transfer if d[1] % p != s else 0.0) for d in deps)])
                start[i].append(ready)
                clock[i] = ready + cost
                end[i].append(clock[i])
                done[(op.kind, v, k)] = clock[i]
                nxt[i] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {label: str(ops[nxt[i]]) for i, (_, label, ops) in enumerate(lanes) if nxt[i] < len(ops)}
            raise ValueError(f"schedule {plan.name} deadlocks: stages wait at {stuck}")
    if not rep:
        return Timeline(plan, tuple(map(tuple, start)), tuple(map(tuple, end)))
    first = [0]
    for r in plan.replicas:
        first.append(first[-1] + r)
    return ReplicatedTimeline(
        plan,
        tuple(tuple(map(tuple, start[a:b])) for a, b in zip(first, first[1:])),
        tuple(tuple(map(tuple, end[a:b])) for a, b in zip(first, first[1:])),
    )


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
