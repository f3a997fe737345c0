"""``parallel.strategy = "pipeline"``: the model cut into stages, microbatches through a schedule.

Rank s of p holds stage s: a contiguous run of the model's top-level layers (a residual
block is one), chosen by ``[pipeline]`` (:func:`stage_partition`: counts, split points or an
automatic balance). A step is ``pipeline.microbatches = m`` microbatches of
``data.batch_size`` each — the samples one process takes with ``exchange.accumulate = m``,
its reference. Stage 0 reads the inputs, the last stage the labels and the loss; each
stage runs its operations in the order the schedule gives (:mod:`hpcdl.parallel.pipe_plan`:
GPipe, 1F1B, or interleaved 1F1B, where rank s holds the chunks of virtual stages s, s + p,
...), receiving a forward's input from the stage before and a backward's output gradient
from the stage after. Receives are posted two operations ahead and sends are
nonblocking, so transfers overlap compute. Each forward keeps its layers' cache (the
call's state, :meth:`hpcdl.nn.Layer.save_cache`) until its backward. The gradients of the
m microbatches are summed per chunk, then averaged (as the accumulating exchange does), and
each stage updates its own slice. BatchNorm uses each microbatch's statistics, as under
accumulation.

Per step each stage records its bubble (the part of the step's makespan it spent not
computing: GPipe's and 1F1B's ``(p - 1) / (m + p - 1)`` with equal stage costs), its compute
time, the most activation bytes it held and the most microbatches in flight (``ranks/``);
with ``log.trace`` every forward, backward, send and receive goes to ``trace/``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hpcdl import comm as ops  # ops.MAX resolved at use: importing this module starts no MPI
from hpcdl.backend import array_module, get_array_module, synchronize, to_numpy
from hpcdl.comm import notes, waitall, wtime
from hpcdl.errors import ConfigError, HpcdlError
from hpcdl.nn import LayerProfiler, Sequential, SoftmaxCrossEntropy, cache_nbytes, observe
from hpcdl.parallel import make_exchange
from hpcdl.parallel.memory import RankMemory, evaluation, model_parts
from hpcdl.parallel.pipe_plan import LayerInfo, Op, Partition, Schedule, partition, schedule
from hpcdl.parallel.pipe_schema import DECLARES
from hpcdl.parallel.strategy import (
    Agreement,
    Batches,
    Placement,
    RankPlace,
    RankState,
    RunContext,
    StepStats,
    Strategy,
    differing_parameters,
    load_model_piece,
    model_piece,
)
from hpcdl.parallel.sync import mean_over_members

__all__ = ["Pipeline", "layer_infos", "profile_costs", "sample_shapes", "stage_partition"]

#: steps rank 0 profiles for ``balance = "time"`` when ``pipeline.profile`` is empty
PROFILE_STEPS = 3
#: receives are posted for the operations this many ahead of the one running
LOOKAHEAD = 2
#: test images per evaluation message
EVAL_BATCH = 512


# -- the partition: what each stage holds ------------------------------------------------------


def sample_shapes(model: Sequential, x: Any) -> list[tuple[int, ...]]:
    """One sample's shape into the model and out of each top-level layer (a forward of the
    one-sample ``x`` in evaluation mode: BatchNorm statistics and dropout streams untouched)."""
    shapes = [tuple(x.shape[1:])]
    training = model.training
    model.eval()
    try:
        for layer in model.layers:
            x = layer.forward(x)
            shapes.append(tuple(x.shape[1:]))
    finally:
        model.train(training)
    return shapes


def layer_infos(
    model: Sequential,
    input_shape: Sequence[int],
    batch: int,
    costs: dict[str, Any] | None = None,
) -> list[LayerInfo]:
    """What the partitioner knows of each top-level layer: parameters, output bytes at ``batch``
    samples (:func:`sample_shapes`), and ``costs``' times scaled to ``batch``.

    Args:
        model: the whole model.
        input_shape: one sample's shape.
        batch: samples per microbatch.
        costs: layer name -> :class:`hpcdl.sim.compute.LayerCost` (a cost table), or None.
    """
    first = model.parameters()[0].data  # a model has parameters; a stage may not
    shapes = sample_shapes(model, get_array_module(first).zeros((1, *input_shape), dtype=first.dtype))
    infos = []
    for name, layer, shape in zip(model._children, model.layers, shapes[1:], strict=True):
        fwd = bwd = 0.0
        cost = (costs or {}).get(name)
        if cost is not None:
            scale = batch / cost.batch if cost.batch else 1.0
            fwd, bwd = cost.forward_s * scale, cost.backward_s * scale
        params = sum(int(p.size) for p in layer.parameters())
        out_bytes = math.prod(shape) * first.dtype.itemsize * batch
        infos.append(LayerInfo(name, params, fwd, bwd, out_bytes))
    return infos


def profile_costs(model: Sequential, x: Any, y: Any, steps: int = PROFILE_STEPS) -> dict[str, Any]:
    """Per top-level layer, the median forward and backward time over ``steps`` steps on ``(x, y)``
    after one warm-up step.

    Run on a model of its own (its gradients, BatchNorm statistics and dropout draws are
    spent): the costs ``balance = "time"`` partitions by when no profile is given.
    """
    from hpcdl.sim.compute import LayerCost  # noqa: PLC0415 (the simulator's row type, no simulator)

    profiler = LayerProfiler()
    loss_fn = SoftmaxCrossEntropy()
    loss_fn.forward(model.forward(x), y)  # a warm-up step: first touches of memory, not timed
    model.backward(loss_fn.backward())
    with observe(profiler):
        for _ in range(steps):
            loss_fn.forward(model.forward(x), y)
            model.backward(loss_fn.backward())
    batch = int(x.shape[0])
    return {row["layer"]: LayerCost(row["forward_s"], row["backward_s"], batch) for row in profiler.table()}


def stage_partition(
    cfg: Any, model: Sequential, stages: int, input_shape: Sequence[int], sample: Callable[[], Any] | None
) -> Partition:
    """The partition ``[pipeline]`` describes for ``stages`` stages of ``model`` (pure but for profiling).

    ``pipeline.split`` (names) when given, else ``pipeline.balance`` (counts or a method).
    ``balance = "time"`` takes its costs from ``pipeline.profile`` (a run file's ``profile/``
    or a cost table) or, when that is empty, profiles :data:`PROFILE_STEPS` steps of a
    microbatch ``sample()`` returns (``(model, x, y)``: a model of its own).

    Raises:
        ConfigError: the description does not fit the model (one line naming it).
    """
    balance, split = cfg["pipeline.balance"], cfg["pipeline.split"]
    if split and balance != "uniform":
        raise ConfigError(
            f"pipeline.split = {split} and pipeline.balance = {balance!r} both describe the partition: "
            "give one"
        )
    batch = cfg["data.batch_size"]
    costs = None
    if cfg["pipeline.profile"]:
        from hpcdl.sim.compute import load_cost_table  # noqa: PLC0415

        costs = load_cost_table(cfg["pipeline.profile"])
    elif balance == "time" and not split and sample is not None:
        costs = profile_costs(*sample())
    infos = layer_infos(model, input_shape, batch, costs)
    if balance == "time" and costs is not None and not split:
        missing = [x.name for x in infos if x.name not in costs]
        if missing:
            raise ConfigError(
                f"pipeline.profile {cfg['pipeline.profile']} has no row for layer {missing[0]!r}: "
                "profile this model (a run with profile.layers = true)"
            )
    if split:
        return partition(infos, stages, split=split)
    return partition(infos, stages, balance=balance)


# -- the strategy --------------------------------------------------------------------------------


class Pipeline(Strategy):
    """Pipeline parallel (GPipe, 1F1B): one stage per rank, m microbatches per step.

    Args:
        ctx: the driver's run context.

    Raises:
        ConfigError: the partition does not fit the model (on every rank alike).
    """

    name = "pipeline"
    rank_series = ("bubble", "busy_time", "activation_bytes", "in_flight")
    keys = ("pipeline.",)
    declares = DECLARES
    cannot_honour = {
        "exchange.accumulate": "a pipeline accumulates over its microbatches: "
        "set pipeline.microbatches instead",
        "exchange.compression": "activations and gradients travel between stages in the model's dtype, "
        "uncompressed; set exchange.compression = 'none'",
    }

    @classmethod
    def plan(cls, cfg: Any, world: int) -> Placement:
        """Rank s is stage s and holds it; every stage follows the one stream of batches (member 0).

        Raises:
            ConfigError: a schedule that does not fit the stages and microbatches.
        """
        m, v = cfg["pipeline.microbatches"], cfg["pipeline.virtual_stages"]
        sched = schedule(cfg["pipeline.schedule"], world, m, v)
        if 2 * (world * v + 1) * m >= _EVAL:
            raise ConfigError(
                f"{world * v} stages x {m} microbatches need more message tags than MPI promises (32767): "
                "use fewer microbatches"
            )
        ranks = tuple(RankPlace(f"stage {s}", f"stage {s}", 0) for s in range(world))
        chunks = (
            f"; stage s holds chunks c = 0..{v - 1}, virtual stages c x {world} + s (Fk.c: microbatch k "
            "on chunk c)"
            if v > 1
            else ""
        )
        notes_ = (
            f"schedule {sched.name}, {m} microbatch{'es' * (m > 1)} of {cfg['data.batch_size']}; "
            f"most microbatches held per stage: {sched.in_flight()}{chunks}",
            str(sched),
        )
        return Placement(cls.name, ranks, cfg["data.batch_size"], m, notes=notes_)

    @classmethod
    def memory(
        cls, cfg: Any, placement: Placement, probe: Any, test_size: int, eval_batch: int
    ) -> list[RankMemory]:
        """Stage s: its slice's parameters, gradients and optimizer state, the sum of its
        microbatches' gradients; the caches of the microbatches it holds at once (the schedule's
        :meth:`~hpcdl.parallel.pipe_plan.Schedule.in_flight`) beside one microbatch's step and the
        receives posted ahead, or an evaluation through its slice. Every stage builds the whole
        model before keeping its slice. A ``time`` balance found by profiling at the start is
        estimated on a uniform cut.
        """
        p, v, m = placement.world, cfg["pipeline.virtual_stages"], placement.micro_steps
        sched = schedule(cfg["pipeline.schedule"], p, m, v)
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
        for s, held in enumerate(sched.in_flight()):
            slices = [(bounds[c * p + s], bounds[c * p + s + 1]) for c in range(v)]
            sizes = [probe.parameters(a, b) for a, b in slices]
            nbytes, largest = sum(n for n, _ in sizes), max(big for _, big in sizes)
            acts = [probe.activations(a, b) for a, b in slices]
            hf, hs = (max(a.held[i] for a in acts) for i in (0, 1))
            io = max(max(a.input_bytes, a.output_bytes) for a in acts)
            what = f"{held} microbatch{'es' * (held > 1)} held"
            lines = [(f + (held - 1) * hf, per + (held - 1) * hs + LOOKAHEAD * io, what)
                     for a in acts for f, per in a.step]  # fmt: skip
            lines += [line for a in acts for line in evaluation(a, min(EVAL_BATCH, test_size))]
            parts = {**model_parts(cfg, nbytes, largest), "buffers": nbytes if m > 1 else 0}
            role = placement.ranks[s].role
            out.append(RankMemory(role, parts, tuple(lines), cfg["data.batch_size"], 2 * whole, hint, note))
        return out

    @classmethod
    def describe(cls, cfg: Any, placement: Placement, model: Any) -> list[str]:
        """The partition (``--plan``): stage, layers, parameters, times, bytes sent on."""
        from hpcdl.driver.factory import load_data  # noqa: PLC0415 (the driver's, for the sample's shape)

        data = load_data(cfg)
        whole = model()
        batch = cfg["data.batch_size"]

        def sample() -> tuple[Sequential, Any, Any]:
            x = np.asarray(data.x_train[:batch], dtype=cfg["dtype"])
            return model(), x, np.asarray(data.y_train[:batch])

        stages = placement.world * cfg["pipeline.virtual_stages"]
        return [stage_partition(cfg, whole, stages, data.input_shape, sample).table()]

    def __init__(self, ctx: RunContext) -> None:
        super().__init__(ctx)
        self.comm = ctx.comm.Dup()  # its own messages: tags cannot meet the driver's collectives
        self.p, self.s = self.comm.Get_size(), self.comm.Get_rank()
        self.xp, self.dtype = array_module(ctx.cfg["device"]), np.dtype(ctx.cfg["dtype"])
        self.first, self.last = self.s == 0, self.s == self.p - 1  # holds the first / last virtual stage
        self.m = ctx.placement.micro_steps
        self.schedule: Schedule = schedule(
            ctx.cfg["pipeline.schedule"], self.p, self.m, ctx.cfg["pipeline.virtual_stages"]
        )
        self.ops: tuple[Op, ...] = self.schedule.stages[self.s]
        self.batch = ctx.placement.batch_size
        whole: Sequential = ctx.build_model()
        try:
            self.partition = self._agree_partition(whole)
        except ConfigError:  # on every rank alike: the duplicated communicator goes with it
            self.comm.Free()
            raise
        # sums the microbatches' gradients and averages them (the accumulating exchange's rule),
        # one per chunk; over one rank here, over a stage's replicas when they come
        self.replicas = self.comm.Split(self.s, 0)
        self.chunks = self._chunks(whole)
        del whole  # the other stages' layers are freed
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
        self._agree = np.zeros(8)
        self._note = notes()

    # -- building ----------------------------------------------------------------------------
    def _agree_partition(self, whole: Sequential) -> Partition:
        """Rank 0 works the partition out (it may profile) and every rank takes it, or its error."""
        outcome: tuple[str, Any] | None = None
        if self.s == 0:
            cfg, data = self.ctx.cfg, self.ctx.data()

            def sample() -> tuple[Sequential, Any, Any]:
                x, y = self.ctx.batch(np.arange(self.ctx.placement.batch_size))
                return self.ctx.build_model(), x, y  # a model of its own to profile

            stages = self.p * self.schedule.chunks
            streams = self.ctx.random_state()  # profiling draws dropout masks: the run's draws stay
            try:
                outcome = ("ok", stage_partition(cfg, whole, stages, data.input_shape, sample))
            except (HpcdlError, OSError) as err:  # a bad description or profile: every rank says so
                outcome = ("error", str(err))
            finally:
                self.ctx.load_random_state(streams)
        kind, value = self.comm.bcast(outcome, root=0)
        if kind == "error":
            raise ConfigError(value)
        return value

    def _chunks(self, whole: Sequential) -> list[_Chunk]:
        """This rank's model chunks (virtual stages ``c p + s``), with the shapes they receive."""
        shapes = sample_shapes(whole, self.xp.zeros((1, *self.ctx.data().input_shape), dtype=self.dtype))
        bounds = np.cumsum([0, *self.partition.balance]).tolist()
        count = len(self.partition.balance)
        chunks = []
        for c in range(self.schedule.chunks):
            v = self.schedule.virtual(self.s, c)
            a, b = bounds[v], bounds[v + 1]
            model = whole[a:b]
            if v > 0:  # the model's first layers skip their input gradient: here one is sent back
                for layer in model:
                    layer.needs_input_grad = True
            chunks.append(_Chunk(
                model, v, count, (self.batch, *shapes[a]), (self.batch, *shapes[b]),
                make_exchange("allreduce", self.replicas, model.parameters()),
            ))  # fmt: skip
        return chunks

    # -- a step ------------------------------------------------------------------------------
    def step(self, step: int) -> StepStats:
        """This stage's operations of the schedule on the step's m microbatches, then its update."""
        indices = self.batches.next()
        parts = np.split(indices, self.m)
        lr = self.lr(step)
        run = _StepRun(self, parts)
        t_start = wtime()
        for i, op in enumerate(self.ops):
            run.post(i + LOOKAHEAD)
            if op.kind == "F":
                run.forward(self.chunks[op.chunk], op.microbatch)
            else:
                run.backward(self.chunks[op.chunk], op.microbatch)
            run.poll_sends()  # completed sends let their buffers go (and MPI progresses them)
        t_ops = wtime()
        run.finish_sends()
        self._note["phase"] = "update"
        for chunk in self.chunks:
            chunk.exchange.exchange()  # the sum over microbatches, averaged
        if self.optimizer is not None:
            self.optimizer.lr = lr
            self.optimizer.step()
        span = t_ops - t_start
        return StepStats(
            loss=run.loss if self.last else math.nan,
            correct=run.correct,
            samples=len(indices) if self.last else 0,
            lr=lr,
            comm_s=run.comm_s,
            exposed_s=run.comm_s,
            bytes_sent=self.bytes_sent,
            series={
                "span": span,  # the meeting turns it into the bubble
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
        return mean_over_members(self.ctx.comm, stats, stop, 1, self._agree)

    def evaluate(self) -> tuple[float, float]:
        """The whole test set through the (virtual) stages, ``EVAL_BATCH`` images a message; the
        last stage's accuracy and loss on every rank (collective)."""
        data, xp, dtype = self.ctx.data(), self.xp, self.dtype
        loss_fn = SoftmaxCrossEntropy()
        n = len(data.y_test)
        correct, loss_sum = 0, 0.0
        self.model.eval()
        try:
            for start in range(0, n, EVAL_BATCH):
                count = min(EVAL_BATCH, n - start)
                for chunk in self.chunks:
                    if chunk.first:
                        x = xp.asarray(data.x_test[start : start + count], dtype=dtype)
                    else:
                        x = xp.empty((count, *chunk.in_shape[1:]), dtype=dtype)
                        self.comm.Recv(x, source=(self.s - 1) % self.p, tag=_EVAL)
                    y = chunk.model.forward(x)
                    if not chunk.last:
                        y = xp.ascontiguousarray(y)
                        synchronize(y)  # a GPU buffer must be ready before MPI reads it
                        self.comm.Send(y, dest=(self.s + 1) % self.p, tag=_EVAL)
                        continue
                    labels = xp.asarray(data.y_test[start : start + count])
                    loss_sum += loss_fn.forward(y, labels) * count
                    correct += int(to_numpy(y.argmax(axis=1) == labels).sum())
        finally:
            self.model.train()
        result = (correct / max(1, n), loss_sum / max(1, n)) if self.last else None
        acc, loss = self.comm.bcast(result, root=self.p - 1)
        return float(acc), float(loss)

    # -- checkpoints -------------------------------------------------------------------------
    def state(self, pieces: bool) -> RankState:
        """This stage's slice and optimizer state (its piece), BatchNorm statistics, streams, counters."""
        part = RankState(
            arrays={name: to_numpy(b).copy() for name, b in self.model.named_buffers()},
            meta={"random": self.ctx.random_state(), "sampler": self.sampler.state(),
                  "pipeline": {"bytes_sent": self.bytes_sent}},
        )  # fmt: skip
        if pieces:
            piece = model_piece(self.model, self.optimizer)
            piece["meta"]["partition"] = self._cut()  # checked on resume by rank 0, for every stage
            part.pieces[f"stage {self.s}"] = piece
        return part

    def _cut(self) -> dict[str, Any]:
        """How the model is cut and scheduled: what a checkpoint's stages must agree with."""
        return {"balance": list(self.partition.balance), "chunks": self.schedule.chunks}

    def load_state(self, state: RankState) -> None:
        """Put the stage, its optimizer, the sampler position, the streams and counters back.

        Raises:
            ConfigError: the checkpoint's stage holds other layers than this one.
        """
        self.check_state(state.pieces)
        load_model_piece(self.model, self.optimizer, state.pieces[f"stage {self.s}"], state.arrays)
        self.sampler.load_state(state.meta["sampler"])
        self.ctx.load_random_state(state.meta["random"])
        self.bytes_sent = int(state.meta["pipeline"]["bytes_sent"])
        self.batches.restart()

    def check_state(self, pieces: dict[str, dict[str, Any]]) -> None:
        """Refuse a checkpoint cut otherwise (another partition, chunks per stage or model).

        Rank 0 sees every stage's piece (before anything is loaded), the others their own.
        A partition worked out by profiling (``balance = "time"`` without ``pipeline.profile``)
        may cut otherwise after a restart: the message names the cut to resume with.

        Raises:
            ConfigError: naming the two cuts, or up to three parameters that differ.
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
        diff = differing_parameters(self.model, pieces.get(f"stage {self.s}", {}).get("params", {}))
        if diff:
            raise ConfigError(
                f"its stage {self.s} holds other layers (another partition or model; parameters differ: "
                f"{diff} ...)"
            )

    def close(self) -> None:
        """Free the communicators it made (collective)."""
        self.replicas.Free()
        self.comm.Free()


#: tag of evaluation messages (training's: 2 (v m + k) for the activations of microbatch k into
#: virtual stage v, 2 (v m + k) + 1 for the gradient coming back into it)
_EVAL = 2**15 - 1


@dataclass
class _Chunk:
    """A model chunk a rank holds: virtual stage ``index`` of ``count``, with its own exchange.

    Attributes:
        model: its layers.
        index: its virtual stage (its place in the model's order).
        count: the virtual stages of the pipeline.
        in_shape: a microbatch's input to it.
        out_shape: its output for a microbatch.
        exchange: sums its microbatches' gradients (a backward overwrites ``.grad`` of its
            layers only, so each chunk keeps its own sum).
    """

    model: Sequential
    index: int
    count: int
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    exchange: Any
    backwards: int = 0  # this step's backwards so far

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1


def _holding(layers: list[tuple[str, Any]]) -> Sequential:
    """A container of a rank's chunks' layers under their own names (never run as a whole)."""
    names, modules = zip(*layers)
    return Sequential(list(modules), names=list(names))


class _StepRun:
    """One step of one stage: the microbatches' caches, receives in flight, sends, the tallies."""

    def __init__(self, pipe: Pipeline, parts: list[np.ndarray]) -> None:
        self.pipe, self.parts = pipe, parts
        self.caches: dict[tuple[int, int], tuple[dict[str, Any], int]] = {}  # (chunk, k) -> (cache, bytes)
        self.grads: dict[int, Any] = {}  # the last stage: the loss gradient of each microbatch
        self.recvs: dict[tuple[str, int, int], tuple[Any, Any]] = {}  # (kind, chunk, k) -> request, buffer
        self.sends: list[tuple[Any, Any, float, int]] = []  # (request, buffer, posted, microbatch)
        self.posted = 0  # operations whose receive is posted
        self.loss, self.correct = 0.0, 0
        self.busy_s = self.comm_s = 0.0
        self.held_bytes = self.peak_bytes = self.held = self.peak_held = 0
        self.xp, self.dtype = pipe.xp, pipe.dtype
        self.m, self.prev, self.next = pipe.m, (pipe.s - 1) % pipe.p, (pipe.s + 1) % pipe.p
        for chunk in pipe.chunks:
            chunk.backwards = 0

    def post(self, upto: int) -> None:
        """Post the receives of the operations before index ``upto`` not yet posted."""
        pipe = self.pipe
        while self.posted < min(upto, len(pipe.ops)):
            op = pipe.ops[self.posted]
            self.posted += 1
            chunk, k = pipe.chunks[op.chunk], op.microbatch
            if op.kind == "F" and not chunk.first:
                buf = self.xp.empty(chunk.in_shape, dtype=self.dtype)
                req = pipe.comm.Irecv(buf, source=self.prev, tag=self.tag(chunk.index, k, grad=False))
            elif op.kind == "B" and not chunk.last:
                buf = self.xp.empty(chunk.out_shape, dtype=self.dtype)
                req = pipe.comm.Irecv(buf, source=self.next, tag=self.tag(chunk.index, k, grad=True))
            else:
                continue
            self.recvs[(op.kind, op.chunk, k)] = (req, buf)

    def tag(self, virtual: int, k: int, grad: bool) -> int:
        """The tag of microbatch k's activations into virtual stage ``virtual`` (``grad``: of the
        gradient coming back into it), unique within a step and below :data:`_EVAL`."""
        return 2 * (virtual * self.m + k) + int(grad)

    def received(self, kind: str, chunk: int, k: int) -> Any:
        """The buffer of a posted receive, once it has arrived (the wait is communication)."""
        req, buf = self.recvs.pop((kind, chunk, k))
        t0 = wtime()
        req.Wait()
        t1 = wtime()
        self.comm_s += t1 - t0
        if self.pipe.tracing:
            self.pipe.ctx.trace("recv", t0, t1, k)  # the part of the transfer it waited for
        return buf

    def send(self, y: Any, dest: int, tag: int, k: int) -> None:
        buf = y if y.flags.c_contiguous else self.xp.ascontiguousarray(y)
        synchronize(buf)  # a GPU buffer must be ready before MPI reads it
        self.sends.append((self.pipe.comm.Isend(buf, dest=dest, tag=tag), buf, wtime(), k))
        self.pipe.bytes_sent += int(buf.nbytes)

    def forward(self, chunk: _Chunk, k: int) -> None:
        pipe = self.pipe
        c = chunk.index // pipe.p
        if chunk.first:
            x = pipe.ctx.batch(self.parts[k])[0]
        else:
            x = self.received("F", c, k)
        pipe._note["phase"] = f"forward {k}"
        t0 = wtime()
        y = chunk.model.forward(x)
        if chunk.last:
            labels = pipe.ctx.labels(self.parts[k])
            self.loss += pipe.loss_fn.forward(y, labels) / self.m  # as sync's accumulation sums it
            self.correct += int(to_numpy(y.argmax(axis=1) == labels).sum())
            self.grads[k] = pipe.loss_fn.backward()
        t1 = wtime()
        self.busy_s += t1 - t0
        if pipe.tracing:
            pipe.ctx.trace("forward", t0, t1, k)
        cache = chunk.model.save_cache()
        size = cache_nbytes(cache)
        self.caches[(c, k)] = (cache, size)
        self.held += 1
        self.held_bytes += size
        self.peak_held = max(self.peak_held, self.held)
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)
        if not chunk.last:
            self.send(y, self.next, self.tag(chunk.index + 1, k, grad=False), k)

    def backward(self, chunk: _Chunk, k: int) -> None:
        pipe = self.pipe
        c = chunk.index // pipe.p
        gy = self.grads.pop(k) if chunk.last else self.received("B", c, k)
        cache, size = self.caches.pop((c, k))
        pipe._note["phase"] = f"backward {k}"
        t0 = wtime()
        chunk.model.load_cache(cache)
        gx = chunk.model.backward(gy)
        t1 = wtime()
        self.busy_s += t1 - t0
        if pipe.tracing:
            pipe.ctx.trace("backward", t0, t1, k)
        self.held -= 1
        self.held_bytes -= size
        chunk.backwards += 1
        if chunk.backwards < self.m:
            chunk.exchange.accumulate()  # layers overwrite .grad: the sum is kept there
        if not chunk.first:
            self.send(gx, self.prev, self.tag(chunk.index - 1, k, grad=True), k)

    def poll_sends(self) -> None:
        """Let the sends that have completed go (traced with ``log.trace``)."""
        pending = []
        for req, buf, posted, k in self.sends:
            if req.Test():
                if self.pipe.tracing:
                    self.pipe.ctx.trace("send", posted, wtime(), k)
            else:
                pending.append((req, buf, posted, k))
        self.sends = pending

    def finish_sends(self) -> None:
        t0 = wtime()
        waitall([req for req, *_ in self.sends])
        t1 = wtime()
        self.comm_s += t1 - t0
        if self.pipe.tracing:
            for _, _, posted, k in self.sends:
                self.pipe.ctx.trace("send", posted, t1, k)
        self.sends = []
