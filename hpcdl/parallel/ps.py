"""``parallel.strategy = "ps"``: parameter servers, asynchronous, bounded-staleness or synchronous.

Ranks ``0 .. S-1`` are servers (``ps.servers = S``); the other ``W = N - S`` ranks
are workers. The model's parameters, packed into one flat buffer in the model's order,
are cut into S contiguous shards balanced by bytes (:func:`~hpcdl.parallel.ps_plan.shard_plan`;
a shard may cut a tensor). Server k holds shard k of the master parameters and that
shard's optimizer state (the optimizers are elementwise, so a shard steps exactly as the
same elements of the whole model would). A worker pulls every shard, computes forward
and backward on its batch, pushes its gradient (packed by the Cython kernels) to every
server, and waits for the servers' replies, which are its next pull. A server applies
each push on arrival and counts its version (pushes applied).

**Units.** One step is one push of ``data.batch_size`` samples: ``train.steps``,
``checkpoint.every``, ``train.stop_at``, ``train.eval_every`` and the learning-rate
schedule count pushes applied (server 0's version); an epoch is as many pushes as
batches fit in the training set. Worker w samples as rank w of W.

**Modes** (``ps.mode``):

* ``async``: a server applies a push on arrival and answers it at once.
* ``ssp`` (``ps.staleness = s``): a worker's clock is its pushes applied; a server
  answers the push that brings worker w to clock c only when every worker's clock is
  ``>= c - s`` (:func:`~hpcdl.parallel.ps_plan.ssp_may_pull`). Every server sees every
  push and enforces the same gate; ``s = 0`` is bulk-synchronous through the servers.
* ``sync``: a server waits for the W pushes of a round, sums them in worker order, scales
  by ``1/W`` and applies once: sync data parallel's trajectory on the same batches. The
  round's W pushes are W steps; their ``tau`` is 0.

**Staleness** ``tau`` of a push, per shard: the server's version when applying it less
the version of the shard the worker computed it from. **Compensation**
(``ps.compensation``): ``lr`` divides the push's learning rate by ``max(tau, 1)``
(Zhang et al., IJCAI 2016); ``dc`` applies ``g + lambda g*g*(w_now - w_used)`` (DC-ASGD,
Zheng et al., ICML 2017; the server keeps the shard each worker was sent).

**BatchNorm.** Workers keep their own running statistics (docs/design.md, training
semantics). With each push a worker also sends server 0 its BatchNorm buffers: the master
copy's statistics are those of the worker whose push server 0 applied last; evaluations
and checkpoints use them.

**Meetings.** The ranks meet only at checkpoints, stops and the end, which the driver
asks for as a target step (:meth:`ParameterServer.run_until`). Server 0 grants pushes
until the target; a worker whose pull comes after it is told to stop, so the job
quiesces: no pull is answered past the target and every push in flight is applied. A
phase starts with every rank telling server 0 it is ready and server 0 telling the other
servers to start, so that in the simulator a phase's timeline is the same whatever the
ranks did before (a resumed run repeats an uninterrupted one). Server 0 evaluates the
master parameters each ``train.eval_every`` pushes (0: each epoch) without holding the
workers back: at the push that reaches the boundary every server snapshots its shard
(the others send theirs to server 0), and server 0 evaluates the snapshot one test batch
at a time between the messages it serves.

**Modules.** This one is the strategy the driver calls (:class:`ParameterServer`), which
hands each call to the role its rank has: :class:`~hpcdl.parallel.ps_server.PsServer` or
:class:`~hpcdl.parallel.ps_worker.PsWorker`. The settings, shard plan and SSP gate are in
:mod:`~hpcdl.parallel.ps_plan`, the message layout in :mod:`~hpcdl.parallel.ps_wire`, the
compensation arithmetic in :mod:`~hpcdl.parallel.ps_math`.

**The run file.** One row per push applied (server 0's): the pushing worker's loss and
batch accuracy; ``staleness/`` holds a row per push and shard (update, worker, server,
tau, time); ``ranks/pushes_per_s`` (workers) and ``ranks/busy_fraction`` (servers) are
each rank's figure over the phase the row belongs to.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hpcdl.comm import long_wait
from hpcdl.errors import ConfigError
from hpcdl.parallel import ps_wire as wire
from hpcdl.parallel.memory import RankMemory, evaluation, model_parts
from hpcdl.parallel.ps_math import compensated_lr, dc_gradient
from hpcdl.parallel.ps_plan import PsSettings, shard_plan
from hpcdl.parallel.ps_schema import CONFORMANCE, DECLARES
from hpcdl.parallel.ps_server import EVAL_PART, PsServer
from hpcdl.parallel.ps_worker import PsWorker
from hpcdl.parallel.state import Serializer
from hpcdl.parallel.strategy import (
    FreeRunningStrategy,
    PhaseAgreement,
    PhaseStats,
    Placement,
    RankPlace,
    RunContext,
    elementwise_only,
)

__all__ = ["ParameterServer", "PsSettings", "compensated_lr", "dc_gradient"]

_KEY = PsSettings.KEYS  # the config keys, named in messages


class ParameterServer(FreeRunningStrategy):
    """Parameter servers and workers (module docstring): the driver's seam, handing each call
    to this rank's role (:attr:`role`: a :class:`PsServer` or a :class:`PsWorker`).

    Args:
        ctx: the driver's run context.
    """

    name = "ps"
    conformance = CONFORMANCE
    keys = ("ps.",)
    declares = DECLARES
    cannot_honour = {
        "exchange.accumulate": "a push is one batch; raise data.batch_size instead",
        "exchange.compression": "pushes and replies carry the parameters' dtype uncompressed; "
        "set exchange.compression = 'none' (or use parallel.strategy = 'sync')",
    }
    rank_series = ("pushes_per_s", "busy_fraction")

    @classmethod
    def plan(cls, cfg: Any, world: int) -> Placement:
        """Ranks ``0 .. S-1`` servers holding shard k; the others workers, worker w reading member w.

        Raises:
            ConfigError: fewer than one server, or no rank left for a worker.
        """
        elementwise_only(cfg, cls.name, "splits the parameters into the servers' shards")
        ps = PsSettings.from_config(cfg)
        servers, sync = ps.servers, ps.mode == "sync"
        if servers < 1:
            raise ConfigError(
                f"{_KEY['servers']} = {servers}: a parameter server job needs at least 1 server"
            )
        if servers >= world:
            raise ConfigError(
                f"{_KEY['servers']} = {servers} on {world} rank{'s' * (world > 1)} leaves no worker: run on "
                f"at least {servers + 1} ranks (mpiexec -n {servers + 1}) or lower {_KEY['servers']}"
            )
        workers = world - servers
        if sync:
            for key in ("train.steps", "checkpoint.every", "train.stop_at", "train.eval_every"):
                if cfg[key] % workers:
                    below, above = cfg[key] // workers * workers, (cfg[key] // workers + 1) * workers
                    raise ConfigError(
                        f"{key} = {cfg[key]} is not a whole number of sync rounds of {workers} pushes: use "
                        f"{below or above} or {above}"
                    )
        ranks = [RankPlace("server", f"shard {k}") for k in range(servers)]
        ranks += [RankPlace("worker", "", w) for w in range(workers)]
        how = {
            "async": "async: pushes applied on arrival",
            "ssp": f"ssp: staleness bound s = {ps.staleness}",
            "sync": f"sync: the {workers} pushes of a round summed and applied once",
        }[ps.mode]
        notes_ = (f"parameter servers, {how}; compensation {ps.compensation}",)
        return Placement(
            cls.name, tuple(ranks), cfg["data.batch_size"], 1, notes_, step_batches=1,
            update_batches=workers if sync else 1, step_multiple=workers if sync else 1,
        )  # fmt: skip

    @classmethod
    def memory(
        cls, cfg: Any, placement: Placement, probe: Any, test_size: int, eval_batch: int
    ) -> list[RankMemory]:
        """Every rank builds the whole model (parameters, gradients, a packed copy). Server k: its
        shard, the shard's gradient and optimizer state, a push and a reply per worker (and a
        copy per worker for dc compensation); server 0 also a snapshot of the master copy and the
        evaluation. Worker: the pulled and pushed copies, one batch's activations."""
        ps = PsSettings.from_config(cfg)
        nbytes, _ = probe.parameters()
        act = probe.activations()
        itemsize = probe.dtype.itemsize
        bn = sum(int(b.nbytes) for _, b in probe.model.named_buffers())
        servers = ps.servers
        workers = placement.world - servers
        shards = shard_plan(nbytes // itemsize, servers, itemsize)
        copy = {"parameters": nbytes, "gradients": nbytes, "buffers": nbytes}  # the model, its packer
        out = []
        for k in range(servers):
            shard = shards.nbytes(k)
            own = model_parts(cfg, shard, shard)
            copies = 2 + (ps.compensation == "dc")  # a push, a reply (and what w was sent)
            per_worker = copies * shard + (bn if k == 0 else 0) + 2 * wire.HEAD_BYTES
            buffers = copy["buffers"] + workers * per_worker + shard + (nbytes if k == 0 else 0)
            parts = {"parameters": nbytes + shard, "gradients": nbytes + shard, "optimizer": own["optimizer"],
                     "buffers": buffers}  # fmt: skip
            lines = (
                tuple(evaluation(act, min(max(EVAL_PART, cfg["data.batch_size"]), test_size)))
                if k == 0
                else ()
            )
            hint = f"or more servers ({_KEY['servers']})"
            out.append(RankMemory("server", parts, lines, cfg["data.batch_size"], hint=hint))
        pulled_pushed = 3 * nbytes + bn + servers * 2 * wire.HEAD_BYTES  # the flat copy, pushes, replies
        worker = RankMemory(
            "worker",
            {**copy, "buffers": copy["buffers"] + pulled_pushed},
            tuple((f, s, "a batch") for f, s in act.step),
            cfg["data.batch_size"],
        )
        return out + [worker] * workers

    @classmethod
    def describe(cls, cfg: Any, placement: Placement, model: Any) -> list[str]:
        """The shards of the model's packed parameters, one line per server."""
        params = model().parameters()
        elements = sum(int(p.data.size) for p in params)
        plan = shard_plan(elements, PsSettings.from_config(cfg).servers, np.dtype(cfg["dtype"]).itemsize)
        return [f"shards of the {elements:,} packed parameters:", *str(plan).splitlines()]

    @classmethod
    def advice(cls, cfg: Any, placement: Placement) -> list[str]:
        """Remarks on a config that runs but may not measure what its user wants (pure; rank 0
        the driver says them once, prefixed ``hpcdl.train: !``): checkpoints so frequent that their
        quiescing shapes the staleness."""
        ps = PsSettings.from_config(cfg)
        workers, every = placement.world - ps.servers, cfg["checkpoint.every"]
        if ps.mode == "sync" or not 0 < every < 10 * workers:
            return []
        return [
            f"checkpoint.every = {every} pushes with {workers} workers: every checkpoint quiesces the job "
            "and drains the workers' pipeline, which shapes the staleness; for a staleness study make it "
            f"well above {10 * workers} (0: the end only)"
        ]

    def __init__(self, ctx: RunContext) -> None:
        super().__init__(ctx)
        self.comm = ctx.comm.Dup()  # the strategy's own tags
        self.settings = PsSettings.from_config(ctx.cfg)
        self.rank = self.comm.Get_rank()
        self.role: PsServer | PsWorker = (
            PsServer(ctx, self.comm, self.settings)
            if self.rank < self.settings.servers
            else PsWorker(ctx, self.comm, self.settings)
        )

    # -- what the driver and benchmarks read ---------------------------------------------------
    @property
    def model(self) -> Any:
        """This rank's model: a worker's copy; a server's layout (server 0 evaluates with it)."""
        return self.role.model

    @property
    def optimizer(self) -> Any:
        """A server's optimizer over its shard; None on a worker."""
        return self.role.optimizer

    @property
    def shard(self) -> Any:
        """A server's shard of the master parameters (a :class:`~hpcdl.nn.Parameter`).

        Raises:
            AttributeError: on a worker, which holds none (so ``hasattr`` says so).
        """
        if isinstance(self.role, PsServer):
            return self.role.shard
        raise AttributeError("a parameter-server worker holds no shard")

    # -- the driver's calls ------------------------------------------------------------------
    def run_until(self, step: int, target: int, stop: Any, early: Any = None) -> PhaseStats:
        """Serve or work from ``step`` pushes applied until server 0 has granted ``target``; quiesce.

        Server 0 hands ``early`` its rows every ``log.flush_every`` pushes, as they become final.
        """
        if isinstance(self.role, PsServer):
            return self.role.run_until(step, target, stop, early)
        return self.role.run_until(stop)

    def meet(self, phase: PhaseStats, stop: bool) -> PhaseAgreement:
        """Server 0's rows of the phase (rank 0 keeps them), the staleness rows of every server,
        and for every rank the steps, the evaluations, a non-finite loss and the stop votes.

        One gather (each rank's stop flag; each server's staleness rows) and one broadcast.
        """
        role = self.role
        table = role.staleness_rows() if isinstance(role, PsServer) else np.zeros((0, 5), dtype=np.float64)
        with long_wait("a rank waits for the pushes in flight to be applied", self._wait_limit()):
            gathered = self.comm.gather((bool(stop), table), root=0)
            summary: Any = None
            agreement = PhaseAgreement(rows=[], stop_votes=0)
            if self.rank == 0:
                assert gathered is not None and isinstance(role, PsServer)
                summary = role.summarize(gathered, agreement)
            agreement.steps, agreement.evaluated, agreement.bad, agreement.stop_votes = self.comm.bcast(
                summary, root=0
            )
            return agreement

    def _wait_limit(self) -> float | None:
        """How long a meeting's wait may last before the watchdog warns: 10 stall limits."""
        stall = self.ctx.cfg["debug.stall_s"]
        return 10 * stall if stall else None

    def evaluate(self) -> tuple[float, float]:
        """Server 0 evaluates the master copy (the shards gathered); every rank learns the result."""
        result = self.role.evaluate_master() if isinstance(self.role, PsServer) else None
        return self.comm.bcast(result, root=0)

    def serialize(self, s: Serializer) -> None:
        """A server: its shard, optimizer state, version and clocks; a worker: its sampler, streams,
        clock (:meth:`PsServer.serialize`, :meth:`PsWorker.serialize`). A server checks every shard's
        size against its plan (another model or dtype is refused)."""
        self.role.serialize(s)

    def close(self) -> None:
        """Free the strategy's communicator (collective)."""
        self.comm.Free()
