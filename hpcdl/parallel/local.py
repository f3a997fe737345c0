"""``parallel.strategy = "local"``: local steps, weights averaged every τ steps among the online ranks.

Every rank trains its own replica on its own shard (member r of N, the sampler sync uses) with
its own optimizer — SGD, Adam or K-FAC, the latter with no communication at all (its factors,
eigenbases and momentum are the rank's own: the "heterogeneous and outdated" curvature of
"Distributed K-FAC Over Unstable Networks") — and sends nothing per step. Every
``local.average_every = τ`` steps the ranks online at that step (:mod:`hpcdl.parallel.fault`)
meet in a *round*: they average their weights and BatchNorm running statistics with hpcdl's
bucketed allreduce (:class:`~hpcdl.comm.buckets.Buckets`, :class:`~hpcdl.comm.collectives.Collectives`)
over a communicator of exactly those ranks; ``kfac.average_factors = true`` averages K-FAC's
running factors too. Communicators are made with :func:`hpcdl.comm.subcomm` (only the members
call it, so an offline rank takes no part, in MPI and in the simulator alike), cached by the
online set and freed at :meth:`LocalAveraging.close`.

The data-parallel width is N and the learning-rate rule is sync's, so τ = 1 with no faults is
sync up to rounding: averaging the weights after N SGD (or momentum) updates from equal
weights is the update with the averaged gradient, momentum being linear.

An offline rank trains alone and skips the rounds it misses. When it is back, at the next
round it attends after missing the previous one (it was offline at step ``s - τ``):

* ``local.rejoin = "average"`` (default): it contributes its own weights like any member;
* ``"adopt"``: it takes the group's average first — the returning members contribute zeros
  and the sum is divided by the members that stayed (one allreduce: the group sends it the
  average as it averages); when every member is returning, all contribute.

**What the run file gets** beyond sync's: ``ranks/online`` (1 when the rank is online at the
step, 0 offline), ``ranks/divergence`` (at a round, each member's ``‖w_r − w̄‖ / ‖w̄‖`` before
averaging, ``w`` its weights and BatchNorm statistics and ``w̄`` the group's mean; NaN at
other steps and for the ranks not in the round) and ``metrics/group_size`` (the round's
members; NaN at the steps without a round). The fault model's figure
(:func:`hpcdl.parallel.fault.faults_figure`) draws them.

The ranks' driver meetings (the metrics' allreduce, the stop vote, checkpoints, evaluation)
are the experiment's bookkeeping, not modelled traffic: every rank takes part, offline or
not. The loss and accuracy rows are means over the ranks that trained (all of them).
**Evaluation** evaluates the mean of all N ranks' weights and BatchNorm statistics at that
step (offline ranks' included), computed into each rank's model for the evaluation only and
put back bit for bit after: evaluating changes no rank's weights. **Checkpoints** hold every
rank's replica (piece ``replica r``: weights and optimizer state), its BatchNorm statistics,
sampler and streams; the fault schedule is a pure function of the config, so a resume is
bitwise an uninterrupted run.

τ defaults to 4: the issue's centre point, and the FedAvg/local-SGD range (local SGD's
analyses and DiLoCo's small-scale settings average every few to tens of steps) where digits'
small MLP still trains to sync's accuracy at equal samples while skipping 3 of 4 exchanges.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from typing import Any

import numpy as np

from hpcdl import comm as ops  # ops.SUM resolved at use: importing this module starts no MPI
from hpcdl.comm import Communicator, subcomm, wtime
from hpcdl.comm.buckets import Buckets
from hpcdl.comm.collectives import Collectives
from hpcdl.comm.pack import Packer
from hpcdl.components import Declares, Key
from hpcdl.errors import ConfigError
from hpcdl.nn import Sequential, SoftmaxCrossEntropy, observe
from hpcdl.optim.kfac import KfacLayer, covered_layers
from hpcdl.parallel.common import forward_backward, mean_over_contributors
from hpcdl.parallel.conformance import Case, Conformance
from hpcdl.parallel.fault import FaultModel, fault_model
from hpcdl.parallel.fault import check as check_faults
from hpcdl.parallel.kfac import LocalUpdate
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
from hpcdl.parallel.sync import auto_attrs, auto_remarks, auto_table, keep_auto_table

__all__ = ["DECLARES", "LocalAveraging", "mean_of_replicas"]

#: steps between rounds, by default (module docstring)
DEFAULT_TAU = 4

#: the local strategy's config section
DECLARES = Declares(
    keys={
        "local.average_every": Key(
            int, DEFAULT_TAU, "local: steps between the online ranks' weight averaging (τ)", minimum=1
        ),
        "local.rejoin": Key(
            str,
            "average",
            "local: a rank back from an outage joins with its own weights (average) "
            "or first takes the group's average (adopt)",
            choices=("average", "adopt"),
        ),
    },  # fmt: skip
    fit_keys=("local.average_every", "local.rejoin"),
    metrics={"group_size": np.float64},
    series={"online": "online (1) or offline (0)", "divergence": "divergence from the round's mean"},
)


def sync_on_as_many_ranks(cfg: Any, world: int) -> tuple[dict[str, Any], int] | None:
    """With τ = 1 and no faults, ``local`` is sync data parallel on as many ranks."""
    if cfg["local.average_every"] != 1 or cfg["fault.p"] > 0 or cfg["fault.schedule"]:
        return None
    return {"parallel.strategy": "sync"}, world


def mean_of_replicas(pieces: Any, names: Sequence[str]) -> np.ndarray:
    """The model's parameters as one vector: the mean of every rank's replica (the model evaluated)."""
    replicas = [p["params"] for k, p in sorted(pieces.items()) if k.startswith("replica ")]
    vectors = [np.concatenate([np.asarray(r[n]).ravel() for n in names]) for r in replicas]
    return np.mean(vectors, axis=0)


class LocalAveraging(LockstepStrategy):
    """Local SGD / K-FAC with weights averaged every τ steps among the online ranks (module docstring).

    Args:
        ctx: the driver's run context.
    """

    name = "local"
    #: its section, and the exchange's keys its rounds read (bucket size, allreduce algorithm)
    keys = (
        "local.",
        "exchange.bucket_mb",
        "exchange.algorithm",
        "exchange.auto_table",
        "exchange.auto_threshold_kb",
        "exchange.auto_calibrate",
        "exchange.auto_cache",
    )
    faults = True
    declares = DECLARES
    rank_series = ("online", "divergence")
    cannot_honour = {
        "exchange.accumulate": "a local step is one batch per rank (raise data.batch_size instead)",
    }
    conformance = Conformance(
        {
            "local": Case({"local.average_every": 1}, reference=sync_on_as_many_ranks, tolerance=1e-10),
            "faults": Case({"local.average_every": 2, "fault.p": 0.3, "fault.max_duration": 3}),
            "adopt": Case({"local.average_every": 3, "local.rejoin": "adopt", "fault.p": 0.3}),
            # K-FAC's own factors in each replica's piece, averaged in the rounds
            "kfac": Case(
                {
                    "optimizer.name": "kfac",
                    "optimizer.lr": 0.02,
                    "kfac.inv_every": 2,
                    "kfac.average_factors": True,
                    "local.average_every": 2,
                    "fault.p": 0.3,
                }
            ),
            # BatchNorm statistics averaged in the rounds, each rank's dropout stream, Adam's moments
            "batchnorm": Case(
                {
                    "model.name": "cnn",
                    "model.channels": 4,
                    "model.dropout": 0.3,
                    "optimizer.name": "adam",
                    "optimizer.lr": 0.003,
                    "fault.p": 0.3,
                }
            ),
        },
        parameters=mean_of_replicas,
    )

    @classmethod
    def plan(cls, cfg: Any, world: int) -> Placement:
        """Every rank a worker holding its own replica; rank r reads member r's batches.

        Raises:
            ConfigError: the ``[fault]`` keys do not fit ``world`` ranks.
        """
        check_faults(cfg, world)
        ranks = tuple(RankPlace("worker", f"replica {r}", r) for r in range(world))
        tau = cfg["local.average_every"]
        notes = (f"the online ranks average their weights every {tau} step{'s' * (tau > 1)} "
                 f"(local.rejoin = {cfg['local.rejoin']!r})",)  # fmt: skip
        return Placement(cls.name, ranks, cfg["data.batch_size"], notes=notes)

    @classmethod
    def memory(
        cls, cfg: Any, placement: Placement, probe: Any, test_size: int, eval_batch: int
    ) -> list[RankMemory]:
        """Every rank: the model, its gradients and optimizer state (K-FAC's factors and eigenbases
        too), the rounds' buckets (a packed copy of the weights), the evaluation's copy of its own
        weights, and one batch's activations or an evaluation's (of its share of the test set)."""
        nbytes, largest = probe.parameters()
        act = probe.activations()
        share = -(-test_size // placement.width)
        parts = {**model_parts(cfg, nbytes, largest), "rounds": nbytes if placement.world > 1 else 0,
                 "evaluation copy": nbytes if placement.world > 1 else 0}  # fmt: skip
        if cfg["optimizer.name"] == "kfac":
            dims = [KfacLayer(layer, layer.name).dims for layer in covered_layers(probe.model)]
            parts["kfac"] = probe.dtype.itemsize * sum(3 * (a * a + g * g) + a + g for a, g in dims)
        one = RankMemory(
            "worker",
            parts,
            tuple([(f, s, "a batch") for f, s in act.step] + evaluation(act, min(eval_batch, share))),
            cfg["data.batch_size"],
        )
        return [one] * placement.world

    def __init__(self, ctx: RunContext) -> None:
        super().__init__(ctx)
        cfg = ctx.cfg
        self.comm: Communicator = ctx.comm
        self.rank, self.world = ctx.rank, self.comm.Get_size()
        self.tau: int = cfg["local.average_every"]
        self.adopt = cfg["local.rejoin"] == "adopt"
        self.sampler = ctx.sampler(ctx.placement.ranks[self.rank].member)
        self.batches = Batches(self.sampler)
        self.model: Sequential = ctx.build_model()
        self.lr = ctx.schedule()
        self.optimizer = ctx.optimizer(self.model.parameters(), self.model)
        if hasattr(self.optimizer, "clock"):
            self.optimizer.clock = wtime  # K-FAC's times on the world's clock (virtual in the simulator)
        self.update = LocalUpdate(self.optimizer)  # K-FAC too: every factor and eigenbasis the rank's own
        self.average_factors = bool(cfg["kfac.average_factors"]) and hasattr(self.optimizer, "layers")
        #: the schedule of outages (None: every rank always online)
        self.outages: FaultModel | None = fault_model(cfg, self.world, ctx.total_steps)
        self.loss_fn = SoftmaxCrossEntropy()
        # what a round averages: the parameters, then BatchNorm's floating statistics
        params = [p.data for p in self.model.parameters()]
        dtype = params[0].dtype
        self.arrays = params + [b for _, b in self.model.named_buffers() if b.dtype == dtype]
        self.bucket_bytes = round(cfg["exchange.bucket_mb"] * 2**20) or None  # 0: one bucket
        self.buckets = Buckets(self.arrays, self.bucket_bytes)
        self._factor_buckets: Buckets | None = None
        self.algorithm: str = cfg["exchange.algorithm"]  # sync's choice of allreduce, for the rounds
        rounds = tuple(sorted({self.buckets.plan.nbytes(b) for b in range(len(self.buckets))}))
        #: the table ``auto`` picks each round's algorithm from (calibrated at the rounds' sizes on all
        #: the ranks; a smaller online set takes it too), None without auto
        self.auto = None if self.world < 2 or self.algorithm != "auto" else auto_table(cfg, self.comm, rounds)
        #: online set -> (its communicator, hpcdl's collectives over it), made at its first round
        self.groups: dict[tuple[int, ...], tuple[Communicator, Collectives]] = {}
        self.rounds = 0  # rounds this rank attended
        self.done = 0  # steps done
        self.bytes_sent = 0
        self.divergence = float("nan")  # this rank's at the last round it attended
        self._agree = np.zeros(10)
        if self.world > 1:  # rank 0's weights, whatever the others built (as sync)
            packer = Packer(params)
            buf = packer.pack(params)
            self.comm.Bcast(buf, root=0)
            packer.unpack(buf, params)

    # -- a step ------------------------------------------------------------------------------
    def online(self, step: int) -> tuple[int, ...]:
        """The ranks online at step ``step`` (0-based)."""
        return self.outages.online(step) if self.outages is not None else tuple(range(self.world))

    def meets_after(self, step: int) -> bool:
        """The ranks meet (metrics, stop vote) after each round's step."""
        return step % self.tau == 0

    def step(self, step: int) -> StepStats:
        """Batch → forward/backward → this rank's own update; after every τ-th step, the round."""
        self.done = step + 1
        indices = self.batches.next()
        self.optimizer.lr = self.lr(step)
        x, y = self.ctx.batch(indices)
        observer = self.update.observer
        with observe(observer) if observer is not None else nullcontext():
            loss, correct = forward_backward(self.model, self.loss_fn, x, y)
        self.update.step()
        comm_s = 0.0
        self.divergence = float("nan")
        if self.round_after(step):
            t0 = wtime()
            self.average(step)
            comm_s = wtime() - t0
        series = {"online": float(self.rank in self.online(step)), "divergence": self.divergence}
        return StepStats(loss=loss, correct=correct, samples=len(indices), lr=self.optimizer.lr,
                         comm_s=comm_s, exposed_s=comm_s, bytes_sent=self.bytes_sent,
                         series=series)  # fmt: skip

    def round_after(self, step: int) -> bool:
        """Whether a round follows step ``step`` (every τ-th, with more than one rank)."""
        return (step + 1) % self.tau == 0 and self.world > 1

    def contributors(self, step: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The round after step ``step``: its members (the online ranks) and those whose weights are
        averaged (all of them, or with ``adopt`` those that did not miss the previous round)."""
        members = self.online(step)
        if not self.adopt or step < self.tau:
            return members, members
        stayed = tuple(r for r in members if r in self.online(step - self.tau))
        return members, stayed or members

    def average(self, step: int) -> None:
        """The round after step ``step`` (collective over the online ranks; others return at once)."""
        members, contributors = self.contributors(step)
        if self.rank not in members:
            return
        self.rounds += 1
        if len(members) == 1:
            self.divergence = 0.0
            return  # alone: its average is its own weights
        sub, coll = self._group(members)
        mine = self.rank in contributors
        self.divergence = self._allreduce(self.buckets, self.arrays, coll, mine, len(contributors),
                                          len(members), diverge=True)  # fmt: skip
        if self.average_factors:
            factors = [f for e in self.optimizer.layers for f in (e.A, e.G)]
            if all(f is not None for f in factors):  # the same on every rank: all step alike
                if self._factor_buckets is None:
                    self._factor_buckets = Buckets(factors, self.bucket_bytes)
                self._allreduce(self._factor_buckets, factors, coll, mine, len(contributors), len(members))

    def _allreduce(self, buckets: Buckets, arrays: list[Any], coll: Collectives, mine: bool,
                   contributors: int, members: int, diverge: bool = False) -> float:  # fmt: skip
        """Sum ``arrays`` over the group bucket by bucket (zeros from a non-contributor), then scale.

        Returns:
            With ``diverge``, ``‖own − mean‖ / ‖mean‖`` of the arrays before the round; else NaN.
        """
        reqs, own = [], []
        for b in range(len(buckets)):
            buf = buckets.pack_bucket(b, arrays)
            if diverge:
                own.append(buf.copy())
            if not mine:
                buf[...] = 0
            reqs.append(coll.Iallreduce(buf, buf))
            self.bytes_sent += 2 * buf.nbytes * (members - 1) // members  # a ring's bytes sent
        for r in reqs:
            r.Wait()
        apart = norm = 0.0
        for b in range(len(buckets)):
            total = buckets.buffer(b)
            if diverge:
                mean = total / contributors
                apart += float(((own[b] - mean) ** 2).sum())
                norm += float((mean**2).sum())
            buckets.unpack_bucket(b, total, arrays, 1.0 / contributors)
        return (apart / norm) ** 0.5 if diverge and norm > 0 else float("nan")

    def _group(self, members: tuple[int, ...]) -> tuple[Communicator, Collectives]:
        """The communicator of ``members`` and its collectives, made at their first round (members only)."""
        got = self.groups.get(members)
        if got is None:
            sub = subcomm(self.comm, members)
            got = (sub, Collectives(sub, self.algorithm, auto=self.auto))
            self.groups[members] = got
        return got

    # -- meetings ----------------------------------------------------------------------------
    def agree(self, stats: Sequence[StepStats], stop: bool) -> Agreement:
        """The steps' mean loss and batch accuracy over the ranks, and the stop votes: one allreduce;
        each step's round size from the schedule (every rank knows it)."""
        agreed = mean_over_contributors(self.comm, stats, stop, self._agree)
        for step, row in zip(range(self.done - len(stats), self.done), agreed.rows):
            row["group_size"] = float(len(self.online(step))) if self.round_after(step) else float("nan")
        return agreed

    def evaluate(self) -> tuple[float, float]:
        """The mean of all ranks' weights and BatchNorm statistics on the whole test set (sharded
        over the ranks); every rank's own weights are put back unchanged afterwards."""
        if self.world == 1:
            return self.ctx.evaluate(self.model, self.comm)
        packer = Packer(self.arrays)
        own = packer.pack(self.arrays).copy()
        total = np.empty_like(own)
        self.comm.Allreduce(own, total, op=ops.SUM)
        packer.unpack(total, self.arrays, scale=1.0 / self.world)
        try:
            return self.ctx.evaluate(self.model, self.comm)
        finally:
            packer.unpack(own, self.arrays)

    # -- checkpoints -------------------------------------------------------------------------
    def run_attrs(self) -> dict[str, Any]:
        """The ``auto`` table the rounds pick their algorithms from (``auto_table``, JSON)."""
        return auto_attrs(self)

    def remarks(self) -> list[str]:
        """How the rounds' ``auto`` table was made (calibrated, from the cache)."""
        return auto_remarks(self)

    def serialize(self, s: Serializer) -> None:
        """This rank's replica and optimizer state (a piece of its own), its BatchNorm statistics,
        sampler position, random streams and counters."""
        s.piece(f"replica {self.rank}", model=self.model, optimizer=self.optimizer,
                meta={"outages": self._outages_digest(self.done)}, check=self._check_outages)  # fmt: skip
        s.own_buffers(self.model)
        s.random(self.ctx)
        s.stateful("sampler", self.sampler)
        keep_auto_table(s, self, self.ctx.cfg, self.comm)
        counters = s.value(
            "local", {"rounds": self.rounds, "bytes_sent": self.bytes_sent, "steps": self.done}
        )
        self.rounds, self.bytes_sent = int(counters["rounds"]), int(counters["bytes_sent"])
        self.done = int(counters["steps"])
        if s.loading:
            self.batches.restart()

    def _outages_digest(self, steps: int) -> dict[str, Any]:
        """The schedule's first ``steps`` rows, digested: what a checkpoint's outages must agree with
        (the fit keys name a schedule file, not its contents)."""
        table = np.zeros((steps, self.world), dtype=bool)
        if self.outages is not None:
            known = self.outages.offline[:steps]
            table[: len(known)] = known
        digest = hashlib.sha256(np.packbits(table).tobytes() + f"{steps},{self.world}".encode()).hexdigest()
        return {"steps": steps, "digest": digest[:16]}

    def _check_outages(self, pieces: Mapping[str, Mapping[str, Any]]) -> None:
        """Refuse a checkpoint written under another fault schedule up to its step (a schedule file
        whose contents changed).

        Raises:
            ConfigError: naming the file.
        """
        for piece in pieces.values():
            theirs = piece.get("meta", {}).get("outages")
            if theirs is not None and theirs != self._outages_digest(int(theirs["steps"])):
                raise ConfigError(
                    f"it was written under another fault schedule up to its step {theirs['steps']} "
                    f"(fault.schedule = {self.ctx.cfg['fault.schedule']!r} changed?): resume with the "
                    "schedule it ran with, or start a new run"
                )

    def close(self) -> None:
        """Free the online sets' communicators (collective over each set's members, in the order
        they were made: the same on every member, each made at the same round)."""
        for sub, coll in self.groups.values():
            coll.free()
            sub.Free()
        self.groups.clear()
