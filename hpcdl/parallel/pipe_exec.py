"""The pipeline's executor: one stage's operations of one step's schedule, and what it measured.

A stage runs the operations :mod:`hpcdl.parallel.pipe_plan` gives it, in order: a forward of
microbatch k on one of its chunks receives its input from the stage before (or reads the
batch on the first virtual stage) and sends its output on; a backward receives its output
gradient from the stage after (or takes the loss's on the last) and sends its input
gradient back. Receives are posted :data:`LOOKAHEAD` operations ahead and sends are
nonblocking, so transfers overlap compute. Each forward keeps its layers' cache (the call's
state, :meth:`hpcdl.nn.Layer.save_cache`) until its backward. The executor keeps its own
per-step state and returns what it measured (:class:`StepResult`); the strategy owns the
counters that outlive a step.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hpcdl.backend import synchronize, to_numpy
from hpcdl.comm import waitall, wtime
from hpcdl.nn import Sequential, SoftmaxCrossEntropy, cache_nbytes
from hpcdl.parallel.pipe_plan import Op
from hpcdl.parallel.strategy import RunContext

__all__ = ["EVAL_TAG", "LOOKAHEAD", "Chunk", "Stage", "StepResult", "message_tag", "run_step"]

#: receives are posted for the operations this many ahead of the one running
LOOKAHEAD = 2
#: tag of evaluation messages (training's: :func:`message_tag`, all below it)
EVAL_TAG = 2**15 - 1


def message_tag(virtual: int, k: int, m: int, grad: bool, stages: int) -> int:
    """The tag of microbatch k's activations into virtual stage ``virtual`` (``grad``: of the
    gradient coming back into it) of a pipeline of ``stages`` ranks' stages,
    ``2 (c m + k) + grad`` with ``c = virtual // stages`` the chunk it belongs to. A tag need
    only tell apart the messages between one pair of ranks in one direction, and those are one
    chunk's activations or gradients per microbatch: so the tags of a step of m microbatches
    and v chunks stay below ``2 v m``, whatever the number of stages (and below
    :data:`EVAL_TAG` while ``2 v m <= EVAL_TAG``)."""
    return 2 * ((virtual // stages) * m + k) + int(grad)


@dataclass
class Chunk:
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

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1


@dataclass
class Stage:
    """What a rank runs its part of every step's schedule with (fixed for the run).

    Attributes:
        ctx: the driver's run context (a microbatch's samples and labels, ``trace``).
        comm: the pipeline's communicator (stage s's replicas are its ranks ``first[s]`` to
            ``first[s] + replicas[s] - 1``; unreplicated, rank s is stage s).
        index: s, this rank's stage.
        count: p, the stages of the pipeline.
        chunks: the model chunks this rank holds, by chunk number.
        ops: this stage's operations of the schedule, in order.
        microbatches: m, the microbatches of a step.
        xp: the array module of the config's device.
        dtype: the dtype activations travel in.
        loss_fn: the loss the last virtual stage takes.
        tracing: whether every forward, backward, send and receive goes to ``ctx.trace``.
        note: where the rank notes its phase for stall reports (:func:`hpcdl.comm.notes`).
        replicas: per stage, its ranks (empty: one each); microbatch k of stage s runs on its
            replica ``k mod replicas[s]``.
    """

    ctx: RunContext
    comm: Any
    index: int
    count: int
    chunks: list[Chunk]
    ops: tuple[Op, ...]
    microbatches: int
    xp: Any
    dtype: np.dtype
    loss_fn: SoftmaxCrossEntropy
    tracing: bool
    note: dict[str, Any]
    replicas: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        reps = self.replicas or (1,) * self.count
        self.replicas = tuple(reps)
        self._first = [sum(reps[:s]) for s in range(self.count)]

    def rank_of(self, stage: int, k: int) -> int:
        """The rank (of :attr:`comm`) that runs microbatch ``k`` on ``stage``: its replica ``k mod r``."""
        return self._first[stage] + k % self.replicas[stage]


@dataclass
class StepResult:
    """What one stage measured in one step's operations.

    Attributes:
        loss: the mean loss over the microbatches (the last stage; 0 elsewhere).
        correct: the microbatches' correct predictions (the last stage; 0 elsewhere).
        busy_s: seconds spent in forwards and backwards (the loss included).
        comm_s: seconds spent waiting on receives and, at the end, on sends.
        span: seconds from the first operation's start to the last one's end (before
            the wait on the last sends): the meeting turns it into the bubble.
        bytes_sent: activation and gradient bytes this stage sent.
        peak_bytes: the most bytes of forward caches held at once.
        peak_held: the most microbatches held at once (forwards awaiting their backward).
    """

    loss: float = 0.0
    correct: int = 0
    busy_s: float = 0.0
    comm_s: float = 0.0
    span: float = 0.0
    bytes_sent: int = 0
    peak_bytes: int = 0
    peak_held: int = 0


def run_step(stage: Stage, parts: Sequence[np.ndarray]) -> StepResult:
    """Run this stage's operations of one step on the microbatches ``parts`` (their sample
    indices, one array per microbatch), leaving each chunk's summed gradients in its layers
    and its exchange (all but the last backward of a chunk ``accumulate()``). A replicated
    stage's closing exchange (``AR``) is left to the caller.

    Returns:
        What the stage measured; every send has completed.
    """
    run = _StepRun(stage, parts)
    t_start = wtime()
    for i, op in enumerate(stage.ops):
        run.post(i + LOOKAHEAD)
        if op.kind == "F":
            run.forward(stage.chunks[op.chunk], op.microbatch)
        elif op.kind == "B":
            run.backward(stage.chunks[op.chunk], op.microbatch)
        else:  # a replicated stage's gradient exchange: the strategy's, after the step
            continue
        run.poll_sends()  # completed sends let their buffers go (and MPI progresses them)
    t_ops = wtime()
    run.finish_sends()
    run.result.span = t_ops - t_start
    return run.result


class _StepRun:
    """One step of one stage: the microbatches' caches, receives in flight, sends, the tallies."""

    def __init__(self, stage: Stage, parts: Sequence[np.ndarray]) -> None:
        self.stage, self.parts = stage, parts
        self.result = StepResult()
        self.caches: dict[tuple[int, int], tuple[dict[str, Any], int]] = {}  # (chunk, k) -> (cache, bytes)
        self.grads: dict[int, Any] = {}  # the last stage: the loss gradient of each microbatch
        self.recvs: dict[tuple[str, int, int], tuple[Any, Any]] = {}  # (kind, chunk, k) -> request, buffer
        self.sends: list[tuple[Any, Any, float, int]] = []  # (request, buffer, posted, microbatch)
        self.backwards = [0] * len(stage.chunks)  # this step's backwards so far, per chunk
        self.last_backward = Counter(op.chunk for op in stage.ops if op.kind == "B")  # per chunk
        self.posted = 0  # operations whose receive is posted
        self.held_bytes = self.held = 0
        self.xp, self.dtype, self.m = stage.xp, stage.dtype, stage.microbatches
        self.p = stage.count

    def post(self, upto: int) -> None:
        """Post the receives of the operations before index ``upto`` not yet posted."""
        stage = self.stage
        while self.posted < min(upto, len(stage.ops)):
            op = stage.ops[self.posted]
            self.posted += 1
            chunk, k = stage.chunks[op.chunk], op.microbatch
            if op.kind == "F" and not chunk.first:
                buf = self.xp.empty(chunk.in_shape, dtype=self.dtype)
                tag = message_tag(chunk.index, k, self.m, grad=False, stages=self.p)
                req = stage.comm.Irecv(buf, source=stage.rank_of((chunk.index - 1) % self.p, k), tag=tag)
            elif op.kind == "B" and not chunk.last:
                buf = self.xp.empty(chunk.out_shape, dtype=self.dtype)
                tag = message_tag(chunk.index, k, self.m, grad=True, stages=self.p)
                req = stage.comm.Irecv(buf, source=stage.rank_of((chunk.index + 1) % self.p, k), tag=tag)
            else:
                continue
            self.recvs[(op.kind, op.chunk, k)] = (req, buf)

    def received(self, kind: str, chunk: int, k: int) -> Any:
        """The buffer of a posted receive, once it has arrived (the wait is communication)."""
        req, buf = self.recvs.pop((kind, chunk, k))
        t0 = wtime()
        req.Wait()
        t1 = wtime()
        self.result.comm_s += t1 - t0
        if self.stage.tracing:
            self.stage.ctx.trace("recv", t0, t1, k)  # the part of the transfer it waited for
        return buf

    def send(self, y: Any, dest: int, tag: int, k: int) -> None:
        buf = y if y.flags.c_contiguous else self.xp.ascontiguousarray(y)
        synchronize(buf)  # a GPU buffer must be ready before MPI reads it
        self.sends.append((self.stage.comm.Isend(buf, dest=dest, tag=tag), buf, wtime(), k))
        self.result.bytes_sent += int(buf.nbytes)

    def forward(self, chunk: Chunk, k: int) -> None:
        stage, result = self.stage, self.result
        c = chunk.index // self.p
        if chunk.first:
            x = stage.ctx.batch(self.parts[k])[0]
        else:
            x = self.received("F", c, k)
        stage.note["phase"] = f"forward {k}"
        t0 = wtime()
        y = chunk.model.forward(x)
        if chunk.last:
            labels = stage.ctx.labels(self.parts[k])
            result.loss += stage.loss_fn.forward(y, labels) / self.m  # as sync's accumulation sums it
            result.correct += int(to_numpy(y.argmax(axis=1) == labels).sum())
            self.grads[k] = stage.loss_fn.backward()
        t1 = wtime()
        result.busy_s += t1 - t0
        if stage.tracing:
            stage.ctx.trace("forward", t0, t1, k)
        cache = chunk.model.save_cache()
        size = cache_nbytes(cache)
        self.caches[(c, k)] = (cache, size)
        self.held += 1
        self.held_bytes += size
        result.peak_held = max(result.peak_held, self.held)
        result.peak_bytes = max(result.peak_bytes, self.held_bytes)
        if not chunk.last:
            dest = stage.rank_of((chunk.index + 1) % self.p, k)
            self.send(y, dest, message_tag(chunk.index + 1, k, self.m, grad=False, stages=self.p), k)

    def backward(self, chunk: Chunk, k: int) -> None:
        stage = self.stage
        c = chunk.index // self.p
        gy = self.grads.pop(k) if chunk.last else self.received("B", c, k)
        cache, size = self.caches.pop((c, k))
        stage.note["phase"] = f"backward {k}"
        t0 = wtime()
        chunk.model.load_cache(cache)
        gx = chunk.model.backward(gy)
        t1 = wtime()
        self.result.busy_s += t1 - t0
        if stage.tracing:
            stage.ctx.trace("backward", t0, t1, k)
        self.held -= 1
        self.held_bytes -= size
        self.backwards[c] += 1
        if self.backwards[c] < self.last_backward[c]:
            chunk.exchange.accumulate()  # layers overwrite .grad: the sum is kept there
        if not chunk.first:
            dest = stage.rank_of((chunk.index - 1) % self.p, k)
            self.send(gx, dest, message_tag(chunk.index - 1, k, self.m, grad=True, stages=self.p), k)

    def poll_sends(self) -> None:
        """Let the sends that have completed go (traced with ``log.trace``)."""
        pending = []
        for req, buf, posted, k in self.sends:
            if req.Test():
                if self.stage.tracing:
                    self.stage.ctx.trace("send", posted, wtime(), k)
            else:
                pending.append((req, buf, posted, k))
        self.sends = pending

    def finish_sends(self) -> None:
        t0 = wtime()
        waitall([req for req, *_ in self.sends])
        t1 = wtime()
        self.result.comm_s += t1 - t0
        if self.stage.tracing:
            for _, _, posted, k in self.sends:
                self.stage.ctx.trace("send", posted, t1, k)
        self.sends = []
