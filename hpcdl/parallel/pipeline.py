"""``parallel.strategy = "pipeline"``: the model cut into stages, microbatches through a schedule.

Rank s of p holds stage s: a contiguous run of the model's top-level layers (a residual
block is one), chosen by ``[pipeline]`` (:func:`~hpcdl.parallel.pipe_profile.stage_partition`:
counts, split points or an automatic balance). A step is ``pipeline.microbatches = m``
microbatches of ``data.batch_size`` each — the samples one process takes with
``exchange.accumulate = m``, its reference. Stage 0 reads the inputs, the last stage the
labels and the loss; each stage runs its operations in the order the schedule gives
(:mod:`hpcdl.parallel.pipe_plan`: GPipe, 1F1B, or interleaved 1F1B, where rank s holds the
chunks of virtual stages s, s + p, ...), receiving a forward's input from the stage before
and a backward's output gradient from the stage after (the executor,
:mod:`hpcdl.parallel.pipe_exec`: receives posted two operations ahead, nonblocking sends,
each forward's cache kept until its backward). The gradients of the m microbatches are
summed per chunk, then averaged (as the accumulating exchange does), and each stage updates
its own slice. BatchNorm uses each microbatch's statistics, as under accumulation.

**Replicated stages** (``pipeline.replicas = [r_0, ..., r_{p-1}]`` summing to the world size,
or ``pipeline.stages = p`` for N / p replicas of each): stage s runs on r_s consecutive ranks
and its replica ``k mod r_s`` runs microbatch k, under the replicated GPipe or 1F1B of
:func:`~hpcdl.parallel.pipe_plan.replicated`; activations go from the replica of s that ran k
to the replica of s + 1 that runs it. After the step a stage's replicas sum their gradients
with the config's exchange over the stage's replica communicator (averaged over the m
microbatches, as one process accumulating them), so every replica updates to the same
parameters. The global batch stays m x ``data.batch_size`` and the learning-rate rule counts
m batches per update. BatchNorm's running statistics stay each replica's own; evaluation
runs through replica 0 of each stage and a checkpoint holds replica 0's slice (a stage's piece
is written once, by its first rank).

This module is the strategy: its plan, what each rank builds, the step, the meeting,
evaluation and checkpoint state; the planning inputs (layer costs, shapes) are
:mod:`hpcdl.parallel.pipe_profile`'s.

Per step each stage records its bubble (the part of the step's makespan it spent not
computing: GPipe's and 1F1B's ``(p - 1) / (m + p - 1)`` with equal stage costs), its compute
time, the most activation bytes it held and the most microbatches in flight (``ranks/``);
with ``log.trace`` every forward, backward, send and receive goes to ``trace/``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from hpcdl import comm as ops  # ops.MAX resolved at use: importing this module starts no MPI
from hpcdl.backend import array_module, synchronize
from hpcdl.comm import notes, wtime
from hpcdl.errors import ConfigError, HpcdlError
from hpcdl.nn import Sequential, SoftmaxCrossEntropy
from hpcdl.parallel import make_exchange
from hpcdl.parallel.common import mean_over_contributors
from hpcdl.parallel.conformance import Case, Conformance
from hpcdl.parallel.evaluation import EVAL_BATCH, Tally, test_batches
from hpcdl.parallel.memory import RankMemory, evaluation, model_parts
from hpcdl.parallel.pipe_auto import planned_lines, settle_plan
from hpcdl.parallel.pipe_exec import EVAL_TAG, LOOKAHEAD, Chunk, Stage, run_step
from hpcdl.parallel.pipe_plan import (
    Op,
    Partition,
    ReplicatedSchedule,
    Schedule,
    partition,
    replicated,
    schedule,
)
from hpcdl.parallel.pipe_profile import (
    PROFILE_STEPS,
    layer_infos,
    profile_costs,
    sample_shapes,
    stage_partition,
)
from hpcdl.parallel.pipe_schema import DECLARES
from hpcdl.parallel.state import Serializer
from hpcdl.parallel.strategy import (
    Agreement,
    Batches,
    LockstepStrategy,
    Placement,
    RankPlace,
    RunContext,
    StepStats,
    elementwise_only,
)
from hpcdl.parallel.sync import auto_attrs, auto_remarks, exchange_for, keep_auto_table

# the planning inputs (pipe_profile) and the executor's constants (pipe_exec) are still named here
__all__ = [
    "LOOKAHEAD",
    "PROFILE_STEPS",
    "Pipeline",
    "layer_infos",
    "profile_costs",
    "sample_shapes",
    "stage_partition",
    "stage_replicas",
]

# -- the strategy --------------------------------------------------------------------------------


def one_process_accumulating(cfg: Any, world: int) -> tuple[dict[str, Any], int]:
    """The run a pipeline of ``world`` stages is equivalent to: one process accumulating the
    gradients of the step's m microbatches (``exchange.accumulate = m``) on the same batches."""
    return {"parallel.strategy": "sync", "exchange.accumulate": cfg["pipeline.microbatches"]}, 1


def _schedule(cfg: Any, reps: Sequence[int], m: int) -> Schedule | ReplicatedSchedule:
    """The config's schedule for stages of ``reps`` ranks: :func:`schedule` unreplicated,
    :func:`replicated` otherwise (which refuses ``interleaved`` and an m that is not a multiple
    of every replica count)."""
    return _schedule_of(cfg["pipeline.schedule"], tuple(reps), m, cfg["pipeline.virtual_stages"])


@functools.lru_cache(maxsize=8)
def _schedule_of(name: str, reps: tuple[int, ...], m: int, v: int) -> Schedule | ReplicatedSchedule:
    """:func:`_schedule`'s, built once per process: it is immutable, and the ranks of a
    simulation (1,024 of them) would each build every stage's lanes twice (plan, then build)."""
    if max(reps) == 1:
        return schedule(name, len(reps), m, v)
    return replicated(name, m, reps)


def stage_replicas(cfg: Any, world: int) -> tuple[int, ...]:
    """Per stage, its ranks: ``pipeline.replicas``, or ``pipeline.stages = p`` stages of
    ``world / p`` replicas each, or one rank per stage.

    Raises:
        ConfigError: replicas that do not sum to ``world`` or below 1, a stage count that does
            not divide it, or the two keys disagreeing (one line naming the fix).
    """
    reps, p = [int(r) for r in cfg["pipeline.replicas"]], int(cfg["pipeline.stages"])
    if reps:
        if min(reps) < 1:
            raise ConfigError(f"pipeline.replicas = {reps}: every stage needs at least 1 rank")
        if sum(reps) != world:
            raise ConfigError(
                f"pipeline.replicas = {reps} puts {sum(reps)} ranks to work; this run has {world}: "
                f"make the replicas sum to {world}, or run on {sum(reps)} ranks"
            )
        if p and p != len(reps):
            raise ConfigError(
                f"pipeline.stages = {p} but pipeline.replicas = {reps} has {len(reps)} stages: "
                "set one of them (pipeline.stages = 0 with replicas)"
            )
        return tuple(reps)
    if p:
        if world % p:
            near = [d for d in range(1, world + 1) if world % d == 0]
            closest = min(near, key=lambda d: (abs(d - p), d))
            raise ConfigError(
                f"pipeline.stages = {p} does not divide the {world} ranks into equal replicas: use "
                f"pipeline.stages = {closest}, or pipeline.replicas = [r1, ..., r{p}] summing to {world}"
            )
        return (world // p,) * p
    return (1,) * world


class Pipeline(LockstepStrategy):
    """Pipeline parallel (GPipe, 1F1B): one stage per rank, or replicated stages
    (``pipeline.replicas``), m microbatches per step.

    Args:
        ctx: the driver's run context.

    Raises:
        ConfigError: the partition does not fit the model (on every rank alike).
    """

    name = "pipeline"
    rank_series = ("bubble", "busy_time", "activation_bytes", "in_flight")
    # replicated stages sum their gradients with the config's exchange: its keys are read too
    keys = ("pipeline.", "exchange.name", "exchange.algorithm", "exchange.bucket_mb", "exchange.auto_table",
            "exchange.auto_threshold_kb", "exchange.auto_calibrate", "exchange.auto_cache",
            "exchange.in_place", "exchange.debug")  # fmt: skip
    declares = DECLARES
    conformance = Conformance(
        {
            "1f1b": Case(
                {"pipeline.schedule": "1f1b", "pipeline.microbatches": 4},
                reference=one_process_accumulating,
                tolerance=1e-10,
            ),
            "gpipe-dropout": Case(
                {"pipeline.schedule": "gpipe", "pipeline.microbatches": 3, "model.dropout": 0.2}
            ),
            # one stage on every rank (2 or 3): the replicas' exchange, a piece written once
            "replicated": Case(
                {"pipeline.schedule": "gpipe", "pipeline.microbatches": 6, "pipeline.stages": 1},
                reference=one_process_accumulating,
                tolerance=1e-10,
            ),
        }
    )
    cannot_honour = {
        "exchange.accumulate": "a pipeline accumulates over its microbatches: "
        "set pipeline.microbatches instead",
        "exchange.compression": "activations and gradients travel between stages in the model's dtype, "
        "uncompressed; set exchange.compression = 'none'",
    }

    @classmethod
    def settle(cls, cfg: Any, world: int, inputs: Any) -> dict[str, Any]:
        """``pipeline.balance = "plan"``: the planner's plan as config values
        (:func:`~hpcdl.parallel.pipe_auto.settle_plan`); {} otherwise."""
        return settle_plan(cfg, world, inputs)

    @classmethod
    def plan(cls, cfg: Any, world: int) -> Placement:
        """Rank s is stage s and holds it; every stage follows the one stream of batches (member 0).

        Raises:
            ConfigError: a schedule that does not fit the stages and microbatches.
        """
        elementwise_only(cfg, cls.name, "splits the model into stages (K-FAC over stages is not built)")
        if cfg["exchange.name"] == "switch":
            raise ConfigError(
                "exchange.name = 'switch' with parallel.strategy = 'pipeline': a stage's replicas do not "
                "sum through a switch (one job per switch); use 'bucketed', or parallel.strategy = 'sync'"
            )
        m, v = cfg["pipeline.microbatches"], cfg["pipeline.virtual_stages"]
        reps = stage_replicas(cfg, world)
        p = len(reps)
        sched = _schedule(cfg, reps, m)
        if 2 * v * m > EVAL_TAG:  # pipe_exec.message_tag: tags below 2 v m
            raise ConfigError(
                f"{v} chunks a stage x {m} microbatches need more message tags than MPI promises (32767): "
                f"use at most {EVAL_TAG // (2 * v)} microbatches"
            )
        ranks = tuple(RankPlace(f"stage {s}", f"stage {s}", 0) for s, r in enumerate(reps) for _ in range(r))
        chunks = (
            f"; stage s holds chunks c = 0..{v - 1}, virtual stages c x {p} + s (Fk.c: microbatch k "
            "on chunk c)"
            if v > 1
            else ""
        )
        held = (
            f"most microbatches held per stage: {sched.in_flight()}"
            if isinstance(sched, Schedule)
            else f"replicas {list(reps)} (microbatch k on replica k mod r_s; AR: the stage's gradient "
            f"allreduce); most microbatches a replica holds, per stage: {[max(h) for h in sched.in_flight()]}"
        )
        notes_ = (
            f"schedule {sched.name}, {m} microbatch{'es' * (m > 1)} of {cfg['data.batch_size']}; "
            f"{held}{chunks}",
            sched.table(shown=4) if isinstance(sched, ReplicatedSchedule) else str(sched),
        )
        return Placement(cls.name, ranks, cfg["data.batch_size"], m, notes=notes_)

    @classmethod
    def memory(
        cls, cfg: Any, placement: Placement, probe: Any, test_size: int, eval_batch: int
    ) -> list[RankMemory]:
        """Stage s (each of its replicas): its slice's parameters, gradients and optimizer state,
        the sum of its microbatches' gradients (and the replicas' exchange buffers); the caches of
        the microbatches it holds at once (the schedule's
        :meth:`~hpcdl.parallel.pipe_plan.Schedule.in_flight`) beside one microbatch's step and the
        receives posted ahead, or (replica 0) an evaluation through its slice. Every stage builds
        the whole model before keeping its slice. A ``time`` balance found by profiling at the
        start is estimated on a uniform cut.
        """
        v, m = cfg["pipeline.virtual_stages"], placement.micro_steps
        reps = stage_replicas(cfg, placement.world)
        p = len(reps)
        sched = _schedule(cfg, reps, m)
        # per rank, the most microbatches it holds (a replica: of its share)
        held_by_rank = (
            sched.in_flight()
            if isinstance(sched, Schedule)
            else [h for lanes in sched.in_flight() for h in lanes]
        )
        stage_of = [s for s, r in enumerate(reps) for _ in range(r)]
        first_of = [sum(reps[:s]) for s in range(p)]
        note = ""
        if cfg["pipeline.balance"] == "time" and not cfg["pipeline.profile"] and not cfg["pipeline.split"]:
            infos = layer_infos(probe.model, probe.shapes[0], cfg["data.batch_size"])
            cut = partition(infos, p * v, balance="uniform")
            note = "a time balance is found by profiling when the run starts: estimated on a uniform cut"
        else:
            cut = stage_partition(cfg, probe.model, p * v, probe.shapes[0], None)
        bounds = np.cumsum([0, *cut.balance]).tolist()
        whole, _ = probe.parameters()
        hint = "or cut the model into more stages (more ranks)"
        if sched.name == "gpipe":
            hint += ", or pipeline.schedule = '1f1b' (fewer microbatches held at once)"
        out = []
        for rank, (s, held) in enumerate(zip(stage_of, held_by_rank)):
            slices = [(bounds[c * p + s], bounds[c * p + s + 1]) for c in range(v)]
            sizes = [probe.parameters(a, b) for a, b in slices]
            nbytes, largest = sum(n for n, _ in sizes), max(big for _, big in sizes)
            acts = [probe.activations(a, b) for a, b in slices]
            hf, hs = (max(a.held[i] for a in acts) for i in (0, 1))
            io = max(max(a.input_bytes, a.output_bytes) for a in acts)
            what = f"{held} microbatch{'es' * (held > 1)} held"
            lines = [(f + (held - 1) * hf, per + (held - 1) * hs + LOOKAHEAD * io, what)
                     for a in acts for f, per in a.step]  # fmt: skip
            if rank == first_of[s]:  # replica 0 evaluates; the others wait for its result
                lines += [line for a in acts for line in evaluation(a, min(EVAL_BATCH, test_size))]
            # the kept sum of the microbatches, and a replicated stage's exchange (sync's estimate)
            exchange = 2 * nbytes if reps[s] > 1 else 0
            parts = {**model_parts(cfg, nbytes, largest), "buffers": (nbytes if m > 1 else 0) + exchange}
            role = placement.ranks[rank].role
            out.append(RankMemory(role, parts, tuple(lines), cfg["data.batch_size"], 2 * whole, hint, note))
        return out

    @classmethod
    def describe(cls, cfg: Any, placement: Placement, model: Any) -> list[str]:
        """The partition (``--plan``): stage, layers, parameters, times, bytes sent on.

        Args:
            cfg: the config.
            placement: the strategy's placement.
            model: the driver's model builder; its ``data`` is the loaded data set (one
                sample's shape, and the samples a ``time`` balance profiles on).
        """
        data = model.data
        whole = model()
        batch = cfg["data.batch_size"]

        def sample() -> tuple[Sequential, Any, Any]:
            x = np.asarray(data.x_train[:batch], dtype=cfg["dtype"])
            return model(), x, np.asarray(data.y_train[:batch])

        stages = len(stage_replicas(cfg, placement.world)) * cfg["pipeline.virtual_stages"]
        table = stage_partition(cfg, whole, stages, data.input_shape, sample).table()
        planned = planned_lines(cfg)
        return [table, *(["", *planned] if planned else [])]

    def __init__(self, ctx: RunContext) -> None:
        super().__init__(ctx)
        self.comm = ctx.comm.Dup()  # its own messages: tags cannot meet the driver's collectives
        self.reps = stage_replicas(ctx.cfg, self.comm.Get_size())
        rank = self.comm.Get_rank()
        self.p = len(self.reps)
        self.s = next(s for s in range(self.p) if rank < sum(self.reps[: s + 1]))  # this rank's stage
        self.j = rank - sum(self.reps[: self.s])  # its replica of the stage
        self.xp, self.dtype = array_module(ctx.cfg["device"]), np.dtype(ctx.cfg["dtype"])
        self.first, self.last = self.s == 0, self.s == self.p - 1  # holds the first / last virtual stage
        self.m = ctx.placement.micro_steps
        self.schedule: Schedule | ReplicatedSchedule = _schedule(ctx.cfg, self.reps, self.m)
        self.chunk_count = self.schedule.chunks if isinstance(self.schedule, Schedule) else 1
        lanes = self.schedule.stages[self.s]
        self.ops: tuple[Op, ...] = lanes if isinstance(self.schedule, Schedule) else lanes[self.j]
        self.batch = ctx.placement.batch_size
        try:
            self.partition = self._agree_partition()
        except ConfigError:  # on every rank alike: the duplicated communicator goes with it
            self.comm.Free()
            raise
        # sums the microbatches' gradients and averages them (the accumulating exchange's rule),
        # one per chunk, over the stage's replicas (one rank when unreplicated)
        self.replicas = self.comm.Split(self.s, self.j)
        self.chunks = self._chunks(ctx.build_model)
        layers = [
            (name, layer) for c in self.chunks for name, layer in zip(c.model._children, c.model.layers)
        ]
        # what this rank holds, in the model's order of its chunks (parameters, buffers, checkpoints)
        self.model: Sequential = self.chunks[0].model if len(self.chunks) == 1 else _holding(layers)
        self.sampler = ctx.sampler(0)
        self.batches = Batches(self.sampler)
        self.lr = ctx.schedule()
        params = self.model.parameters()
        self.optimizer = ctx.optimizer(params) if params else None  # a stage of ReLUs has nothing to update
        self.loss_fn = SoftmaxCrossEntropy()
        self.tracing = bool(ctx.cfg["log.trace"])
        self.bytes_sent = 0
        self._agree = np.zeros(10)  # mean_over_contributors: 2 (4 k + 1) for a meeting of k = 1 step
        self._note = notes()
        # what the executor runs every step with (pipe_exec): it measures, this object counts
        self.stage = Stage(
            ctx, self.comm, self.s, self.p, self.chunks, self.ops, self.m, self.xp, self.dtype,
            self.loss_fn, self.tracing, self._note, self.reps,
        )  # fmt: skip

    # -- building ----------------------------------------------------------------------------
    def _agree_partition(self) -> Partition:
        """Rank 0 works the partition out on a model of its own (it may profile) and every rank
        takes it, or its error."""
        outcome: tuple[str, Any] | None = None
        if self.comm.Get_rank() == 0:
            cfg, data = self.ctx.cfg, self.ctx.data()

            def sample() -> tuple[Sequential, Any, Any]:
                x, y = self.ctx.batch(np.arange(self.ctx.placement.batch_size))
                return self.ctx.build_model(), x, y  # a model of its own to profile

            stages = self.p * self.chunk_count
            streams = self.ctx.random_state()  # profiling draws dropout masks: the run's draws stay
            try:
                whole = self.ctx.build_model()
                outcome = ("ok", stage_partition(cfg, whole, stages, data.input_shape, sample))
            except (HpcdlError, OSError) as err:  # a bad description or profile: every rank says so
                outcome = ("error", str(err))
            finally:
                self.ctx.load_random_state(streams)
        kind, value = self.comm.bcast(outcome, root=0)
        if kind == "error":
            raise ConfigError(value)
        return value

    def _chunks(self, build: Callable[[], Sequential]) -> list[Chunk]:
        """This rank's model chunks (virtual stages ``c p + s``) of the model ``build()`` makes,
        with the shapes they receive. The other stages' layers are freed before the exchanges'
        collectives: ranks never hold whole models at once (1,024 simulated ranks in one process)."""
        whole = build()
        shapes = sample_shapes(whole, self.xp.zeros((1, *self.ctx.data().input_shape), dtype=self.dtype))
        bounds = np.cumsum([0, *self.partition.balance]).tolist()
        count = len(self.partition.balance)
        cut = []
        for c in range(self.chunk_count):
            v = c * self.p + self.s  # Schedule.virtual
            a, b = bounds[v], bounds[v + 1]
            model = whole[a:b]
            if v > 0:  # the model's first layers skip their input gradient: here one is sent back
                for layer in model:
                    layer.needs_input_grad = True
            cut.append((model, v, (self.batch, *shapes[a]), (self.batch, *shapes[b])))
        del whole
        return [Chunk(model, v, count, into, out, self._exchange(model)) for model, v, into, out in cut]

    def _exchange(self, model: Sequential) -> Any:
        """A chunk's gradient sum over its microbatches, averaged: the config's exchange over the
        stage's replicas, or the accumulating flat one on a stage of one rank."""
        if self.replicas.Get_size() == 1:
            return make_exchange("allreduce", self.replicas, model.parameters())
        return exchange_for(self.ctx.cfg, self.replicas, model)

    # -- a step ------------------------------------------------------------------------------
    def step(self, step: int) -> StepStats:
        """This stage's operations of the schedule on the step's m microbatches, then its update."""
        indices = self.batches.next()
        parts = np.split(indices, self.m)
        lr = self.lr(step)
        run = run_step(self.stage, parts)
        self.bytes_sent += run.bytes_sent
        self._note["phase"] = "update"
        t0 = wtime()
        for chunk in self.chunks:
            chunk.exchange.exchange()  # the sum over microbatches (and replicas), averaged
        exchange_s = wtime() - t0 if self.replicas.Get_size() > 1 else 0.0
        if exchange_s and self.tracing:
            self.ctx.trace("allreduce", t0, t0 + exchange_s)
        if self.optimizer is not None:
            self.optimizer.lr = lr
            self.optimizer.step()
        share = self.reps[self.s]  # a last-stage replica: the mean loss of its m / r microbatches
        return StepStats(
            loss=run.loss * share if self.last else math.nan,
            correct=run.correct,
            samples=len(indices) // share if self.last else 0,
            lr=lr,
            comm_s=run.comm_s + exchange_s,
            exposed_s=run.comm_s + exchange_s,
            bytes_sent=self.bytes_sent,
            series={
                "span": run.span,  # the meeting turns it into the bubble
                "busy_time": run.busy_s,
                "activation_bytes": float(run.peak_bytes),
                "in_flight": float(run.peak_held),
            },
        )

    # -- meetings ----------------------------------------------------------------------------
    def agree(self, stats: Sequence[StepStats], stop: bool) -> Agreement:
        """The last stage's loss and batch accuracy, and the stop votes: one allreduce; then each
        stage's bubble, ``1 - busy / makespan``, the makespan being the longest stage's span
        from the step's start to its last operation's end (a second, MAX, allreduce)."""
        spans = np.array([s.series.pop("span") for s in stats])
        makespans = np.empty_like(spans)
        self.ctx.comm.Allreduce(spans, makespans, op=ops.MAX)
        for s, makespan in zip(stats, makespans):
            s.series["bubble"] = 1.0 - s.series["busy_time"] / makespan if makespan > 0 else 0.0
        return mean_over_contributors(self.ctx.comm, stats, stop, self._agree)

    def evaluate(self) -> tuple[float, float]:
        """The whole test set through the (virtual) stages, ``EVAL_BATCH`` images a message; the
        last stage's accuracy and loss on every rank (collective). Replicated stages: through
        replica 0 of each (its BatchNorm statistics); the other replicas wait for the result."""
        data, xp, dtype = self.ctx.data(), self.xp, self.dtype
        n = len(data.y_test)
        tally = Tally()
        prev = self.stage.rank_of((self.s - 1) % self.p, 0)  # replica 0 of the stages around
        after = self.stage.rank_of((self.s + 1) % self.p, 0)
        self.model.eval()
        try:
            for part in test_batches(n) if self.j == 0 else ():
                count = len(part)
                for chunk in self.chunks:
                    if chunk.first:
                        x = xp.asarray(data.x_test[part], dtype=dtype)
                    else:
                        x = xp.empty((count, *chunk.in_shape[1:]), dtype=dtype)
                        self.comm.Recv(x, source=prev, tag=EVAL_TAG)
                    y = chunk.model.forward(x)
                    if not chunk.last:
                        y = xp.ascontiguousarray(y)
                        synchronize(y)  # a GPU buffer must be ready before MPI reads it
                        self.comm.Send(y, dest=after, tag=EVAL_TAG)
                        continue
                    tally.add(y, xp.asarray(data.y_test[part]))
        finally:
            self.model.train()
        result = tally.result() if self.last and self.j == 0 else None
        acc, loss = self.comm.bcast(result, root=self.stage.rank_of(self.p - 1, 0))
        return float(acc), float(loss)

    # -- checkpoints -------------------------------------------------------------------------
    def run_attrs(self) -> dict[str, Any]:
        """Rank 0's replicated stage: the ``auto`` table its exchange picks from (``auto_table``)."""
        return auto_attrs(self.chunks[0].exchange)

    def remarks(self) -> list[str]:
        """How rank 0's replicated stage's ``auto`` table was made (calibrated, from the cache)."""
        return auto_remarks(self.chunks[0].exchange)

    def serialize(self, s: Serializer) -> None:
        """This stage's slice and optimizer state (its piece, with the cut it was made under),
        BatchNorm statistics, the sampler's position, the random streams, bytes sent."""
        s.piece(f"stage {self.s}", model=self.model, optimizer=self.optimizer,
                meta={"partition": self._cut()}, check=self._check_cut)  # fmt: skip
        s.own_buffers(self.model)
        s.random(self.ctx)
        s.stateful("sampler", self.sampler)
        self.bytes_sent = int(s.value("pipeline", {"bytes_sent": self.bytes_sent})["bytes_sent"])
        for c in self.chunks:  # a replicated stage's tables: a resume sums in its run's order
            keep_auto_table(s, c.exchange, self.ctx.cfg, self.replicas, key=f"auto_table {c.index}")
        if s.loading:
            self.batches.restart()

    def _cut(self) -> dict[str, Any]:
        """How the model is cut and scheduled: what a checkpoint's stages must agree with."""
        return {"balance": list(self.partition.balance), "chunks": self.chunk_count}

    def _check_cut(self, pieces: Mapping[str, Mapping[str, Any]]) -> None:
        """Refuse a checkpoint cut otherwise (another partition or chunks per stage).

        Rank 0 sees every stage's piece (before anything is loaded), the others their own.
        A partition worked out by profiling (``balance = "time"`` without ``pipeline.profile``)
        may cut otherwise after a restart: the message names the cut to resume with.

        Raises:
            ConfigError: naming the two cuts.
        """
        mine = self._cut()
        for piece in pieces.values():
            theirs = piece.get("meta", {}).get("partition")
            if theirs is not None and theirs != mine:
                v = theirs["chunks"]
                chunks = "" if v == 1 else f" with pipeline.virtual_stages = {v}"
                raise ConfigError(
                    f"it was cut as pipeline.balance = {theirs['balance']}{chunks}; this run cuts "
                    f"{mine['balance']}: resume with pipeline.balance = {theirs['balance']}"
                )

    def close(self) -> None:
        """Free the communicators it made (collective)."""
        self.replicas.Free()
        self.comm.Free()


def _holding(layers: list[tuple[str, Any]]) -> Sequential:
    """A container of a rank's chunks' layers under their own names (never run as a whole)."""
    names, modules = zip(*layers)
    return Sequential(list(modules), names=list(names))
