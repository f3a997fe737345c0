"""A parameter-server worker (:class:`PsWorker`): pull every shard, compute a batch, push the gradient.

Worker w samples as data-parallel member w of W. In a phase it tells server 0 it is ready,
then loops: wait for the servers' replies (its pull), compute forward and backward on its
next batch, push the gradient's shards, until server 0's reply says the phase is over; it
then tells the other servers it is done. The protocol is in :mod:`hpcdl.parallel.ps`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hpcdl.comm import Communicator, notes, waitall, wtime
from hpcdl.nn import Sequential, SoftmaxCrossEntropy
from hpcdl.parallel import ps_wire as wire
from hpcdl.parallel.common import forward_backward
from hpcdl.parallel.ps_plan import PsSettings
from hpcdl.parallel.ps_wire import MessageLayout
from hpcdl.parallel.state import Serializer
from hpcdl.parallel.strategy import Batches, PhaseStats, RunContext

__all__ = ["PsWorker"]


class PsWorker:
    """Worker ``rank - S``: a copy of the model it refreshes from the servers' replies.

    Args:
        ctx: the driver's run context.
        comm: the strategy's own communicator (its tags).
        settings: the strategy's settings.
    """

    #: a worker steps no optimizer (the servers do)
    optimizer = None

    def __init__(self, ctx: RunContext, comm: Communicator, settings: PsSettings) -> None:
        self.ctx, self.comm = ctx, comm
        self.servers = settings.servers
        self.model: Sequential = ctx.build_model()
        self.params = self.model.parameters()
        self.buffers = [b for _, b in self.model.named_buffers()]
        self.layout = MessageLayout(self.params, self.buffers, self.servers)
        self.rank = comm.Get_rank()
        self.bytes_sent = 0
        self._note = notes()
        self.w = self.rank - self.servers
        self.sampler = ctx.sampler(self.w)
        self.loss_fn = SoftmaxCrossEntropy()
        self.clock = 0  # pushes of this worker applied
        dtype = self.layout.dtype
        self.flat = np.empty(self.layout.packer.total, dtype=dtype)
        self.pushes = [wire.message(self.layout.push_bytes(k), dtype) for k in range(self.servers)]
        self.replies = [wire.message(self.layout.reply_bytes(k), dtype) for k in range(self.servers)]
        self.push_reqs: list[Any] = [None] * self.servers
        self.v_pull = np.zeros(self.servers, dtype=np.int64)
        self.batches = Batches(self.sampler)

    def run_until(self, stop: Any) -> PhaseStats:
        """One phase: work until server 0 says it is over; this worker's pushes per second."""
        pushes, wall, comm_s = self._work(stop)
        rate = pushes / wall if wall > 0 else float("nan")
        return PhaseStats(comm_s=comm_s, bytes_sent=self.bytes_sent, series={"pushes_per_s": rate})

    def _work(self, stop: Any) -> tuple[int, float, float]:
        """Pull, compute, push, until server 0 says the phase is over: pushes, wall and comm seconds."""
        comm, servers = self.comm, self.servers
        t_begin = wtime()
        comm_s = 0.0
        comm.Send(np.zeros(1, dtype=np.float64), dest=0, tag=wire.READY)
        self._note.pop("step", None)  # a worker knows its own pushes, not the servers' step
        pushes = 0
        while True:
            # the reply: at once (async), or once the workers at the lowest clock have pushed
            # (ssp, sync), each computing one batch meanwhile: a wait of one step, watched as such
            t0 = wtime()
            reqs = [comm.Irecv(self.replies[k][0], source=k, tag=wire.REPLY) for k in range(servers)]
            reqs[0].Wait()
            go = bool(self.replies[0][1][wire.GO])
            if not go:  # the phase is over: the other servers are told, their answers taken
                done = wire.done_head()
                for k in range(1, servers):
                    comm.Send(done, dest=k, tag=wire.PUSH)
            waitall([*reqs[1:], *self.push_reqs])
            self.push_reqs = [None] * servers
            comm_s += wtime() - t0
            if not go:
                break
            for k in range(servers):
                a, b = self.layout.range(k)
                _, head, payload = self.replies[k]
                self.flat[a:b] = payload
                self.v_pull[k] = int(head[wire.VERSION])
            self.layout.packer.unpack(self.flat, [p.data for p in self.params])
            self._note["phase"] = "forward/backward"
            indices = self.batches.next()
            x, y = self.ctx.batch(indices)
            loss, correct = forward_backward(self.model, self.loss_fn, x, y)
            grads = self.layout.packer.pack([p.grad for p in self.params])
            t0 = wtime()
            self._push(grads, loss, correct, len(indices), stop.requested)
            comm_s += wtime() - t0
            pushes += 1
            self._note["phase"], self._note["pushes"] = "waiting for the servers", self.clock
        return pushes, wtime() - t_begin, comm_s

    def _push(self, grads: np.ndarray, loss: float, correct: int, samples: int, stop: bool) -> None:
        """This worker's gradient, a shard to each server, with what the servers record."""
        bn_packer = self.layout.bn_packer
        for k in range(self.servers):
            buf, head, payload = self.pushes[k]
            a, b = self.layout.range(k)
            wire.write_push_head(head, self.clock, self.v_pull[k], stop, samples, correct, loss)
            payload[: b - a] = grads[a:b]
            if k == 0 and bn_packer is not None:
                payload[b - a :][: bn_packer.total] = bn_packer.pack(self.buffers)
            self.push_reqs[k] = self.comm.Isend(buf, dest=k, tag=wire.PUSH)
            self.bytes_sent += buf.nbytes
        self.clock += 1

    # -- checkpoints -------------------------------------------------------------------------
    def serialize(self, s: Serializer) -> None:
        """Its BatchNorm statistics, sampler, random streams, clock and bytes sent."""
        s.own_buffers(self.model)
        s.random(self.ctx)
        s.stateful("sampler", self.sampler)
        self.clock = int(s.value("clock", self.clock))
        self.bytes_sent = int(s.value("bytes_sent", self.bytes_sent))
        if s.loading:
            self.batches.restart()
