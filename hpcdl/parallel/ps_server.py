"""A parameter server (:class:`PsServer`): shard k of the master parameters, applied push by push.

Server k holds shard k of the packed master parameters and that shard's optimizer state.
In a phase it applies each push on arrival (``async``, ``ssp``) or each round of W pushes
(``sync``), answers the pulls its mode lets through, and records a staleness row per push.
Server 0 also grants the phase's pushes up to the driver's target, keeps the master
BatchNorm statistics and the metrics rows, and evaluates snapshots of the master copy
between the messages it serves. The protocol is in :mod:`hpcdl.parallel.ps`.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Any

import numpy as np

from hpcdl.backend import to_numpy
from hpcdl.comm import Communicator, due, notes, waitall, waitany, wtime
from hpcdl.errors import ConfigError
from hpcdl.nn import Parameter, Sequential
from hpcdl.parallel import ps_wire as wire
from hpcdl.parallel.evaluation import EVAL_BATCH
from hpcdl.parallel.ps_math import compensated_lr, dc_gradient
from hpcdl.parallel.ps_plan import PsSettings, ShardPlan, ssp_may_pull
from hpcdl.parallel.ps_wire import MessageLayout
from hpcdl.parallel.state import Serializer
from hpcdl.parallel.strategy import PhaseAgreement, PhaseStats, RunContext, crossed

__all__ = ["EARLY_ROWS_S", "EVAL_PART", "PsServer", "check_shards"]

#: server 0 writes its rows during a phase at most this often (seconds)
EARLY_ROWS_S = 1.0
#: test images of each part server 0 evaluates at the end (the workers wait anyway: large parts)
EVAL_PART = EVAL_BATCH
#: the columns of a metrics row server 0 hands the driver (its own ``worker``, ``tau``, ``ended`` stay)
ROW_KEYS = ("loss", "train_accuracy", "lr", "test_accuracy", "test_loss", "bytes_sent")
#: the columns of a staleness row
STALENESS = ("update", "worker", "server", "tau", "time")


class PsServer:
    """Server ``rank``: a shard of the master parameters, its optimizer, the workers' clocks.

    Args:
        ctx: the driver's run context.
        comm: the strategy's own communicator (its tags).
        settings: the strategy's settings.
    """

    def __init__(self, ctx: RunContext, comm: Communicator, settings: PsSettings) -> None:
        self.ctx, self.comm = ctx, comm
        self.servers = settings.servers
        self.workers = ctx.placement.world - settings.servers
        self.mode, self.bound = settings.mode, settings.staleness
        self.compensation, self.dc_lambda = settings.compensation, settings.dc_lambda
        self.model: Sequential = ctx.build_model()  # the layout; server 0 evaluates with it
        self.params = self.model.parameters()
        self.buffers = [b for _, b in self.model.named_buffers()]
        self.layout = MessageLayout(self.params, self.buffers, self.servers)
        self.rank = k = comm.Get_rank()
        self.bytes_sent = 0
        self._note = notes()
        a, b = self.layout.range(k)
        flat = self.layout.packer.pack([p.data for p in self.params])
        self.shard = Parameter(flat[a:b].copy(), name=f"shard {k}")
        self._share_initial_shards(flat)
        self.optimizer = ctx.optimizer([self.shard])
        self.lr = ctx.schedule()
        self.version = 0
        self.clocks = np.zeros(self.workers, dtype=np.int64)  # pushes applied, per worker
        dtype = self.layout.dtype
        self.pushes = [wire.message(self.layout.push_bytes(k), dtype) for _ in range(self.workers)]
        self.replies = [wire.message(self.layout.reply_bytes(k), dtype) for _ in range(self.workers)]
        self.reply_reqs: list[Any] = [None] * self.workers
        self.scratch = np.empty(b - a, dtype=dtype)
        self.used = np.zeros((self.workers, b - a), dtype) if self.compensation == "dc" else None
        self.period = ctx.cfg["train.eval_every"] or ctx.steps_per_epoch
        self.master_bn = [np.array(to_numpy(buf), copy=True) for buf in self.buffers] if k == 0 else []
        # a phase's bookkeeping (reset as each phase begins)
        self._rows: list[dict[str, float]] = []  # server 0's metrics rows
        self._first_bad: int | None = None  # the phase's first row whose loss is not finite
        self._table: list[tuple[int, int, int, int, float]] = []  # staleness rows
        self._snapshots: list[dict[str, Any]] = []  # evaluations pending (server 0) or sends (others)
        self._eval_parts: Generator[None, None, tuple[float, float]] | None = None
        self._lr_used = 0.0  # the learning rate of the push being applied
        self._early: Any = None  # the driver's callback for rows that are final (server 0)
        self._handed, self._handed_at = 0, 0.0  # rows given to it, and when

    def run_until(self, step: int, target: int, stop: Any, early: Any) -> PhaseStats:
        """One phase: serve from ``step`` pushes applied until server 0 has granted ``target``."""
        self._early, self._handed, self._handed_at = early, 0, wtime()
        return self._serve(step, target, stop)

    def _share_initial_shards(self, flat: np.ndarray) -> None:
        """Server 0's initial weights, whatever the other servers built (as sync broadcasts rank 0's)."""
        if self.servers == 1:
            return
        k = self.rank
        if k == 0:
            for j in range(1, self.servers):
                a, b = self.layout.range(j)
                self.comm.Send(flat[a:b], dest=j, tag=wire.SHARD)
        else:
            self.comm.Recv(self.shard.data, source=0, tag=wire.SHARD)

    def _serve(self, step: int, target: int, stop: Any) -> PhaseStats:
        """One phase of server k: apply pushes and answer pulls until every worker is done."""
        k, workers = self.rank, self.workers
        t_begin = wtime()
        waited = 0.0
        self._phase_start(k)
        ph = _Phase(workers, granted=step, target=target)
        self._rows, self._first_bad, self._table, self._snapshots, self._eval_parts = [], None, [], [], None
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
            if head[wire.KIND] == wire.IS_DONE:  # (servers k > 0) worker w stopped by server 0
                ph.active -= 1
                if w in ph.deferred:
                    ph.deferred.remove(w)
                    self._reply(w, go=False)
                continue
            if head[wire.STOP] or not np.isfinite(head[wire.LOSS]):  # a stop asked; a bad loss ends the phase
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

    def _phase_start(self, k: int) -> None:
        """Every rank tells server 0 it is ready; server 0 starts the other servers."""
        comm, size = self.comm, self.comm.Get_size()
        token = np.zeros(1, dtype=np.float64)
        if k == 0:
            tokens = np.zeros((size, 1), dtype=np.float64)
            waitall([comm.Irecv(tokens[r], source=r, tag=wire.READY) for r in range(1, size)])
            for j in range(1, self.servers):
                comm.Send(token, dest=j, tag=wire.START)
        else:
            comm.Send(token, dest=0, tag=wire.READY)
            comm.Recv(token, source=0, tag=wire.START)

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
        return self.comm.Irecv(self.pushes[w][0], source=self.servers + w, tag=wire.PUSH)

    def _reply(self, w: int, go: bool) -> None:
        """Send worker w this shard at the current version (``go``), or only the end of the phase."""
        if self.reply_reqs[w] is not None:
            self.reply_reqs[w].Wait()  # the previous reply's buffer (received long ago)
            self.reply_reqs[w] = None
        buf, head, payload = self.replies[w]
        wire.write_reply_head(head, go, self.version)
        if go:
            payload[:] = self.shard.data
            if self.used is not None:
                self.used[w] = self.shard.data
            msg = buf
        else:
            msg = buf[: wire.HEAD_BYTES]
        self.reply_reqs[w] = self.comm.Isend(msg, dest=self.servers + w, tag=wire.REPLY)
        self.bytes_sent += msg.nbytes

    def _apply(self, w: int) -> None:
        """Apply worker w's push on arrival (async, ssp)."""
        _, head, payload = self.pushes[w]
        a, b = self.layout.range(self.rank)
        grad = payload[: b - a]
        tau = self.version - int(head[wire.VPULL])
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
        a, b = self.layout.range(self.rank)
        acc = self.scratch
        acc[:] = self.pushes[round_[0]][2][: b - a]
        for w in round_[1:]:
            acc += self.pushes[w][2][: b - a]
        acc *= self.layout.dtype.type(1.0 / self.workers)
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
        samples = int(head[wire.SAMPLES])
        if self._first_bad is None and not np.isfinite(head[wire.LOSS]):
            self._first_bad = len(self._rows)
        self._rows.append({
            "loss": float(head[wire.LOSS]),
            "train_accuracy": float(head[wire.CORRECT]) / samples if samples else float("nan"),
            "lr": self._lr_used, "worker": w, "tau": tau, "ended": wtime(), "bytes_sent": self.bytes_sent,
        })  # fmt: skip
        if self.layout.bn_packer is not None:
            payload = self.pushes[w][2]
            a, b = self.layout.range(0)
            bn = payload[b - a :][: self.layout.bn_packer.total]
            self.layout.bn_packer.unpack(bn, self.master_bn)

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
        flat = np.empty(self.layout.packer.total, dtype=self.layout.dtype)
        a, b = self.layout.range(0)
        flat[a:b] = self.shard.data
        recvs = []
        for j in range(1, self.servers):
            lo, hi = self.layout.range(j)
            recvs.append(self.comm.Irecv(flat[lo:hi], source=j, tag=wire.SNAPSHOT))
        bn = [buf.copy() for buf in self.master_bn]
        self._snapshots.append({"flat": flat, "bn": bn, "recvs": recvs, "row": len(self._rows) - 1})

    def _send_snapshot(self) -> None:
        """Servers k > 0: send server 0 this shard at the evaluation boundary (earlier sends that
        completed are let go, so a long phase keeps no more copies than server 0 lags behind)."""
        self._snapshots = [snap for snap in self._snapshots if not snap["send"].Test()]
        copy = self.shard.data.copy()
        self._snapshots.append({"send": self.comm.Isend(copy, dest=0, tag=wire.SNAPSHOT), "copy": copy})
        self.bytes_sent += copy.nbytes

    def _load_master(self, flat: np.ndarray, bn: Sequence[np.ndarray]) -> None:
        """Server 0's model takes the master parameters (packed) and BatchNorm statistics, to evaluate."""
        self.layout.packer.unpack(flat, [p.data for p in self.params])
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
        part = self._rows[self._handed : final]
        table = np.array(self._table[self._handed : final], dtype=np.float64).reshape(-1, 5)
        self._early(
            [{k: r[k] for k in ROW_KEYS if k in r} for r in part],
            [r["ended"] for r in part],
            {"staleness": dict(zip(STALENESS, table.T))},
        )
        self._handed, self._handed_at = final, wtime()

    def _server_phase(self, waited: float, busy: float) -> PhaseStats:
        """A server's phase: its waits, its busy fraction; server 0 timed each push it applied."""
        ended = [row.pop("ended") for row in self._rows] if self.rank == 0 else []
        return PhaseStats(
            comm_s=waited, bytes_sent=self.bytes_sent, series={"busy_fraction": busy}, ended=ended
        )

    # -- the meeting ---------------------------------------------------------------------------
    def staleness_rows(self) -> np.ndarray:
        """This phase's staleness rows the driver has not been handed yet, one per push applied."""
        handed = self._handed if self.rank == 0 else 0  # server 0's rows the driver already wrote
        return np.array(self._table[handed:], dtype=np.float64).reshape(-1, 5)

    def summarize(
        self, gathered: list[tuple[bool, np.ndarray]], agreement: PhaseAgreement
    ) -> tuple[Any, ...]:
        """Server 0 at a meeting: fill ``agreement``'s rows and staleness table from the phase and
        every rank's ``(stop, staleness rows)``; returns what every rank learns (steps,
        evaluations, the first non-finite loss, stop votes)."""
        rows = agreement.rows = [{k: r[k] for k in ROW_KEYS if k in r} for r in self._rows]
        bad = next((i for i, r in enumerate(rows) if not np.isfinite(r["loss"])), -1)
        both = np.concatenate([t for _, t in gathered])
        both = both[np.lexsort((both[:, 2], both[:, 0]))]  # by update, then server (stable: worker order)
        if bad >= 0:  # the run ends before the bad push: the file keeps what came before it
            both = both[both[:, 0] <= self.version - len(rows) + bad]
        agreement.tables = {"staleness": dict(zip(STALENESS, both.T))}
        evaluated = [(i, r["test_accuracy"], r["test_loss"]) for i, r in enumerate(rows) if "test_loss" in r]
        return (len(rows), evaluated, bad, sum(int(v) for v, _ in gathered))

    def evaluate_master(self) -> tuple[float, float] | None:
        """Servers k > 0 send their shard; server 0 evaluates the master copy (its result; None elsewhere)."""
        comm = self.comm
        if self.rank != 0:
            comm.Send(self.shard.data, dest=0, tag=wire.SHARD)
            return None
        result = None
        flat = np.empty(self.layout.packer.total, dtype=self.layout.dtype)
        a, b = self.layout.range(0)
        flat[a:b] = self.shard.data
        for j in range(1, self.servers):
            lo, hi = self.layout.range(j)
            comm.Recv(flat[lo:hi], source=j, tag=wire.SHARD)
        self._load_master(flat, self.master_bn)
        parts = self.ctx.evaluation_parts(self.model, EVAL_PART)  # the workers wait anyway: large parts
        while result is None:
            try:
                next(parts)
            except StopIteration as done:
                result = done.value
        return result

    # -- checkpoints -------------------------------------------------------------------------
    def serialize(self, s: Serializer) -> None:
        """Its shard and optimizer state (its piece), version, clocks, bytes sent; server 0 the master
        BatchNorm statistics."""
        s.piece(f"shard {self.rank}", arrays={"shard": self.shard.data}, optimizer=self.optimizer,
                check=lambda pieces: check_shards(self.layout.shards, pieces))  # fmt: skip
        if self.rank == 0:
            s.own_arrays({f"bn{i}": b for i, b in enumerate(self.master_bn)})
        self.version = int(s.value("version", self.version))
        self.clocks[:] = s.value("clocks", self.clocks.tolist())
        self.bytes_sent = int(s.value("bytes_sent", self.bytes_sent))


def check_shards(shards: ShardPlan, pieces: dict[str, dict[str, Any]]) -> None:
    """Refuse checkpoint ``pieces`` whose shards differ in size from ``shards`` (another model or dtype).

    Raises:
        ConfigError: naming the shard that differs.
    """
    for k in range(shards.servers):
        shard = pieces.get(f"shard {k}")
        if shard is None:
            continue
        a, b = shards.ranges[k]
        got = tuple(np.shape(shard["params"]["shard"]))
        if got != (b - a,):
            raise ConfigError(f"it holds another model (shard {k} has {got[0] if got else 0} elements, "
                              f"this model's {b - a})")  # fmt: skip


class _Phase:
    """Server-side bookkeeping of one phase: pushes granted, workers still active, pulls held back."""

    def __init__(self, workers: int, granted: int, target: int) -> None:
        self.active = workers
        self.granted = granted
        self.target = target
        self.stopping = False
        self.deferred: list[int] = []
