"""The driver's loop (Chainer's ``Trainer``): a strategy's steps, and the periodic work at meetings.

:class:`Trainer` runs the strategy's steps and, at meetings only, fires the periodic work
every strategy shares, each an :class:`Extension` with its :class:`Trigger`: evaluation
(``train.eval_every`` or each epoch's end), the last step's row, the run file's flush (at
the meeting that passes a multiple of ``log.flush_every`` steps), progress, the stop vote,
``train.stop_at`` and checkpoints (``checkpoint.every``). An extension whose steps need
every rank (evaluation, stop_at, checkpoint) makes the ranks meet where it fires: a lockstep strategy
that meets every τ steps of its own accord also meets there, so a checkpoint is never late
(the steps are the driver's, not the strategy's); the ranks also meet after the last step.

A strategy that runs free (a :class:`~hpcdl.parallel.FreeRunningStrategy`: parameter servers) is not stepped:
:meth:`Trainer.run` lets it run until the next step at which the driver has work that
needs every rank — a checkpoint, ``train.stop_at``, the end — and it returns the steps
it did (pushes applied); then the ranks meet as above. Such a strategy evaluates on its
own schedule, without a meeting.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from hpcdl.comm import notes, wtime
from hpcdl.driver.context import Context, Slowdown
from hpcdl.driver.figures import samples_per_s as throughput
from hpcdl.driver.progress import Progress
from hpcdl.driver.runlog import RunLog
from hpcdl.driver.signals import StopRequest
from hpcdl.errors import HpcdlError
from hpcdl.nn import LayerProfiler
from hpcdl.parallel import FreeRunningStrategy, LockstepStrategy, StepStats, Strategy
from hpcdl.parallel.strategy import crossed
from hpcdl.store.runfile import heartbeat_now

__all__ = ["Counters", "Extension", "Meeting", "Trainer", "Trigger"]


@dataclass(frozen=True)
class Trigger:
    """When an extension fires: after every ``every``-th step (0: never by period), after step
    ``at`` (0: none), and after the last step when ``end``."""

    every: int = 0
    at: int = 0
    end: bool = False

    def fires(self, before: int, now: int, total: int) -> bool:
        """True when it fires after a step in ``(before, now]`` (the steps since the last meeting)."""
        return (crossed(before, now, self.every) or before < self.at <= now
                or (self.end and now == total))  # fmt: skip

    def next(self, step: int, total: int) -> int:
        """The first step after ``step`` at which it fires (``total`` when none comes before)."""
        due = [total]
        if self.every:
            due.append((step // self.every + 1) * self.every)
        if self.at > step:
            due.append(self.at)
        return min(due)


@dataclass
class Meeting:
    """What a meeting hands the extensions: the steps it closes and what the ranks agreed.

    Attributes:
        before: the step of the previous meeting (the meeting closes ``before + 1 ..`` the step now).
        stop_votes: how many ranks asked to stop.
        row: the last step's row (a lockstep meeting's: its extensions add to it before it is
            written), or None.
        done: the last step's driver-side record (a lockstep meeting's), or None.
        tables: rows of the strategy's declared row groups, written with the last row.
        shown: the meeting has rows to show (a free-running phase may end without any).
    """

    before: int
    stop_votes: int
    row: dict[str, Any] | None = None
    done: Any = None
    tables: dict[str, Any] | None = None
    shown: bool = True


@dataclass(frozen=True)
class Extension:
    """Periodic work of the driver (Chainer's ``Extension``): what fires (:attr:`name`), when
    (:attr:`trigger`; None: at every meeting), whether its steps force a meeting
    (:attr:`needs_all`: the ranks meet at the steps it fires, even between the strategy's own
    meetings), and what it does, ``run(trainer, meeting)``. Every extension runs at a meeting,
    on every rank alike, so any of them may be collective (the flush is).

    The driver's, in the order they fire at a meeting (:meth:`Trainer.extensions`): ``evaluation``
    (a lockstep strategy's: a free-running one evaluates on its own), ``log`` (the last step's
    row), ``flush`` (the run file), ``progress``, ``stop_vote``, ``stop_at``, ``checkpoint``.
    """

    name: str
    trigger: Trigger | None
    run: Callable[[Trainer, Meeting], None]
    needs_all: bool = False

    def fires(self, before: int, now: int, total: int) -> bool:
        """It fires at a meeting closing the steps ``(before, now]``."""
        return self.trigger is None or self.trigger.fires(before, now, total)


@dataclass
class Counters:
    """The driver's running totals on this rank (stored in checkpoints, restored on resume)."""

    compute_s: float = 0.0  # in steps, less their communication
    comm_s: float = 0.0
    elapsed_s: float = 0.0  # since the run began, over every segment
    held_s: float = 0.0  # of it, evaluations and checkpoints that held training up

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


@dataclass
class _Step:
    """A step this rank ran since the last meeting: the strategy's stats and the driver's times."""

    stats: StepStats
    wall_s: float
    other_s: float
    elapsed_s: float  # the run's time when the step ended (a row's ``time``)
    meeting_comm_s: float = 0.0  # the meeting after it communicated this long (its comm, not "other")


@dataclass
class Trainer:
    """Runs ``strategy`` from ``step`` to the end, a stop, or a non-finite loss.

    Args (fields):
        ctx: the run context.
        strategy: this rank's strategy.
        log: the run file's log (rows on rank 0, timings from every rank).
        bar: progress (rank 0).
        stop: this rank's stop flag (a signal sets it).
        save: writes a checkpoint of the state after a step (collective), or does nothing.
        step: steps done (after a resume: the checkpoint's).
        counters: the running totals.
        profiler: the per-layer profiler (``profile.layers``), or None.
        slowdown: this rank's ``debug.slowdown``, or None.
    """

    ctx: Context
    strategy: Strategy
    log: RunLog
    bar: Progress
    stop: StopRequest
    save: Callable[[int], Path | None]
    step: int = 0
    counters: Counters = field(default_factory=Counters)
    profiler: LayerProfiler | None = None
    slowdown: Slowdown | None = None
    history: list[dict[str, float]] = field(default_factory=list)  # rank 0's only when running free
    accuracy: tuple[float, float] = (math.nan, math.nan)  # the last evaluation: accuracy, loss
    evaluated_at: int = -1  # the step of the last evaluation (the same on every rank)
    stopped_by: str = ""
    _pending: list[_Step] = field(default_factory=list)
    _met: int = 0  # the step of the last meeting
    _t_end: float | None = None  # when this rank's previous step ended
    _t_segment: float = 0.0  # when this segment (a run, or a resumed part) began training
    _note: dict[str, Any] = field(default_factory=notes)  # what this rank does, for stall reports
    _meeting_comm: float = 0.0  # communication at the last meeting: not time outside the steps
    _early: list[dict[str, float]] = field(default_factory=list)  # a phase's rows written during it
    _prev_end: float = 0.0  # when the phase's last row so far ended (the row rank's clock)
    _holding: float | None = None  # when the evaluation or checkpoint under way began
    _extensions: dict[str, Extension] = field(default_factory=dict)  # the periodic work (run())
    #: the figures shown last (:meth:`_mark`): a step, the training time and the run's time up to it
    trained: tuple[int, float, float] = (0, 0.0, 0.0)

    def extensions(self) -> dict[str, Extension]:
        """The periodic work of this run, by name, in the order it fires (the same on every rank)."""
        cfg, spe = self.ctx.cfg, self.ctx.steps_per_epoch
        lockstep = not isinstance(self.strategy, FreeRunningStrategy)
        evaluation = Trigger(every=cfg["train.eval_every"] or spe, end=True)  # 0: each epoch's end
        every = [
            Extension("evaluation", evaluation, Trainer._evaluate, needs_all=True) if lockstep else None,
            Extension("log", None, Trainer._write_last_row) if lockstep else None,  # a phase writes its own
            Extension("flush", Trigger(every=cfg["log.flush_every"]), Trainer._flush) if lockstep else None,
            Extension("progress", None, Trainer._show),
            Extension("stop_vote", None, Trainer._count_votes),
            Extension("stop_at", Trigger(at=cfg["train.stop_at"]), Trainer._stop_at, needs_all=True),
            Extension("checkpoint", Trigger(every=cfg["checkpoint.every"]), Trainer._save, needs_all=True),
        ]
        return {e.name: e for e in every if e is not None}

    def _fire(self, meeting: Meeting) -> None:
        """Run the extensions due at this meeting, in their order."""
        total = self.ctx.total_steps
        for ext in self._extensions.values():
            if ext.fires(meeting.before, self.step, total):
                ext.run(self, meeting)

    def _needs_all(self, before: int, now: int) -> bool:
        """Some extension that needs every rank fires after a step in ``(before, now]``."""
        total = self.ctx.total_steps
        return any(e.needs_all and e.fires(before, now, total) for e in self._extensions.values())

    def run(self) -> None:
        """Steps and meetings until the last step, a stop or an error."""
        total = self.ctx.total_steps
        self.ctx.comm.Barrier()  # every rank's clock starts together: run times (trace/) line up across ranks
        self._met, self._t_segment = self.step, wtime()
        self.ctx.start_segment(self.counters.elapsed_s, self._t_segment)  # the run's time, every segment
        self._mark(self.step)
        self._extensions = self.extensions()
        while self.step < total and not self.stopped_by:
            if isinstance(self.strategy, FreeRunningStrategy):
                self._phase()
                continue
            assert isinstance(self.strategy, LockstepStrategy)
            self._one_step()
            own = self.strategy.meets_after(self.step)
            if own or self._needs_all(self.step - 1, self.step) or self.step == total:
                self._meeting()

    def elapsed(self) -> float:
        """Seconds since the run began, every segment included (the context's clock)."""
        return self.ctx.elapsed()

    def end_segment(self) -> None:
        """Add this segment's time to ``counters.elapsed_s`` (once, when the run ends or stops)."""
        self.counters.elapsed_s = self.elapsed()
        self._t_segment = wtime()
        self.ctx.start_segment(self.counters.elapsed_s, self._t_segment)

    def train_time(self, at: float | None = None) -> float:
        """The training time up to run time ``at`` (default: now): the run's time less the
        evaluations and checkpoints that held training up (:mod:`hpcdl.driver.figures`)."""
        return (self.elapsed() if at is None else at) - self.counters.held_s

    @functools.cached_property
    def step_samples(self) -> int:
        """Training samples one step processes (the placement's, worked out once: it counts the
        placement's ranks, and a simulation's N ranks would each count N ranks at every step)."""
        return self.ctx.placement.step_samples

    @property
    def samples_per_s(self) -> float:
        """The run's throughput as last shown (:mod:`hpcdl.driver.figures`): samples processed
        up to the step of the last meeting (or early rows) over the training time up to it."""
        step, seconds, _ = self.trained
        return throughput(step * self.step_samples, seconds)

    @contextmanager
    def holding(self) -> Iterator[None]:
        """Time an evaluation or a checkpoint: not training time (``counters.held_s``)."""
        self._holding = t0 = wtime()
        try:
            yield
        finally:
            self._holding = None
            self.counters.held_s += wtime() - t0

    def saved_counters(self) -> dict[str, float]:
        """The counters a checkpoint stores: the run's time so far, and the checkpoint under way
        (if any) held up to now, so that a resumed run goes on with the same figures."""
        held = wtime() - self._holding if self._holding is not None else 0.0
        return {**self.counters.as_dict(), "elapsed_s": self.elapsed(), "held_s": self.counters.held_s + held}

    def _mark(self, step: int, at: float | None = None) -> None:
        """The figures after ``step``, which ended at run time ``at`` (default: now; its row's
        ``time``): for progress, the run file's attributes at its next write, and the summary."""
        at = self.elapsed() if at is None else at
        self.trained = (step, self.train_time(at), at)
        self.log.figures = {"wall_s": at, "samples_per_s": self.samples_per_s}

    def _progress(self, loss: float) -> None:
        """Show the figures of the last :meth:`_mark`, with ``loss``."""
        step, _, at = self.trained
        self.bar.update(step, loss=loss, samples_per_s=self.samples_per_s, time_s=at)

    def _one_step(self) -> None:
        t0 = wtime()
        other = t0 - self._t_end - self._meeting_comm if self._t_end is not None else 0.0
        self._meeting_comm = 0.0
        self._note["step"], self._note["phase"] = self.step + 1, "step"
        with self.ctx.observing(self.profiler, self.slowdown):
            stats = self.strategy.step(self.step)
        self._t_end = wtime()
        wall = self._t_end - t0
        self.step += 1
        self.counters.compute_s += wall - stats.comm_s
        self.counters.comm_s += stats.comm_s
        self._pending.append(_Step(stats, wall, other, self.elapsed()))

    def _next_meeting(self) -> int:
        """The next step at which an extension needs every rank (a checkpoint, ``train.stop_at``), or
        the end: a free-running strategy runs until then (its evaluations are its own business)."""
        total = self.ctx.total_steps
        return min(e.trigger.next(self.step, total) for e in self._extensions.values()
                   if e.needs_all and e.trigger is not None)  # fmt: skip

    def _phase(self) -> None:
        """Let a free-running strategy run to the next meeting, then meet: rows, evaluations, a
        stop, a checkpoint.

        The steps' rows are rank 0's (the row rank's clock times them); each rank's time
        over the phase makes one row of ``ranks/`` (a meeting, not a step: with 1,024
        workers and 10,000 pushes a row per step and rank would dwarf the run).
        """
        t0 = wtime()
        other = t0 - self._t_end if self._t_end is not None else 0.0
        self._note["step"], self._note["phase"] = self.step + 1, "running free"
        self._early, self._prev_end = [], t0
        early = self._write_early if self.ctx.rank == self.strategy.row_rank else None
        with self.ctx.observing(self.profiler, self.slowdown):
            phase = self.strategy.run_until(self.step, self._next_meeting(), self.stop, early)
        t_run = wtime()
        self._note["phase"] = "metrics and stop vote"
        agreed = self.strategy.meet(phase, self.stop.requested)
        self._t_end = wtime()
        first, n = self.step + 1, agreed.steps
        if agreed.bad >= 0:  # the rows before it are kept
            n = agreed.bad
            agreed.rows = agreed.rows[:n]
            agreed.evaluated = [e for e in agreed.evaluated if e[0] < n]
        wall, meeting = t_run - t0, self._t_end - t_run
        self.counters.compute_s += wall - phase.comm_s
        self.counters.comm_s += phase.comm_s + meeting
        done = len(self._early)  # rows written during the phase
        rows = self._phase_rows(first + done, agreed.rows[done:], phase.ended[done:], phase.bytes_sent)
        for i, acc, loss in agreed.evaluated:
            self.accuracy, self.evaluated_at = (acc, loss), first + i
            self._say_accuracy(first + i, (first + i - 1) // self.ctx.steps_per_epoch)
        self.history.extend([*self._early, *rows])
        self.step += n
        shown = n > 0 and bool(self.history)  # the row rank's rows: the figures up to the last push
        if shown:
            self._mark(self.step, at=self.history[-1]["time"])
        self._note["phase"] = "run file"
        self.log.record_phase(rows, self.step, wall - phase.comm_s, phase.comm_s + meeting, other,
                              phase.series, agreed.tables)  # fmt: skip
        if agreed.bad >= 0:
            self._fail(
                f"loss is not finite at step {first + agreed.bad}: stopped; the last good checkpoint is "
                "kept (lower optimizer.lr, or ps.compensation = 'lr' for stale pushes)"
            )
        self._fire(Meeting(first - 1, agreed.stop_votes, shown=shown))
        self._met = self.step

    def _write_early(self, rows: list[dict[str, float]], ended: list[float], tables: dict[str, Any]) -> None:
        """The row rank, during a phase: the strategy's first final rows go to the run file now."""
        built = self._phase_rows(self.step + 1 + len(self._early), rows, ended, 0)
        self._early.extend(built)
        last = built[-1]
        self._mark(last["step"], at=last["time"])  # the throughput up to this push
        self.log.write_rows(built, tables)
        self._progress(last["loss"])

    def _phase_rows(
        self, first: int, rows: list[dict[str, float]], ended: list[float], bytes_sent: int
    ) -> list[dict[str, float]]:
        """Rank 0's metrics rows: the strategy's, with the driver's columns and times.

        A step's time runs from the previous step's end (the phase's start for its first).
        ``bytes_sent``: the rank's running total, unless the strategy's row gives its own.
        """
        spe, per_step = self.ctx.steps_per_epoch, self.step_samples
        out = []
        for i, (row, end) in enumerate(zip(rows, ended)):
            step, wall = first + i, end - self._prev_end
            self._prev_end = end
            out.append({
                "step": step, "epoch": (step - 1) // spe, "samples": step * per_step,
                "bytes_sent": bytes_sent, **row, "step_time": wall,
                "samples_per_s": per_step / wall if wall > 0 else math.nan,
                "time": self.counters.elapsed_s + end - self._t_segment,
            })  # fmt: skip
        return out

    def _meeting(self) -> None:
        """A lockstep meeting: agree, the rows, then the extensions due (evaluation, the last row,
        a flush, progress, a stop, a checkpoint)."""
        steps, self._pending = self._pending, []
        first = self.step - len(steps) + 1
        self._note["phase"] = "metrics and stop vote"
        agreed = self.strategy.agree([s.stats for s in steps], self.stop.requested)
        if agreed.bytes_sent is not None:  # the meeting sent data: the last step's running total
            steps[-1].stats.bytes_sent = agreed.bytes_sent
        steps[-1].meeting_comm_s = self._meeting_comm = agreed.comm_s  # counted with the last step
        self.counters.comm_s += agreed.comm_s
        self._mark(self.step, at=steps[-1].elapsed_s)  # the figures up to the end of the last step
        for i, (done, agreed_row) in enumerate(zip(steps, agreed.rows)):
            row = self._row(first + i, done, agreed_row)  # a loss not finite ends it (the rows before kept)
            if i < len(steps) - 1:
                self._write(row, done)  # the last one after the extensions that add to it
        self._fire(Meeting(first - 1, agreed.stop_votes, row, steps[-1], agreed.tables))
        self._met = self.step

    def _row(self, step: int, done: _Step, agreed: dict[str, float]) -> dict[str, Any]:
        """One step's row: the agreed metrics and this rank's times.

        Raises:
            HpcdlError: the loss is not finite (the rows before it are written first).
        """
        if not math.isfinite(agreed["loss"]):
            self._fail(
                f"loss is {agreed['loss']} at step {step}: stopped; the last good checkpoint is kept "
                "(lower optimizer.lr or check the data)"
            )
        spe, stats, per_step = self.ctx.steps_per_epoch, done.stats, self.step_samples
        rate = per_step / done.wall_s if done.wall_s > 0 else math.nan  # no time: none
        return {"step": step, "epoch": (step - 1) // spe, "samples": step * per_step, **agreed,
                "lr": stats.lr, "step_time": done.wall_s, "samples_per_s": rate,
                "bytes_sent": stats.bytes_sent, "time": done.elapsed_s}  # fmt: skip

    def _write(self, row: dict[str, Any], done: _Step, tables: dict[str, Any] | None = None) -> None:
        """Hand a row and this rank's times for its step to the run file's log (buffered)."""
        stats = done.stats
        self.history.append(row)
        self._note["phase"] = "run file"
        comm = stats.comm_s + done.meeting_comm_s
        compute = done.wall_s - stats.comm_s
        self.log.record(row, compute, comm, stats.exposed_s, done.other_s, stats.series, tables)

    # -- the extensions' work (Trainer.extensions) ------------------------------------------------
    def _evaluate(self, meeting: Meeting) -> None:
        """Evaluate (collective) and put the figures into the meeting's last row."""
        assert meeting.row is not None
        self._note["phase"] = "evaluation"
        with self.holding():
            self.accuracy, self.evaluated_at = self.strategy.evaluate(), self.step
        acc, loss = self.accuracy
        meeting.row.update(test_accuracy=acc, test_loss=loss)
        self._say_accuracy(self.step, meeting.row["epoch"])

    def _write_last_row(self, meeting: Meeting) -> None:
        self._write(meeting.row, meeting.done, meeting.tables)  # type: ignore[arg-type]

    def _flush(self, meeting: Meeting) -> None:
        """Write the buffered rows and times (collective: every rank meets at a lockstep meeting)."""
        self._note["phase"] = "run file"
        self.log.flush()

    def _show(self, meeting: Meeting) -> None:
        if meeting.shown and self.history:
            self._progress(self.history[-1]["loss"])

    def _count_votes(self, meeting: Meeting) -> None:
        if meeting.stop_votes and not self.stopped_by:
            self.stopped_by = self.stop.name or "a signal to another rank"

    def _stop_at(self, meeting: Meeting) -> None:
        if not self.stopped_by and self.step < self.ctx.total_steps:
            self.stopped_by = f"train.stop_at = {self.ctx.cfg['train.stop_at']}"

    def _save(self, meeting: Meeting) -> None:
        """A checkpoint (collective), unless the run stops here (the stop writes its own) or ends."""
        if not self.stopped_by and self.step < self.ctx.total_steps:
            with self.holding():
                self.save(self.step)

    def _fail(self, message: str) -> NoReturn:
        """End the run on every rank alike (a non-finite loss): the file closed as failed, then raise.

        The barrier lets rank 0 finish writing before any rank raises: a rank that raised
        first would end the job (the abort handler, the simulator) with the rows unwritten.
        """
        self.log.close("failed", end_time=heartbeat_now())
        self.ctx.comm.Barrier()
        raise HpcdlError(message)

    def _say_accuracy(self, step: int, epoch: int) -> None:
        acc, loss = self.accuracy
        self.bar.write(f"step {step} epoch {epoch}: test accuracy {100 * acc:.2f}%  loss {loss:.4f}")
