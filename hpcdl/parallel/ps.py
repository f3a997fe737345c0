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

**BatchNorm.** Workers keep their own running statistics (DESIGN.md). With each push a
worker also sends server 0 its BatchNorm buffers: the master copy's statistics are those
of the worker whose push server 0 applied last; evaluations and checkpoints use them.

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

**The run file.** One row per push applied (server 0's): the pushing worker's loss and
batch accuracy; ``staleness/`` holds a row per push and shard (update, worker, server,
tau, time); ``ranks/pushes_per_s`` (workers) and ``ranks/busy_fraction`` (servers) are
each rank's figure over the phase the row belongs to.
"""

from __future__ import annotations

import sys
from collections.abc import Generator, Sequence
from typing import Any

import numpy as np

from hpcdl.backend import to_numpy
from hpcdl.comm import due, long_wait, notes, waitall, waitany, wtime
from hpcdl.comm.pack import Packer
from hpcdl.errors import ConfigError
from hpcdl.nn import Parameter, Sequential, SoftmaxCrossEntropy
from hpcdl.parallel.memory import RankMemory, evaluation, model_parts
from hpcdl.parallel.ps_plan import ShardPlan, shard_plan, ssp_may_pull
from hpcdl.parallel.ps_schema import DECLARES
from hpcdl.parallel.strategy import (
    Batches,
    FreeRunningStrategy,
    PhaseAgreement,
    PhaseStats,
    Placement,
    RankPlace,
    RankState,
    RunContext,
    crossed,
)
from hpcdl.parallel.sync import forward_backward

__all__ = ["ParameterServer", "compensated_lr", "dc_gradient"]

# message tags (on the strategy's own duplicate of the world)
_PUSH, _REPLY, _READY, _START, _SNAPSHOT, _SHARD = 1, 2, 3, 4, 5, 6
#: server 0 writes its rows during a phase at most this often (seconds)
EARLY_ROWS_S = 1.0
#: test images of each part server 0 evaluates at the end (the workers wait anyway: large parts)
EVAL_PART = 512
#: float64 values at the head of every push and reply
_HEAD = 8
_HEAD_BYTES = 8 * _HEAD
# push header: kind, the worker's clock before the push, the version it pulled, its stop
# flag, samples, correct, loss
_KIND, _CLOCK, _VPULL, _STOP, _SAMPLES, _CORRECT, _LOSS = range(7)
_IS_PUSH, _IS_DONE = 1.0, 2.0
# reply header: go (1: compute the next push, 0: the phase is over), the shard's version
_GO, _VERSION = 0, 1


def _message(payload_bytes: int, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A message buffer (bytes), its float64 header view and its payload view in ``dtype``."""
    buf = np.zeros(_HEAD_BYTES + payload_bytes, dtype=np.uint8)
    return buf, buf[:_HEAD_BYTES].view(np.float64), buf[_HEAD_BYTES:].view(dtype)


def compensated_lr(lr: float, tau: int, compensation: str) -> float:
    """The learning rate a push of staleness ``tau`` is applied with: ``lr / max(tau, 1)`` for ``lr``."""
    return lr / max(tau, 1) if compensation == "lr" else lr


def dc_gradient(
    grad: np.ndarray, now: np.ndarray, used: np.ndarray, lam: float, out: np.ndarray
) -> np.ndarray:
    """DC-ASGD's compensated gradient ``g + lambda g*g*(w_now - w_used)``, computed into ``out``."""
    np.subtract(now, used, out=out)
    out *= grad
    out *= grad
    out *= out.dtype.type(lam)
    out += grad
    return out


class ParameterServer(FreeRunningStrategy):
    """Parameter servers and workers (module docstring): one role per rank.

    Args:
        ctx: the driver's run context.
    """

    name = "ps"
    runs_free = True
    keys = ("ps.",)
    declares = DECLARES
    cannot_honour = {
        "exchange.accumulate": "a push is one batch; raise data.batch_size instead",
        "exchange.compression": "pushes and replies carry the parameters' dtype uncompressed; "
        "set exchange.compression = 'none' (or use parallel.strategy = 'sync')",
    }
    rank_series = ("pushes_per_s", "busy_fraction")
    row_rank = 0

    @classmethod
    def plan(cls, cfg: Any, world: int) -> Placement:
        """Ranks ``0 .. S-1`` servers holding shard k; the others workers, worker w reading member w.

        Raises:
            ConfigError: fewer than one server, or no rank left for a worker.
        """
        servers = cfg["ps.servers"]
        if servers < 1:
            raise ConfigError(f"ps.servers = {servers}: a parameter server job needs at least 1 server")
        if servers >= world:
            raise ConfigError(
                f"ps.servers = {servers} on {world} rank{'s' * (world > 1)} leaves no worker: run on "
                f"at least {servers + 1} ranks (mpiexec -n {servers + 1}) or lower ps.servers"
            )
        workers = world - servers
        mode = cfg["ps.mode"]
        if mode == "sync":
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
            "ssp": f"ssp: staleness bound s = {cfg['ps.staleness']}",
            "sync": f"sync: the {workers} pushes of a round summed and applied once",
        }[mode]
        notes_ = (f"parameter servers, {how}; compensation {cfg['ps.compensation']}",)
        return Placement(
            cls.name, tuple(ranks), cfg["data.batch_size"], 1, notes_, step_batches=1,
            update_batches=workers if mode == "sync" else 1, step_multiple=workers if mode == "sync" else 1,
        )  # fmt: skip

    @classmethod
    def memory(
        cls, cfg: Any, placement: Placement, probe: Any, test_size: int, eval_batch: int
    ) -> list[RankMemory]:
        """Every rank builds the whole model (parameters, gradients, a packed copy). Server k: its
        shard, the shard's gradient and optimizer state, a push and a reply per worker (and a
        copy per worker for dc compensation); server 0 also a snapshot of the master copy and the
        evaluation. Worker: the pulled and pushed copies, one batch's activations."""
        nbytes, _ = probe.parameters()
        act = probe.activations()
        itemsize = probe.dtype.itemsize
        bn = sum(int(b.nbytes) for _, b in probe.model.named_buffers())
        servers = cfg["ps.servers"]
        workers = placement.world - servers
        shards = shard_plan(nbytes // itemsize, servers, itemsize)
        copy = {"parameters": nbytes, "gradients": nbytes, "buffers": nbytes}  # the model, its packer
        out = []
        for k in range(servers):
            shard = shards.nbytes(k)
            own = model_parts(cfg, shard, shard)
            copies = 2 + (cfg["ps.compensation"] == "dc")  # a push, a reply (and what w was sent)
            per_worker = copies * shard + (bn if k == 0 else 0) + 2 * _HEAD_BYTES
            buffers = copy["buffers"] + workers * per_worker + shard + (nbytes if k == 0 else 0)
            parts = {"parameters": nbytes + shard, "gradients": nbytes + shard, "optimizer": own["optimizer"],
                     "buffers": buffers}  # fmt: skip
            lines = (
                tuple(evaluation(act, min(max(EVAL_PART, cfg["data.batch_size"]), test_size)))
                if k == 0
                else ()
            )
            hint = "or more servers (ps.servers)"
            out.append(RankMemory("server", parts, lines, cfg["data.batch_size"], hint=hint))
        pulled_pushed = 3 * nbytes + bn + servers * 2 * _HEAD_BYTES  # the flat copy, pushes, replies
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
        plan = shard_plan(elements, cfg["ps.servers"], np.dtype(cfg["dtype"]).itemsize)
        return [f"shards of the {elements:,} packed parameters:", *str(plan).splitlines()]

    def __init__(self, ctx: RunContext) -> None:
        super().__init__(ctx)
        cfg, placement = ctx.cfg, ctx.placement
        self.comm = ctx.comm.Dup()  # the strategy's own tags
        self.servers = cfg["ps.servers"]
        self.workers = placement.world - self.servers
        self.mode, self.bound = cfg["ps.mode"], cfg["ps.staleness"]
        self.compensation, self.dc_lambda = cfg["ps.compensation"], cfg["ps.dc_lambda"]
        self.model: Sequential = ctx.build_model()  # every rank: the layout; server 0 evaluates with it
        self.params = self.model.parameters()
        self.buffers = [b for _, b in self.model.named_buffers()]
        self.packer = Packer([p.data for p in self.params])
        self.dtype = self.packer.dtype
        self.shards: ShardPlan = shard_plan(self.packer.total, self.servers, self.dtype.itemsize)
        self.bn_packer = Packer(self.buffers) if self.buffers else None
        self.bn_bytes = self.bn_packer.nbytes if self.bn_packer is not None else 0
        self.rank = self.comm.Get_rank()
        self.is_server = self.rank < self.servers
        self.bytes_sent = 0
        self._note = notes()
        self._evaluated: tuple[float, float] | None = None
        if self.is_server:
            self._init_server()
        else:
            self._init_worker()
        every = cfg["checkpoint.every"]
        if self.rank == 0 and self.mode != "sync" and 0 < every < 10 * self.workers:
            print(
                f"hpcdl.train: ! checkpoint.every = {every} pushes with {self.workers} workers: every "
                "checkpoint quiesces the job and drains the workers' pipeline, which shapes the "
                f"staleness; for a staleness study make it well above {10 * self.workers} (0: the end only)",
                file=sys.stderr,
                flush=True,
            )

    # -- sizes -------------------------------------------------------------------------------
    def _range(self, k: int) -> tuple[int, int]:
        return self.shards.ranges[k]

    def _push_bytes(self, k: int) -> int:
        """Payload of a push to server k: its shard of the gradient (and BatchNorm buffers to server 0)."""
        return self.shards.nbytes(k) + (self.bn_bytes if k == 0 else 0)

    # ========================================================================================
    # servers
    # ========================================================================================
    def _init_server(self) -> None:
        k, cfg = self.rank, self.ctx.cfg
        a, b = self._range(k)
        flat = self.packer.pack([p.data for p in self.params])
        self.shard = Parameter(flat[a:b].copy(), name=f"shard {k}")
        self._share_initial_shards(flat)
        self.optimizer = self.ctx.optimizer([self.shard])
        self.lr = self.ctx.schedule()
        self.version = 0
        self.clocks = np.zeros(self.workers, dtype=np.int64)  # pushes applied, per worker
        self.pushes = [_message(self._push_bytes(k), self.dtype) for _ in range(self.workers)]
        self.replies = [_message(self.shards.nbytes(k), self.dtype) for _ in range(self.workers)]
        self.reply_reqs: list[Any] = [None] * self.workers
        self.scratch = np.empty(b - a, dtype=self.dtype)
        self.used = np.zeros((self.workers, b - a), self.dtype) if self.compensation == "dc" else None
        self.period = cfg["train.eval_every"] or self.ctx.steps_per_epoch
        if k == 0:
            self.master_bn = [np.array(to_numpy(buf), copy=True) for buf in self.buffers]

    def _share_initial_shards(self, flat: np.ndarray) -> None:
        """Server 0's initial weights, whatever the other servers built (as sync broadcasts rank 0's)."""
        if self.servers == 1:
            return
        k = self.rank
        if k == 0:
            for j in range(1, self.servers):
                a, b = self._range(j)
                self.comm.Send(flat[a:b], dest=j, tag=_SHARD)
        else:
            self.comm.Recv(self.shard.data, source=0, tag=_SHARD)

    def _serve(self, step: int, target: int, stop: Any) -> PhaseStats:
        """One phase of server k: apply pushes and answer pulls until every worker is done."""
        k, workers = self.rank, self.workers
        t_begin = wtime()
        waited = 0.0
        self._phase_start(k)
        ph = _Phase(workers, granted=step, target=target)
        self._rows: list[dict[str, float]] = []
        self._first_bad: int | None = None  # the phase's first row whose loss is not finite
        self._table: list[tuple[int, int, int, int, float]] = []
        self._snapshots: list[dict[str, Any]] = []  # evaluations pending (server 0) or sends (others)
        self._eval_parts: Generator[None, None, tuple[float, float]] | None = None
        recvs: list[Any] = [None] * workers
        if k != 0:  # each worker sends a push or, when server 0 stopped it, a done
            recvs = [self._expect(w) for w in range(workers)]
        self._answer_pulls(ph, range(workers), recvs, stop)
        round_: list[int] = []
        while ph.active or self._eval_pending():
            pending = [
                (snap, j)
                for snap in self._snapshots
                for j, r in enumerate(snap.get("recvs", ()))
                if r is not None
            ]
            reqs = recvs + [snap["recvs"][j] for snap, j in pending]
            t0 = wtime()
            i = waitany(reqs) if any(r is not None for r in reqs) else None  # each push due since its pull
            waited += wtime() - t0
            if i is None or i >= workers:  # a shard of a snapshot came (or only evaluating is left)
                if i is not None:
                    snap, j = pending[i - workers]
                    snap["recvs"][j] = None
                self._eval_step()
                continue
            w = i
            recvs[w] = None
            head = self.pushes[w][1]
            if head[_KIND] == _IS_DONE:  # (servers k > 0) worker w stopped by server 0
                ph.active -= 1
                if w in ph.deferred:
                    ph.deferred.remove(w)
                    self._reply(w, go=False)
                continue
            if head[_STOP] or not np.isfinite(head[_LOSS]):  # a stop asked; a loss gone bad ends the phase
                ph.stopping = True
            if self.mode == "sync":
                round_.append(w)
                if len(round_) < workers:
                    continue
                answered, round_ = sorted(round_), []
                self._apply_round(answered)
            else:
                self._apply(w)
                answered = [w]
            if k != 0:  # its pushes consumed: the next message of each (even while its reply waits)
                for v in answered:
                    recvs[v] = self._expect(v)
            self._answer_pulls(ph, answered, recvs, stop)
            self._eval_step()
            self._hand_rows()
        waitall([*self.reply_reqs, *(snap.get("send") for snap in self._snapshots)])
        self.reply_reqs = [None] * workers
        if k != 0:
            self._snapshots = []
        wall = wtime() - t_begin
        busy = (wall - waited) / wall if wall > 0 else float("nan")
        return self._server_phase(waited, busy)

    def _wait_limit(self) -> float | None:
        stall = self.ctx.cfg["debug.stall_s"]
        return 10 * stall if stall else None

    def _phase_start(self, k: int) -> None:
        """Every rank tells server 0 it is ready; server 0 starts the other servers."""
        comm, size = self.comm, self.comm.Get_size()
        token = np.zeros(1, dtype=np.float64)
        if k == 0:
            tokens = np.zeros((size, 1), dtype=np.float64)
            waitall([comm.Irecv(tokens[r], source=r, tag=_READY) for r in range(1, size)])
            for j in range(1, self.servers):
                comm.Send(token, dest=j, tag=_START)
        else:
            comm.Send(token, dest=0, tag=_READY)
            comm.Recv(token, source=0, tag=_START)

    def _answer_pulls(self, ph: _Phase, pulls: Sequence[int], recvs: list[Any], stop: Any) -> None:
        """Answer the pulls of ``pulls`` (and those the SSP gate held back, when it opens).

        Server 0 grants a push while fewer than the target have been granted and no stop
        was asked; a worker it does not grant is told the phase is over. In ``sync`` mode
        the W pulls of a round are granted or refused together. The other servers answer
        every pull the gate lets through with their shard; a worker server 0 stopped tells
        them with a done.
        """
        first = self.rank == 0
        if first and stop.requested:
            ph.stopping = True
        if self.mode == "sync":
            go = not ph.stopping and ph.granted < ph.target
            if first:
                ph.granted += len(pulls) if go else 0
            for w in pulls:
                self._reply_or_stop(ph, w, go or not first, recvs)
            return
        ph.deferred.extend(pulls)
        waiting, ph.deferred = ph.deferred, []
        low = int(self.clocks.min())  # the gate's minimum: the clocks do not change in this loop
        # the workers that pushed least first: a phase shorter than W pushes (a checkpoint every
        # 200 at W = 1,024) grants them in turn, not always to the same low-numbered workers
        for w in sorted(waiting, key=lambda v: (self.clocks[v], v)):
            over = first and (ph.stopping or ph.granted >= ph.target)
            gated = self.mode == "ssp" and not ssp_may_pull(int(self.clocks[w]), [low], self.bound)
            if not over and gated:
                ph.deferred.append(w)
                continue
            if first and not over:
                ph.granted += 1
            self._reply_or_stop(ph, w, not over, recvs)

    def _reply_or_stop(self, ph: _Phase, w: int, go: bool, recvs: list[Any]) -> None:
        """Answer w's pull; server 0 then expects w's push, or counts w out of the phase.

        A push is due once its pull is answered (the worker computes one batch): the stall
        watchdog counts the wait for it from then, whatever the server serves meanwhile.
        """
        self._reply(w, go)
        if self.rank == 0:
            if go:
                recvs[w] = self._expect(w)
            else:
                ph.active -= 1
        if go and recvs[w] is not None:
            due(recvs[w], wtime())

    def _expect(self, w: int) -> Any:
        """The receive of worker w's next message (a push; or a done, on servers k > 0)."""
        return self.comm.Irecv(self.pushes[w][0], source=self.servers + w, tag=_PUSH)

    def _reply(self, w: int, go: bool) -> None:
        """Send worker w this shard at the current version (``go``), or only the end of the phase."""
        if self.reply_reqs[w] is not None:
            self.reply_reqs[w].Wait()  # the previous reply's buffer (received long ago)
            self.reply_reqs[w] = None
        buf, head, payload = self.replies[w]
        head[_GO], head[_VERSION] = float(go), float(self.version)
        if go:
            payload[:] = self.shard.data
            if self.used is not None:
                self.used[w] = self.shard.data
            msg = buf
        else:
            msg = buf[:_HEAD_BYTES]
        self.reply_reqs[w] = self.comm.Isend(msg, dest=self.servers + w, tag=_REPLY)
        self.bytes_sent += msg.nbytes

    def _apply(self, w: int) -> None:
        """Apply worker w's push on arrival (async, ssp)."""
        _, head, payload = self.pushes[w]
        a, b = self._range(self.rank)
        grad = payload[: b - a]
        tau = self.version - int(head[_VPULL])
        lr = compensated_lr(self.lr(self.version), tau, self.compensation)
        if self.used is not None:  # dc: the shard now against the one w was sent
            grad = dc_gradient(grad, self.shard.data, self.used[w], self.dc_lambda, self.scratch)
        self._step(grad, lr)
        self.version += 1
        self.clocks[w] += 1
        self._record(w, head, tau)
        self._boundary(self.version - 1)

    def _apply_round(self, round_: list[int]) -> None:
        """Sum the W pushes of a round in worker order, scale by 1/W, apply once (sync)."""
        a, b = self._range(self.rank)
        acc = self.scratch
        acc[:] = self.pushes[round_[0]][2][: b - a]
        for w in round_[1:]:
            acc += self.pushes[w][2][: b - a]
        acc *= self.dtype.type(1.0 / self.workers)
        self._step(acc, self.lr(self.version))
        self.version += len(round_)
        self.clocks[round_] += 1
        for w in round_:
            self._record(w, self.pushes[w][1], 0)
        self._boundary(self.version - len(round_))

    def _step(self, grad: np.ndarray, lr: float) -> None:
        self._note["step"] = self.version + 1  # stall reports: the push being applied
        self._lr_used = lr
        self.shard.grad = grad
        self.optimizer.lr = lr
        self.optimizer.step()

    def _record(self, w: int, head: np.ndarray, tau: int) -> None:
        """The push's staleness row; on server 0 its metrics row and the master BatchNorm statistics."""
        now = self.ctx.elapsed()
        self._table.append((self.version, w, self.rank, tau, now))
        if self.rank != 0:
            return
        samples = int(head[_SAMPLES])
        if self._first_bad is None and not np.isfinite(head[_LOSS]):
            self._first_bad = len(self._rows)
        self._rows.append({
            "loss": float(head[_LOSS]),
            "train_accuracy": float(head[_CORRECT]) / samples if samples else float("nan"),
            "lr": self._lr_used, "worker": w, "tau": tau, "ended": wtime(), "bytes_sent": self.bytes_sent,
        })  # fmt: skip
        if self.bn_packer is not None:
            payload = self.pushes[w][2]
            a, b = self._range(0)
            bn = payload[b - a :][: self.bn_packer.total]
            self.bn_packer.unpack(bn, self.master_bn)

    def _boundary(self, before: int) -> None:
        """At an evaluation boundary and the last push: server 0 takes a snapshot, the others send theirs."""
        end = before < self.ctx.total_steps <= self.version  # the run's last push: its result
        if not (crossed(before, self.version, self.period) or end):
            return
        if self.rank == 0:
            self._take_snapshot()
        else:
            self._send_snapshot()

    # -- evaluation of the master copy (server 0), without holding workers back -----------------
    def _take_snapshot(self) -> None:
        """Server 0: this shard now, the others' as they reach the same version."""
        flat = np.empty(self.packer.total, dtype=self.dtype)
        a, b = self._range(0)
        flat[a:b] = self.shard.data
        recvs = []
        for j in range(1, self.servers):
            lo, hi = self._range(j)
            recvs.append(self.comm.Irecv(flat[lo:hi], source=j, tag=_SNAPSHOT))
        bn = [buf.copy() for buf in self.master_bn]
        self._snapshots.append({"flat": flat, "bn": bn, "recvs": recvs, "row": len(self._rows) - 1})

    def _send_snapshot(self) -> None:
        """Servers k > 0: send server 0 this shard at the evaluation boundary (earlier sends that
        completed are let go, so a long phase keeps no more copies than server 0 lags behind)."""
        self._snapshots = [snap for snap in self._snapshots if not snap["send"].Test()]
        copy = self.shard.data.copy()
        self._snapshots.append({"send": self.comm.Isend(copy, dest=0, tag=_SNAPSHOT), "copy": copy})
        self.bytes_sent += copy.nbytes

    def _load_master(self, flat: np.ndarray, bn: Sequence[np.ndarray]) -> None:
        """Server 0's model takes the master parameters (packed) and BatchNorm statistics, to evaluate."""
        self.packer.unpack(flat, [p.data for p in self.params])
        for buf, saved in zip(self.buffers, bn):
            buf[...] = saved

    def _eval_pending(self) -> bool:
        return self.rank == 0 and (bool(self._snapshots) or self._eval_parts is not None)

    def _eval_step(self) -> None:
        """Server 0: one test batch of the oldest snapshot whose shards are all in."""
        if self.rank != 0:
            return
        if self._eval_parts is None:
            if not self._snapshots or any(r is not None for r in self._snapshots[0]["recvs"]):
                return
            snap = self._snapshots[0]
            self._load_master(snap["flat"], snap["bn"])
            # a training batch's worth at a time: the workers wait for no more than a forward
            self._eval_parts = self.ctx.evaluation_parts(self.model, self.ctx.cfg["data.batch_size"])
        try:
            next(self._eval_parts)
        except StopIteration as done:
            acc, loss = done.value
            snap = self._snapshots.pop(0)
            row = self._rows[snap["row"]]
            row["test_accuracy"], row["test_loss"] = acc, loss
            self._eval_parts = None

    def _hand_rows(self) -> None:
        """Server 0: give the driver the rows that are final, every ``log.flush_every`` of them
        and at most once every :data:`EARLY_ROWS_S` seconds.

        A row is final once applied, unless an evaluation of its push is still running (it
        gets the test accuracy) or a loss before it is not finite (the run ends there). The
        time limit keeps the writes from slowing the server: a write of 10 rows every 10
        pushes made real pushes' intervals three times as variable at 2 workers here.
        """
        if self._early is None or wtime() - self._handed_at < EARLY_ROWS_S:
            return
        final = min((snap["row"] for snap in self._snapshots), default=len(self._rows))
        if self._first_bad is not None:
            final = min(final, self._first_bad)
        if final - self._handed < self.ctx.cfg["log.flush_every"]:
            return
        keys = ("loss", "train_accuracy", "lr", "test_accuracy", "test_loss", "bytes_sent")
        part = self._rows[self._handed : final]
        table = np.array(self._table[self._handed : final], dtype=np.float64).reshape(-1, 5)
        self._early(
            [{k: r[k] for k in keys if k in r} for r in part],
            [r["ended"] for r in part],
            {"staleness": dict(zip(("update", "worker", "server", "tau", "time"), table.T))},
        )
        self._handed, self._handed_at = final, wtime()

    def _server_phase(self, waited: float, busy: float) -> PhaseStats:
        """A server's phase: its waits, its busy fraction; server 0 timed each push it applied."""
        ended = [row.pop("ended") for row in self._rows] if self.rank == 0 else []
        return PhaseStats(
            comm_s=waited, bytes_sent=self.bytes_sent, series={"busy_fraction": busy}, ended=ended
        )

    # ========================================================================================
    # workers
    # ========================================================================================
    def _init_worker(self) -> None:
        self.w = self.rank - self.servers
        self.sampler = self.ctx.sampler(self.w)
        self.lr = self.ctx.schedule()
        self.loss_fn = SoftmaxCrossEntropy()
        self.clock = 0  # pushes of this worker applied
        self.flat = np.empty(self.packer.total, dtype=self.dtype)
        self.pushes = [_message(self._push_bytes(k), self.dtype) for k in range(self.servers)]
        self.replies = [_message(self.shards.nbytes(k), self.dtype) for k in range(self.servers)]
        self.push_reqs: list[Any] = [None] * self.servers
        self.v_pull = np.zeros(self.servers, dtype=np.int64)
        self.batches = Batches(self.sampler)

    def _work(self, stop: Any) -> None:
        """One phase of a worker: pull, compute, push, until server 0 says the phase is over."""
        comm, servers = self.comm, self.servers
        t_begin = wtime()
        comm_s = 0.0
        comm.Send(np.zeros(1, dtype=np.float64), dest=0, tag=_READY)
        self._note.pop("step", None)  # a worker knows its own pushes, not the servers' step
        pushes = 0
        while True:
            # the reply: at once (async), or once the workers at the lowest clock have pushed
            # (ssp, sync), each computing one batch meanwhile: a wait of one step, watched as such
            t0 = wtime()
            reqs = [comm.Irecv(self.replies[k][0], source=k, tag=_REPLY) for k in range(servers)]
            reqs[0].Wait()
            go = bool(self.replies[0][1][_GO])
            if not go:  # the phase is over: the other servers are told, their answers taken
                done = np.zeros(_HEAD, dtype=np.float64)
                done[_KIND] = _IS_DONE
                for k in range(1, servers):
                    comm.Send(done, dest=k, tag=_PUSH)
            waitall([*reqs[1:], *self.push_reqs])
            self.push_reqs = [None] * servers
            comm_s += wtime() - t0
            if not go:
                break
            for k in range(servers):
                a, b = self._range(k)
                _, head, payload = self.replies[k]
                self.flat[a:b] = payload
                self.v_pull[k] = int(head[_VERSION])
            self.packer.unpack(self.flat, [p.data for p in self.params])
            self._note["phase"] = "forward/backward"
            indices = self.batches.next()
            x, y = self.ctx.batch(indices)
            loss, correct = forward_backward(self.model, self.loss_fn, x, y)
            grads = self.packer.pack([p.grad for p in self.params])
            t0 = wtime()
            self._push(grads, loss, correct, len(indices), stop.requested)
            comm_s += wtime() - t0
            pushes += 1
            self._note["phase"], self._note["pushes"] = "waiting for the servers", self.clock
        self._phase_pushes, self._phase_wall, self._phase_comm = pushes, wtime() - t_begin, comm_s

    def _push(self, grads: np.ndarray, loss: float, correct: int, samples: int, stop: bool) -> None:
        """This worker's gradient, a shard to each server, with what the servers record."""
        for k in range(self.servers):
            buf, head, payload = self.pushes[k]
            a, b = self._range(k)
            head[:] = 0.0
            head[_KIND], head[_CLOCK], head[_VPULL], head[_STOP] = _IS_PUSH, self.clock, self.v_pull[k], stop
            head[_SAMPLES], head[_CORRECT], head[_LOSS] = samples, correct, loss
            payload[: b - a] = grads[a:b]
            if k == 0 and self.bn_packer is not None:
                payload[b - a :][: self.bn_packer.total] = self.bn_packer.pack(self.buffers)
            self.push_reqs[k] = self.comm.Isend(buf, dest=k, tag=_PUSH)
            self.bytes_sent += buf.nbytes
        self.clock += 1

    # ========================================================================================
    # the driver's calls
    # ========================================================================================
    def run_until(self, step: int, target: int, stop: Any, early: Any = None) -> PhaseStats:
        """Serve or work from ``step`` pushes applied until server 0 has granted ``target``; quiesce.

        Server 0 hands ``early`` its rows every ``log.flush_every`` pushes, as they become final.
        """
        if self.is_server:
            self._early, self._handed, self._handed_at = early, 0, wtime()
            return self._serve(step, target, stop)
        self._work(stop)
        wall = self._phase_wall
        rate = self._phase_pushes / wall if wall > 0 else float("nan")
        return PhaseStats(comm_s=self._phase_comm, bytes_sent=self.bytes_sent, series={"pushes_per_s": rate})

    def meet(self, phase: PhaseStats, stop: bool) -> PhaseAgreement:
        """Server 0's rows of the phase (rank 0 keeps them), the staleness rows of every server,
        and for every rank the steps, the evaluations, a non-finite loss and the stop votes.

        One gather (each rank's stop flag; each server's staleness rows) and one broadcast.
        """
        handed = self._handed if self.rank == 0 else 0  # server 0's rows the driver already wrote
        table = np.array(self._table[handed:] if self.is_server else [], dtype=np.float64).reshape(-1, 5)
        with long_wait("a rank waits for the pushes in flight to be applied", self._wait_limit()):
            return self._meet(table, stop)

    def _meet(self, table: np.ndarray, stop: bool) -> PhaseAgreement:
        gathered = self.comm.gather((bool(stop), table), root=0)
        summary: Any = None
        agreement = PhaseAgreement(rows=[], stop_votes=0)
        if self.rank == 0:
            assert gathered is not None
            keys = ("loss", "train_accuracy", "lr", "test_accuracy", "test_loss", "bytes_sent")
            rows = agreement.rows = [{k: r[k] for k in keys if k in r} for r in self._rows]
            bad = next((i for i, r in enumerate(rows) if not np.isfinite(r["loss"])), -1)
            both = np.concatenate([t for _, t in gathered])
            both = both[np.lexsort((both[:, 2], both[:, 0]))]  # by update, then server (stable: worker order)
            if bad >= 0:  # the run ends before the bad push: the file keeps what came before it
                both = both[both[:, 0] <= self.version - len(rows) + bad]
            agreement.tables = {"staleness": dict(zip(("update", "worker", "server", "tau", "time"), both.T))}
            evaluated = [
                (i, r["test_accuracy"], r["test_loss"]) for i, r in enumerate(rows) if "test_loss" in r
            ]
            summary = (len(rows), evaluated, bad, sum(int(v) for v, _ in gathered))
        agreement.steps, agreement.evaluated, agreement.bad, agreement.stop_votes = self.comm.bcast(
            summary, root=0
        )
        return agreement

    def evaluate(self) -> tuple[float, float]:
        """Server 0 evaluates the master copy (the shards gathered); every rank learns the result."""
        comm = self.comm
        if self.is_server and self.rank != 0:
            comm.Send(self.shard.data, dest=0, tag=_SHARD)
        result = None
        if self.rank == 0:
            flat = np.empty(self.packer.total, dtype=self.dtype)
            a, b = self._range(0)
            flat[a:b] = self.shard.data
            for j in range(1, self.servers):
                lo, hi = self._range(j)
                comm.Recv(flat[lo:hi], source=j, tag=_SHARD)
            self._load_master(flat, self.master_bn)
            parts = self.ctx.evaluation_parts(self.model, EVAL_PART)  # the workers wait anyway: large parts
            while result is None:
                try:
                    next(parts)
                except StopIteration as done:
                    result = done.value
        return comm.bcast(result, root=0)

    # -- checkpoints -------------------------------------------------------------------------
    def state(self, pieces: bool) -> RankState:
        """A server: its shard, optimizer state, version and clocks; a worker: its sampler, streams, clock."""
        if self.is_server:
            part = RankState(meta={"version": self.version, "clocks": self.clocks.tolist(),
                                   "bytes_sent": self.bytes_sent})  # fmt: skip
            if self.rank == 0:
                part.arrays = {f"bn{i}": b.copy() for i, b in enumerate(self.master_bn)}
            if pieces:
                opt = self.optimizer.state_dict()
                part.pieces[f"shard {self.rank}"] = {
                    "params": {"shard": self.shard.data.copy()},
                    "optimizer": {k: v for k, v in opt.items() if isinstance(v, np.ndarray)},
                    "meta": {"optimizer": {k: v for k, v in opt.items() if not isinstance(v, np.ndarray)}},
                }
            return part
        return RankState(
            arrays={name: to_numpy(b).copy() for name, b in self.model.named_buffers()},
            meta={"random": self.ctx.random_state(), "sampler": self.sampler.state(), "clock": self.clock,
                  "bytes_sent": self.bytes_sent},
        )  # fmt: skip

    def load_state(self, state: RankState) -> None:
        """Put back what :meth:`state` captured."""
        self.bytes_sent = int(state.meta.get("bytes_sent", 0))
        if self.is_server:
            self.check_state(state.pieces)
            shard = state.pieces[f"shard {self.rank}"]
            self.shard.data[...] = shard["params"]["shard"]
            self.optimizer.load_state_dict({**shard["meta"]["optimizer"], **shard["optimizer"]})
            self.version = int(state.meta["version"])
            self.clocks[:] = state.meta["clocks"]
            if self.rank == 0:
                for i, buf in enumerate(self.master_bn):
                    buf[...] = state.arrays[f"bn{i}"]
            return
        self.model.load_state_dict(state.arrays, strict=False)
        self.sampler.load_state(state.meta["sampler"])
        self.ctx.load_random_state(state.meta["random"])
        self.clock = int(state.meta["clock"])
        self.batches.restart()

    def check_state(self, pieces: dict[str, dict[str, Any]]) -> None:
        """Refuse shards of another size (another model or dtype).

        Raises:
            ConfigError: naming the shard that differs.
        """
        for k in range(self.servers):
            shard = pieces.get(f"shard {k}")
            if shard is None:
                continue
            a, b = self._range(k)
            got = tuple(np.shape(shard["params"]["shard"]))
            if got != (b - a,):
                raise ConfigError(f"it holds another model (shard {k} has {got[0] if got else 0} elements, "
                                  f"this model's {b - a})")  # fmt: skip

    def close(self) -> None:
        """Free the strategy's communicator (collective)."""
        self.comm.Free()


class _Phase:
    """Server-side bookkeeping of one phase: pushes granted, workers still active, pulls held back."""

    def __init__(self, workers: int, granted: int, target: int) -> None:
        self.active = workers
        self.granted = granted
        self.target = target
        self.stopping = False
        self.deferred: list[int] = []
