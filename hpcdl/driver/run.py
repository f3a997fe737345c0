"""One training run: plan, build, open the run file, resume, train, finish (:func:`train`)."""

from __future__ import annotations

import contextlib
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcdl.comm import Communicator, StallError, long_wait, notes, on_root, slow_down, world
from hpcdl.config import Config
from hpcdl.driver.checkpoints import DRIVER, capture, distribute
from hpcdl.driver.context import Context, Slowdown, slowdown_factor
from hpcdl.driver.figures import rate_phrase, samples_per_s, wall_phrase
from hpcdl.driver.loop import Counters, Trainer
from hpcdl.driver.memory import check as check_memory
from hpcdl.driver.progress import Progress, choose_mode
from hpcdl.driver.runlog import RunLog, checkpoint_attrs, open_run, peak_rss_mb
from hpcdl.driver.settle import PlanInputs, continue_legacy, settle, settle_convolutions, stored_config
from hpcdl.driver.signals import current_stop_request
from hpcdl.errors import HpcdlError
from hpcdl.nn import LayerProfiler
from hpcdl.parallel import Placement, Strategy, strategy_class
from hpcdl.parallel.strategy import check_keys
from hpcdl.store.checkpoint import checkpoint_path, prune_checkpoints, save_checkpoint
from hpcdl.store.runfile import heartbeat_now

__all__ = ["RunResult", "build", "plan", "train"]


@dataclass
class RunResult:
    """What a training run returns (rank 0's view; the metrics are global).

    ``wall_s``, ``train_s`` and ``samples_per_s`` are the run's figures
    (:mod:`hpcdl.driver.figures`: every segment of a resumed run, rank 0's clock, the same
    on every rank): its wall time, its training time (the wall time less evaluations
    and checkpoints) and the samples processed over that. ``compute_s`` and ``comm_s``
    are this rank's own time computing and communicating in steps.
    """

    config: Config
    ranks: int
    steps: int
    epochs: float
    test_accuracy: float
    test_loss: float
    wall_s: float
    train_s: float
    samples_per_s: float
    compute_s: float
    comm_s: float
    strategy: Strategy
    history: list[dict[str, float]] = field(default_factory=list)
    profile: list[dict[str, Any]] | None = None
    run_file: Path | None = None
    checkpoint: Path | None = None
    stopped_by: str = ""

    @property
    def model(self) -> Any:
        """This rank's model, when its strategy has one."""
        return getattr(self.strategy, "model", None)

    @property
    def optimizer(self) -> Any:
        """This rank's optimizer, when its strategy has one."""
        return getattr(self.strategy, "optimizer", None)

    def summary(self) -> str:
        """The one summary line printed at the end of a run."""
        acc = self.test_accuracy
        accuracy = f"{100 * acc:.2f}%" if math.isfinite(acc) else "not evaluated"
        return (
            f"{self.config['name']}: test accuracy {accuracy} | "
            f"{self.steps} steps ({self.epochs:g} epochs) on {self.ranks} rank{'s' * (self.ranks > 1)} | "
            f"{wall_phrase(self.wall_s)} | {rate_phrase(self.samples_per_s)}"
            + (f" | run file {self.run_file}" if self.run_file is not None else "")
        )


def plan(cfg: Config, world_size: int) -> Placement:
    """The placement of ``parallel.strategy`` for ``world_size`` ranks (pure: nothing is built).

    Raises:
        ConfigError: the strategy is unknown, cannot honour a key the config sets
            (:func:`~hpcdl.parallel.strategy.check_keys`) or does not fit the rank count.
    """
    cls = strategy_class(cfg["parallel.strategy"])
    check_keys(cfg)
    return cls.plan(cfg, world_size)


def build(cfg: Config, comm: Communicator, stored: dict[str, Any] | None = None) -> tuple[Context, Strategy]:
    """The run context and this rank's strategy (``parallel.strategy``), built: what a run or a
    benchmark (``bench train``) steps. First the strategy settles what it works out from the
    model (:func:`hpcdl.driver.settle.settle`; ``stored``: the config of the run being resumed);
    before it builds anything, the ranks check that they fit in memory
    (:func:`hpcdl.driver.memory.check`), and then settle which convolutions multiply by Winograd
    (:func:`hpcdl.driver.settle.settle_convolutions`).

    Raises:
        HpcdlError: the strategy is unknown or does not fit, the data or model cannot be built,
            the ranks' estimated memory exceeds a limit.
    """
    cfg = settle(cfg, comm.Get_size(), comm, PlanInputs(cfg, stored=stored))
    ctx = Context(cfg, comm, plan(cfg, comm.Get_size()))
    check_memory(comm, cfg, ctx.placement, ctx.data())
    cfg = ctx.cfg = settle_convolutions(cfg, comm, PlanInputs(cfg, ctx.data(), stored))
    cls = strategy_class(cfg["parallel.strategy"])
    strategy = cls(ctx)
    if comm.Get_rank() == 0:
        for line in cls.advice(cfg, ctx.placement):
            print(f"hpcdl.train: ! {line}", file=sys.stderr, flush=True)
        for line in strategy.remarks():
            print(f"hpcdl.train: {line}", file=sys.stderr, flush=True)
    return ctx, strategy


def train(
    cfg: Config,
    comm: Communicator | None = None,
    progress: str = "none",
    out: str | os.PathLike[str] | None = None,
    resume: str | None = None,
    take_over: bool = False,
) -> RunResult:
    """Train as ``cfg`` says on ``comm`` (default: :func:`hpcdl.comm.world`), with its strategy.

    Args:
        cfg: a validated config.
        comm: the world; one rank trains alone, N ranks as ``parallel.strategy`` places them.
        progress: ``bar``, ``lines``, ``none`` (rank 0 only) or ``auto``.
        out: the run file (HDF5) to write, checkpoints beside it; None writes nothing.
        resume: ``auto`` or a checkpoint path to continue from (``auto`` needs ``out``).
        take_over: continue ``out`` even though its writer looks alive (the user knows it is
            dead); without it such a resume is refused.

    Returns:
        The result, the same on every rank except for local timings; ``stopped_by`` is set
        when a stop was honoured at a meeting.

    Raises:
        HpcdlError: the data set does not fit the placement, a checkpoint does not fit,
            the loss is not finite, and the like.
    """
    comm = comm or world()
    factor = slowdown_factor(cfg, comm.Get_rank(), comm.Get_size())
    stored = on_root(comm, lambda: stored_config(out, resume))
    cfg, lines = continue_legacy(cfg, stored)
    if comm.Get_rank() == 0:
        for line in lines:
            print(f"hpcdl.train: {line}", file=sys.stderr, flush=True)
    ctx, strategy = build(cfg, comm, stored)
    try:
        path = Path(out) if out is not None else None
        return _run(ctx, strategy, factor, progress, path, resume, take_over)
    except HpcdlError as err:  # a user error, raised alike on every rank: they free the communicators
        if not isinstance(err, StallError):  # (a stall: some rank is gone; the job is ending)
            with contextlib.suppress(Exception):  # collectives left in flight by the error: never mind
                strategy.close()
        raise


def _run(
    ctx: Context,
    strategy: Strategy,
    factor: float,
    progress: str,
    run_path: Path | None,
    resume: str | None,
    take_over: bool = False,
) -> RunResult:
    """Open the run file (and the checkpoint to continue from), train, finish."""
    comm, cfg, placement = ctx.comm, ctx.cfg, ctx.placement
    opened = open_run(comm, cfg, placement, run_path, resume, strategy, take_over)
    rank0 = comm.Get_rank() == 0
    bar = Progress(choose_mode(progress), ctx.total_steps, cfg["train.log_every"], active=rank0,
                   every_s=cfg["train.log_every_s"], start=opened.step or 0)  # fmt: skip
    trainer = Trainer(
        ctx,
        strategy,
        log=RunLog(comm, opened.runfile, placement, strategy.rank_series, ctx.events),
        bar=bar,
        stop=current_stop_request(),
        save=lambda step: _checkpoint(trainer, run_path, step),
        profiler=LayerProfiler() if cfg["profile.layers"] else None,
        # a simulated world scales the rank's modelled compute itself (and resets it at 1.0)
        slowdown=Slowdown(factor) if not slow_down(factor) and factor != 1.0 else None,
    )
    if opened.step is not None:  # each rank receives its own part only
        state = distribute(comm, opened.checkpoint, placement)
        saved = state.meta.pop(DRIVER, {})  # this rank's own counters
        strategy.load_state(state)
        if opened.runfile is not None:  # what the strategy put back (sync's auto table) is what runs
            opened.runfile.set_attrs(**strategy.run_attrs())
        trainer.step = opened.step
        trainer.counters = Counters(**{k: float(saved.get(k, v)) for k, v in Counters().as_dict().items()})
    try:
        trainer.run()
        return _finish(trainer, run_path)
    except BaseException as exc:
        trainer.log.abandon(*_ending(exc))
        raise
    finally:
        trainer.bar.close()


def _ending(exc: BaseException) -> tuple[str, str]:
    """The status a run ended by ``exc`` records, and why: ``interrupted`` (a second Ctrl-C),
    ``stalled`` (the stall watchdog's report) or ``failed`` (the error's line)."""
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted", ""
    if isinstance(exc, StallError):
        return "stalled", str(exc)
    if isinstance(exc, HpcdlError):
        return "failed", str(exc)
    return "failed", f"{type(exc).__name__}: {exc}"


def _finish(trainer: Trainer, run_path: Path | None) -> RunResult:
    """After the last step or a stop: a last evaluation, the last checkpoint, the file's summary."""
    ctx, strategy = trainer.ctx, trainer.strategy
    if not trainer.stopped_by and trainer.evaluated_at != trainer.step:  # the end not yet evaluated
        notes()["phase"] = "evaluation"
        with trainer.holding():
            trainer.accuracy = strategy.evaluate()
    with trainer.holding():
        ckpt_path = _checkpoint(trainer, run_path, trainer.step)
    trainer.end_segment()
    counters = trainer.counters
    # the figures as progress showed them last (hpcdl.driver.figures): rank 0's, on every rank
    step, train_s, _ = trainer.trained
    wall_s, train_s = ctx.comm.bcast((counters.elapsed_s, train_s), root=0)
    rate = samples_per_s(ctx.placement.step_samples * step, train_s)
    runfile = trainer.log.runfile
    profile = _profile(ctx.comm, trainer.profiler)
    ops = _profile_ops(ctx.comm, trainer.profiler)
    if runfile is not None and profile is not None:
        runfile.write_profile(profile, ops or ())
    acc, loss = trainer.accuracy
    trainer.log.close(
        "stopped" if trainer.stopped_by else "finished",
        end_time=heartbeat_now(),
        wall_s=wall_s,
        final_test_accuracy=acc,
        samples_per_s=rate,
        peak_rss_mb=peak_rss_mb(),  # the process's: all virtual ranks of a simulation together
    )
    strategy.close()
    return RunResult(
        config=ctx.cfg, ranks=ctx.comm.Get_size(), steps=trainer.step,
        epochs=round(trainer.step / ctx.steps_per_epoch, 3), test_accuracy=acc, test_loss=loss,
        wall_s=wall_s, train_s=train_s, samples_per_s=rate, compute_s=counters.compute_s,
        comm_s=counters.comm_s, strategy=strategy, history=trainer.history,
        profile=profile,
        run_file=run_path, checkpoint=ckpt_path, stopped_by=trainer.stopped_by,
    )  # fmt: skip


def _profile(comm: Communicator, profiler: LayerProfiler | None) -> list[dict[str, Any]] | None:
    """The per-layer profile: rank 0's rows, then the layers only other ranks ran (a pipeline's
    later stages), in rank order (collective when profiling)."""
    if profiler is None:
        return None
    own = profiler.table()
    tables = comm.gather(own, root=0)
    if tables is None:
        return own
    rows: dict[str, dict[str, Any]] = {}
    for table in tables:
        for row in table:
            rows.setdefault(row["layer"], row)
    return list(rows.values())


def _profile_ops(comm: Communicator, profiler: LayerProfiler | None) -> list[dict[str, Any]] | None:
    """The profiled ops (K-FAC's): rank 0's rows, then the op and dimensions only other ranks ran
    (the eigendecompositions other ranks own), in rank order (collective when profiling)."""
    if profiler is None:
        return None
    tables = comm.gather(profiler.ops_table(), root=0)
    if tables is None:
        return None
    rows: dict[tuple[str, tuple[int, ...]], dict[str, Any]] = {}
    for table in tables:
        for row in table:
            rows.setdefault((row["op"], tuple(row["dims"])), row)
    return list(rows.values())


def _checkpoint(trainer: Trainer, run_path: Path | None, step: int) -> Path | None:
    """Flush the log, then write a checkpoint of the state after ``step`` (collective, at a meeting).

    The other ranks wait while rank 0 writes — a wait the stall watchdog takes as long by
    design, up to ten stall limits — and all learn whether it worked: a failed write (a
    full disk) ends every rank with the same error.
    """
    if run_path is None:
        return None
    ctx = trainer.ctx
    notes()["phase"] = "checkpoint"
    trainer.log.flush()
    counters = trainer.saved_counters()
    ckpt = capture(ctx.comm, trainer.strategy, ctx.placement, ctx.cfg, step=step,
                   epoch=step // ctx.steps_per_epoch, counters=counters,
                   attrs=checkpoint_attrs(run_path))  # fmt: skip

    def write() -> str:
        assert ckpt is not None
        path = save_checkpoint(ckpt, checkpoint_path(run_path, step))
        prune_checkpoints(run_path, ctx.cfg["checkpoint.keep"])
        return str(path)

    with long_wait("rank 0 writes a checkpoint", limit_s=10 * ctx.cfg["debug.stall_s"] or None):
        return Path(on_root(ctx.comm, write))
