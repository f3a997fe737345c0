"""``parallel.strategy = "sync"``: synchronous data parallel, every rank a whole replica.

Each rank trains the whole model on its own shard of every global batch; during
backward its gradients are packed into buckets and summed with the other ranks' (the
``[exchange]`` keys: bucketed or one flat allreduce, compression, accumulation), and every
rank applies the same update. The ranks meet every step: the step's mean loss and the stop
vote travel in one small allreduce.

Under the instability model's ``fault.*`` keys (:mod:`hpcdl.parallel.fault`) sync is the
baseline that cannot leave a rank out: a rank offline at a step holds back its gradients for
a step's time before its exchange finishes, and the others wait in the collective
(:class:`~hpcdl.parallel.fault.HoldBack`); the trajectory is the fault-free run's, the time
is not. ``ranks/online`` and ``ranks/held_s`` record the schedule and the holds.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

import numpy as np

from hpcdl.comm import Communicator, notes
from hpcdl.comm.buckets import plan_buckets
from hpcdl.comm.collectives.auto import AutoTable, load_table_bcast
from hpcdl.comm.collectives.tune import tuned_table
from hpcdl.comm.pack import wire_dtype
from hpcdl.errors import ConfigError
from hpcdl.nn import Sequential, SoftmaxCrossEntropy, observe
from hpcdl.nn.parameter import Parameter
from hpcdl.optim.kfac import KfacLayer, covered_layers
from hpcdl.parallel import GradientExchange, make_exchange
from hpcdl.parallel.common import forward_backward, mean_over_contributors
from hpcdl.parallel.conformance import Case, Conformance
from hpcdl.parallel.fault import HoldBack, fault_model
from hpcdl.parallel.fault import check as check_faults
from hpcdl.parallel.kfac import assign, grad_workers, make_update
from hpcdl.parallel.memory import RankMemory, evaluation, model_parts
from hpcdl.parallel.state import Serializer
from hpcdl.parallel.strategy import (
    Agreement,
    Batches,
    LockstepStrategy,
    Placement,
    RankPlace,
    RunContext,
    StepStats,
)
from hpcdl.parallel.switched import DECLARES as SWITCH_DECLARES
from hpcdl.parallel.switched import (
    SWITCH_ROLE,
    make_switch_exchange,
    switch_communicators,
    switch_memory,
    switch_note,
    switch_ranks,
)
from hpcdl.switch.ranklink import SwitchRank

__all__ = ["SyncDataParallel", "exchange_for"]


def one_process_on_the_global_batch(cfg: Any, world: int) -> tuple[dict[str, Any], int]:
    """The run sync data parallel on ``world`` ranks is equivalent to: one process taking the
    global batch (width x micro-steps x ``data.batch_size``) at once (the sampler deals a
    global batch's samples to the members in order)."""
    return {"data.batch_size": SyncDataParallel.plan(cfg, world).global_batch, "exchange.accumulate": 1}, 1


def the_int32_ring_on_the_workers(cfg: Any, world: int) -> tuple[dict[str, Any], int] | None:
    """The switch rank's run on ``world`` ranks is, bit for bit, the int32 ring's on its
    ``world - 1`` workers (the same power-of-two scale per bucket, exact integer sums); a ring of
    one worker sends nothing and quantises nothing, so it has none at 2 ranks."""
    if world < 3:
        return None
    ring = {"exchange.name": "bucketed", "exchange.compression": "int32", "exchange.algorithm": "ring"}
    return ring, world - 1


class SyncDataParallel(LockstepStrategy):
    """Synchronous data parallel (DDP, Horovod): N replicas, one global batch, one update.

    Args:
        ctx: the driver's run context.
    """

    name = "sync"
    keys = ("exchange.", "switch.")
    declares = SWITCH_DECLARES  # the [switch] section of exchange.name = "switch"
    faults = True  # an offline rank holds back its gradients; the others wait (module docstring)
    conformance = Conformance(
        {
            "sync": Case(reference=one_process_on_the_global_batch, tolerance=1e-10),
            # each rank's own BatchNorm statistics and dropout stream, Adam's moments
            "batchnorm": Case(
                {
                    "model.name": "cnn",
                    "model.channels": 4,
                    "model.dropout": 0.3,
                    "optimizer.name": "adam",
                    "optimizer.lr": 0.003,
                }  # fmt: skip
            ),
            # the last rank a switch summing the others' int32 buckets: the int32 ring's sums
            "switch-rank": Case(
                {"exchange.name": "switch", "exchange.switch": "rank"},
                reference=the_int32_ring_on_the_workers,
            ),
            # outages cost time, not samples: the trajectory is the fault-free run's
            "faults": Case(
                {"fault.p": 0.3, "fault.max_duration": 3, "fault.step_s": 0.001},
                reference=one_process_on_the_global_batch,
                tolerance=1e-10,
            ),
        }
    )

    @classmethod
    def plan(cls, cfg: Any, world: int) -> Placement:
        """Every rank a worker holding the whole model; rank r reads member r's batches.

        Raises:
            ConfigError: the ``[fault]`` keys do not fit ``world`` ranks.
        """
        aside = switch_ranks(cfg, world)  # the exchange's say: the switch rank is not a worker
        workers = world - aside
        check_faults(cfg, workers)
        ranks = tuple(RankPlace("worker", "model", r) for r in range(workers))
        ranks += (RankPlace(SWITCH_ROLE),) * aside
        notes = (switch_note(cfg, workers),) if aside else ()
        return Placement(cls.name, ranks, cfg["data.batch_size"], cfg["exchange.accumulate"], notes=notes)

    @classmethod
    def describe(cls, cfg: Any, placement: Placement, model: Any) -> list[str]:
        """K-FAC (``--plan``): each covered layer's factor sizes, its eigendecomposition's cost,
        the rank that decomposes it and its gradient workers (:mod:`hpcdl.parallel.kfac`)."""
        if cfg["optimizer.name"] != "kfac":
            return []
        n = placement.world
        k = grad_workers(cfg["kfac.grad_workers"], n)
        layers = covered_layers(model())
        dims = [KfacLayer(layer, layer.name).dims for layer in layers]
        costs = [float(a) ** 3 + float(g) ** 3 for a, g in dims]
        owner = assign(costs, n)
        per = n // k
        mode = "COMM-OPT" if k == n else "MEM-OPT" if k == 1 else "HYBRID"
        lines = [
            f"K-FAC: eigendecompositions by rank (largest d_A^3 + d_G^3 first, to the least-loaded rank); "
            f"{k} grad worker{'s' * (k > 1)} per layer of {n} ranks ({mode})",
            f"{'layer':<16}{'A':>7}{'G':>7}{'cost (d^3)':>14}  {'rank':>4}  grad workers",
        ]
        for layer, (a, g), cost, r in zip(layers, dims, costs, owner):
            workers = [x for x in range(n) if x % per == r % per]
            lines.append(f"{layer.name:<16}{a:>7}{g:>7}{cost:>14.3g}  {r:>4}  {_span(workers)}")
        return lines

    @classmethod
    def memory(
        cls, cfg: Any, placement: Placement, probe: Any, test_size: int, eval_batch: int
    ) -> list[RankMemory]:
        """Every rank: the model, its gradients, the optimizer's state, the exchange's buffers (the
        flat allreduce: a packed copy and the sum; bucketed: the buckets in the wire format and as
        much for the collectives' rounds; accumulation: the kept sum), and one micro-step's
        activations or an evaluation's (of its share of the test set); K-FAC's factors, the
        step's factors and the eigenbases of every covered layer (a rank holds all of them
        while a checkpoint is written)."""
        nbytes, largest = probe.parameters()
        act = probe.activations()
        exchange = 0
        if placement.world > 1:
            if cfg["exchange.name"] in ("bucketed", "switch"):
                itemsize = probe.dtype.itemsize
                exchange = 2 * nbytes * wire_dtype(_wire_mode(cfg), probe.dtype).itemsize // itemsize
            else:
                exchange = 2 * nbytes
        if placement.micro_steps > 1:
            exchange += nbytes
        share = -(-test_size // placement.width)  # the test images one rank evaluates
        parts = {**model_parts(cfg, nbytes, largest), "exchange": exchange}
        if cfg["optimizer.name"] == "kfac":  # running and batch factors, eigenbases (every layer's, at worst)
            dims = [KfacLayer(layer, layer.name).dims for layer in covered_layers(probe.model)]
            parts["kfac"] = probe.dtype.itemsize * sum(3 * (a * a + g * g) + a + g for a, g in dims)
        one = RankMemory(
            "worker",
            parts,
            tuple([(f, s, "a batch") for f, s in act.step] + evaluation(act, min(eval_batch, share))),
            cfg["data.batch_size"],
            hint="(and raise exchange.accumulate by as much to keep the global batch)",
        )
        workers = [p for p in placement.ranks if p.role != SWITCH_ROLE]
        return [one] * len(workers) + [switch_memory(cfg, placement.width)] * (placement.world - len(workers))

    def __init__(self, ctx: RunContext) -> None:
        super().__init__(ctx)
        self.comm = ctx.comm
        self.micro_steps = ctx.placement.micro_steps
        #: the switch rank's serving loop (exchange.switch = "rank"), None on a worker
        self.switch: SwitchRank | None = None
        self._links: Communicator | None = None
        if ctx.placement.width < ctx.placement.world:  # the exchange set the switch rank aside
            self._links, self.comm, self.switch = switch_communicators(ctx.cfg, ctx.comm, ctx.placement)
        self._note = notes()  # what this rank does, for the stall watchdog's reports
        self._agree = np.zeros(10)  # mean_over_contributors: 2 (4 k + 1) for a meeting of k = 1 step
        self.model: Sequential = ctx.build_model()  # the switch rank's is never trained
        if self.switch is not None:  # it reads no batches, holds no piece: it serves each step
            return
        self.sampler = ctx.sampler(ctx.placement.ranks[ctx.rank].member)
        self.lr = ctx.schedule()
        self.optimizer = ctx.optimizer(self.model.parameters(), self.model)
        self.exchange = exchange_for(ctx.cfg, self.comm, self.model, links=self._links)
        # the optimizer's slot after the exchange: its own communication (K-FAC's), then its update
        self.update = make_update(self.optimizer, self.comm, ctx.cfg)
        self.exchange.broadcast_parameters(root=0)  # rank 0's weights, whatever the others built
        if ctx.cfg["log.trace"] and hasattr(self.exchange, "tracer"):
            self.exchange.tracer = ctx.trace  # the buckets' pack, wait and unpack on the timeline
        self.loss_fn = SoftmaxCrossEntropy()
        self.batches = Batches(self.sampler)
        outages = fault_model(ctx.cfg, self.comm.Get_size(), ctx.total_steps)
        #: under faults, this rank's holds (None: no faults); its series go to ranks/
        self.holdback = HoldBack(outages, ctx.rank, ctx.cfg["fault.step_s"]) if outages else None
        if self.holdback is not None:
            self.rank_series = ("online", "held_s")

    # -- a step ------------------------------------------------------------------------------
    def step(self, step: int) -> StepStats:
        """Batch -> forward/backward per micro-step (buckets summed during backward) -> exchange -> update.

        The switch rank serves the step's datagrams until every worker is done with them."""
        if self.switch is not None:
            self._note["phase"] = "switch rank: summing the workers' buckets"
            before = self.switch.busy_s
            self.switch.serve_step()
            return StepStats(comm_s=self.switch.busy_s - before, exposed_s=self.switch.busy_s - before)
        if self.holdback is not None:
            self.holdback.begin(step)
        indices = self.batches.next()
        self.optimizer.lr = self.lr(step)
        comm_before, exposed_before = self.exchange.comm_time, self.exchange.exposed_time
        loss, correct = 0.0, 0
        optimizer = self.update.observer
        for m, part in enumerate(np.split(indices, self.micro_steps)):
            x, y = self.ctx.batch(part)
            last = m == self.micro_steps - 1  # the exchange observes only the last backward
            with (
                observe(optimizer) if optimizer is not None else nullcontext(),
                observe(self.exchange) if last and hasattr(self.exchange, "after") else nullcontext(),
            ):
                micro_loss, micro_correct = forward_backward(self.model, self.loss_fn, x, y)
            if not last:
                self.exchange.accumulate()
            loss += micro_loss / self.micro_steps
            correct += micro_correct
        series: dict[str, float] = {}
        if self.holdback is not None:
            self._note["phase"] = "offline (fault.*): holding back the gradients"
            series = {"online": float(self.holdback.online(step)), "held_s": self.holdback.hold(step)}
        self._note["phase"] = "gradient exchange"
        self.exchange.exchange()  # with buckets in flight since backward: only what is left
        self._note["phase"] = "optimizer step"
        self.update.step()
        if self.holdback is not None:
            self.holdback.end(step, self.exchange.comm_time - comm_before)
        return StepStats(
            loss=loss,
            correct=correct,
            samples=len(indices),
            lr=self.optimizer.lr,
            comm_s=self.exchange.comm_time - comm_before,
            exposed_s=self.exchange.exposed_time - exposed_before,
            bytes_sent=self.exchange.bytes_sent,
            series=series,
        )

    def run_attrs(self) -> dict[str, Any]:
        """The ``auto`` table the exchange picks its algorithms from (``auto_table``, JSON)."""
        return auto_attrs(self.exchange) if self.switch is None else {}

    def remarks(self) -> list[str]:
        """How the exchange's ``auto`` table was made (calibrated, from the cache)."""
        return auto_remarks(self.exchange) if self.switch is None else []

    # -- meetings ----------------------------------------------------------------------------
    def agree(self, stats: Sequence[StepStats], stop: bool) -> Agreement:
        """The step's mean loss and batch accuracy over the ranks, and the stop votes: one allreduce."""
        return mean_over_contributors(self.ctx.comm, stats, stop, self._agree)

    def evaluate(self) -> tuple[float, float]:
        """The whole test set, sharded over the workers (each with its own BatchNorm statistics);
        a switch rank is told the result."""
        if self.switch is None:
            result = self.ctx.evaluate(self.model, self.comm)
        if self._links is None:
            return result
        return self.ctx.comm.bcast(result if self.switch is None else None, root=0)

    # -- checkpoints -------------------------------------------------------------------------
    def serialize(self, s: Serializer) -> None:
        """The model and optimizer (the piece every rank holds alike), BatchNorm statistics, the
        sampler's position, the random streams and the exchange's counters."""
        if self.switch is not None:  # the switch rank: its random streams only (its slots start afresh)
            s.random(self.ctx)
            return
        if s.saving:
            self.update.gather()  # rank 0 writes the piece: what the optimizer spread goes there
        s.piece("model", model=self.model, optimizer=self.optimizer)
        s.own_buffers(self.model)
        s.random(self.ctx)
        s.stateful("sampler", self.sampler)
        ex = self.exchange
        keep_auto_table(s, ex, self.ctx.cfg, self.comm)
        counters = s.value("exchange", {"bytes_sent": ex.bytes_sent, "comm_time": ex.comm_time,
                                        "exposed_time": ex.exposed_time})  # fmt: skip
        ex.bytes_sent, ex.comm_time = int(counters["bytes_sent"]), float(counters["comm_time"])
        ex.exposed_time = float(counters["exposed_time"])
        if s.loading:
            self.batches.restart()

    def close(self) -> None:
        """Free the exchange's and the optimizer's communicators, and the switch's (collective)."""
        if self.switch is None:
            self.update.close()
            self.exchange.free()
        if self._links is not None:
            self.comm.Free()
            self._links.Free()


def __getattr__(name: str) -> Any:
    if name in ("forward_backward", "mean_over_members"):  # moved: every strategy's (hpcdl.parallel.common)
        import warnings  # noqa: PLC0415

        from hpcdl.parallel import common  # noqa: PLC0415

        warnings.warn(f"hpcdl.parallel.sync.{name} is in hpcdl.parallel.common now", DeprecationWarning,
                      stacklevel=2)  # fmt: skip
        if name == "forward_backward":
            return common.forward_backward
        return lambda comm, stats, stop, width, buf=None: common.mean_over_contributors(comm, stats, stop)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _span(ranks: list[int]) -> str:
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks)) if len(ranks) <= 8 else f"{ranks[0]}, {ranks[1]}, ... ({len(ranks)})"


def exchange_for(
    cfg: Any, comm: Communicator, model: Sequential, links: Communicator | None = None
) -> GradientExchange:
    """The config's gradient exchange (``[exchange]``) over the model's parameters.

    Args:
        cfg: the config.
        comm: the workers.
        model: this worker's model.
        links: the switch rank's communicator (``exchange.switch = "rank"``), else None.

    Raises:
        ConfigError: compression asked of the flat allreduce exchange; a switch key it cannot honour.
    """
    if cfg["exchange.name"] == "switch":  # one worker too: its sums are quantised as W workers' are
        return make_switch_exchange(cfg, comm, model.parameters(), links=links)
    options: dict[str, Any] = {}
    if cfg["exchange.name"] == "bucketed":
        narrow = cfg["exchange.compression"] in ("float16", "bfloat16")  # summed by widening: no auto
        sizes = () if narrow else bucket_sizes(model.parameters(), cfg["exchange.bucket_mb"], _wire_mode(cfg))
        options = {
            "bucket_mb": cfg["exchange.bucket_mb"],
            "algorithm": cfg["exchange.algorithm"],
            "auto": auto_table(cfg, comm, sizes if cfg["exchange.algorithm"] == "auto" else ()),
            "compression": cfg["exchange.compression"],
            "int32_scale": cfg["exchange.int32_scale"],
            "in_place": cfg["exchange.in_place"],
        }
    elif cfg["exchange.compression"] != "none" and comm.Get_size() > 1:
        raise ConfigError(
            f"exchange.compression = {cfg['exchange.compression']!r} needs exchange.name = 'bucketed' "
            f"(the flat {cfg['exchange.name']!r} exchange sends the gradients' own dtype)"
        )
    return make_exchange(
        cfg["exchange.name"], comm, model.parameters(), debug=cfg["exchange.debug"], **options
    )


def _wire_mode(cfg: Any) -> str:
    """The buckets' packing mode for ``exchange.compression`` (the switch's: int32)."""
    if cfg["exchange.name"] == "switch":
        return "int32"
    return "plain" if cfg["exchange.compression"] == "none" else cfg["exchange.compression"]


def bucket_sizes(params: Sequence[Parameter], bucket_mb: float, mode: str) -> tuple[int, ...]:
    """The distinct sizes in bytes of the buckets ``params``' gradients fill (in ``mode``'s wire
    format): the messages a bucketed exchange sends."""
    if not params:
        return ()
    itemsize = wire_dtype(mode, np.dtype(params[0].dtype)).itemsize
    plan = plan_buckets([p.size for p in params], int(bucket_mb * 2**20) or None, itemsize)  # as the exchange
    return tuple(sorted({plan.nbytes(b) for b in range(len(plan))}))


def auto_table(cfg: Any, comm: Communicator, sizes: Sequence[int] = ()) -> AutoTable:
    """The table ``exchange.algorithm = "auto"`` chooses from (collective; every rank the same):
    the threshold rule; a named file (rank 0 reads it); at 2 ranks or more, the run's own
    calibration at ``sizes`` (``exchange.auto_calibrate``: :mod:`hpcdl.comm.collectives.tune`;
    what it has to say is in the table's ``meta["notes"]``: :func:`auto_remarks`); else the
    packaged table.
    """
    if cfg["exchange.auto_threshold_kb"] > 0:
        return AutoTable.threshold(round(cfg["exchange.auto_threshold_kb"] * 1024))
    mode = cfg["exchange.auto_calibrate"]
    if cfg["exchange.auto_table"] or mode == "never" or not sizes or comm.Get_size() < 2:
        return load_table_bcast(comm, cfg["exchange.auto_table"] or None)
    return tuned_table(comm, sizes, mode=mode, cache=cfg["exchange.auto_cache"] or None).table


def keep_auto_table(
    s: Serializer, exchange: Any, cfg: Any, comm: Communicator, key: str = "auto_table"
) -> None:
    """The exchange's ``auto`` table in each checkpoint; a resume puts back the one its run started
    with (another algorithm would sum in another order). A checkpoint from before tables were
    recorded gets what such runs used: the config's table, uncalibrated (collective then)."""
    table = getattr(exchange, "auto", None)
    if table is None:
        return
    saved = s.value(key, table.to_dict(), missing=None)
    if s.loading:
        exchange.auto = AutoTable.from_dict(saved) if saved is not None else auto_table(cfg, comm)


def auto_remarks(exchange: Any) -> list[str]:
    """What the calibration of the exchange's ``auto`` table has to say (:meth:`Strategy.remarks`):
    a cache ignored, the choice, the time it took (none for a table that was not calibrated);
    and the exchange's own remarks (node memory it could not have)."""
    table = getattr(exchange, "auto", None)
    if table is None:
        return []
    lines = [str(line) for meta in table.meta.values() for line in meta.get("notes", ())]
    return lines + list(getattr(exchange, "node_memory_notes", ()))


def auto_attrs(exchange: Any) -> dict[str, Any]:
    """What a run file records of the exchange's ``auto`` table (:meth:`Strategy.run_attrs`)."""
    table = getattr(exchange, "auto", None)
    return {} if table is None else {"auto_table": json.dumps(table.to_dict())}
