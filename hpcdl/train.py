"""``python -m hpcdl.train``: train a model, in one process or data-parallel under mpiexec."""

from __future__ import annotations

import argparse
import datetime
import math
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hpcdl import comm as ops  # ops.SUM resolved at use: importing this module starts no MPI
from hpcdl.backend import array_module, to_numpy
from hpcdl.comm import Communicator, long_wait, notes, watch, world, wtime
from hpcdl.config import Config, add_set_argument, load_config
from hpcdl.data import DistributedSampler, gather_batch
from hpcdl.driver import launch
from hpcdl.driver.checkpoints import capture, restore
from hpcdl.driver.cli import ArgumentParser, parse_args, python_command
from hpcdl.driver.factory import (
    build,
    evaluate,
    exchange_for,
    load_data,
    make_optimizer,
    make_schedule,
    observers,
)
from hpcdl.driver.progress import Progress, choose_mode
from hpcdl.driver.runlog import RunLog, checkpoint_attrs, now, open_run, peak_rss_mb
from hpcdl.driver.signals import current_stop_request
from hpcdl.errors import ConfigError, DataError, FileError, HpcdlError
from hpcdl.nn import LayerProfiler, Sequential, SoftmaxCrossEntropy
from hpcdl.optim import Optimizer
from hpcdl.rng import generator
from hpcdl.store.checkpoint import (
    checkpoint_path,
    prune_checkpoints,
    save_checkpoint,
)

__all__ = ["main", "run", "RunResult", "build_parser"]


@dataclass
class RunResult:
    """What a training run returns (rank 0's view; metrics are global)."""

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
    model: Sequential
    optimizer: Optimizer
    history: list[dict[str, float]] = field(default_factory=list)
    profile: list[dict[str, Any]] | None = None
    run_file: Path | None = None
    checkpoint: Path | None = None
    stopped_by: str = ""

    def summary(self) -> str:
        """The one summary line printed at the end of a run."""
        acc = self.test_accuracy
        accuracy = f"{100 * acc:.2f}%" if math.isfinite(acc) else "not evaluated"
        return (
            f"{self.config['name']}: test accuracy {accuracy} | "
            f"{self.steps} steps ({self.epochs:g} epochs) on {self.ranks} rank{'s' * (self.ranks > 1)} | "
            f"wall {self.wall_s:.1f} s | {self.samples_per_s:.0f} samples/s"
            + (f" | run file {self.run_file}" if self.run_file is not None else "")
        )


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="python -m hpcdl.train",
        description="Train a model: in one process, or data-parallel on N ranks under mpiexec -n N.",
    )
    parser.add_argument("--config", required=True, help="a preset name (e.g. digits-mlp) or a TOML file")
    add_set_argument(parser)
    parser.add_argument(
        "--out", default=None, help="the HDF5 run file to write (default: runs/<name>-<UTC time>.h5)"
    )
    parser.add_argument(
        "--resume",
        default=None,
        metavar="CHECKPOINT|auto",
        help="continue from a checkpoint, or auto: the newest valid one of --out (default: a fresh run)",
    )
    parser.add_argument(
        "--progress",
        choices=("auto", "bar", "lines", "none"),
        default="auto",
        help="auto: a bar when interactive, plain lines in batch jobs",
    )
    return parser


def run(
    cfg: Config,
    comm: Communicator | None = None,
    progress: str = "none",
    out: str | os.PathLike[str] | None = None,
    resume: str | None = None,
) -> RunResult:
    """Train as ``cfg`` says on ``comm`` (default: :func:`hpcdl.comm.world`).

    Args:
        cfg: a validated config.
        comm: the communicator; one rank trains alone, N ranks data-parallel.
        progress: ``bar``, ``lines``, ``none`` (rank 0 only) or ``auto``.
        out: the run file (HDF5) to write, checkpoints beside it; None writes nothing.
        resume: ``auto`` or a checkpoint path to continue from (needs ``out`` for
            ``auto``).

    Returns:
        The result, identical on every rank except for local timings; ``stopped``
        is set when a stop was requested (a signal) and honoured at a step boundary.

    Raises:
        HpcdlError: the data set does not fit the rank count and batch size, a
            checkpoint does not fit, the loss is not finite, and the like.
    """
    comm = comm or world()
    t_start = wtime()
    rank, size = comm.Get_rank(), comm.Get_size()
    xp = array_module(cfg["device"])
    dtype = np.dtype(cfg["dtype"])
    seed = cfg["seed"]

    data = load_data(cfg)
    micro_steps = cfg["exchange.accumulate"]  # a step draws micro_steps batches of data.batch_size
    try:
        sampler = DistributedSampler(
            len(data.y_train),
            cfg["data.batch_size"] * micro_steps,
            rank,
            size,
            seed=seed,
            kind=cfg["data.sampler"],
        )
    except DataError as err:
        if micro_steps == 1:
            raise
        raise DataError(
            f"{err} (with exchange.accumulate = {micro_steps}, a rank's batch per step is "
            f"{micro_steps} x data.batch_size {cfg['data.batch_size']})"
        ) from None
    dropout_rng = generator(seed, rank, "dropout")
    model = build(cfg, data, rank, dtype, xp, dropout_rng)
    steps_per_epoch = sampler.steps_per_epoch
    total_steps = cfg["train.steps"] or cfg["train.epochs"] * steps_per_epoch
    schedule = make_schedule(cfg, size, steps_per_epoch, total_steps)
    optimizer = make_optimizer(cfg, model, schedule(0))
    exchange = exchange_for(cfg, comm, model)
    exchange.broadcast_parameters(root=0)

    # -- the run file and the checkpoint to continue from (rank 0 decides, all learn) --------
    run_path = Path(out) if out is not None else None
    ckpt, runfile = open_run(comm, cfg, model, run_path, resume, t_start)
    counters = {"train_s": 0.0, "compute_s": 0.0, "elapsed_s": 0.0, "bytes_sent": 0}
    step = 0
    if ckpt is not None:
        restore(ckpt, rank, model, optimizer, sampler, dropout_rng)
        step = ckpt.step
        counters.update({k: ckpt.meta["counters"][k] for k in counters})
        exchange.bytes_sent = int(counters["bytes_sent"])
    log = RunLog(comm, runfile, cfg["log.flush_every"])

    loss_fn = SoftmaxCrossEntropy()
    eval_every = cfg["train.eval_every"]
    bar = Progress(choose_mode(progress), total_steps, cfg["train.log_every"], active=rank == 0)
    profiler = LayerProfiler() if cfg["profile.layers"] else None
    stop = current_stop_request()
    every = cfg["checkpoint.every"]

    history: list[dict[str, float]] = []
    acc, test_loss = float("nan"), float("nan")
    global_batch = size * micro_steps * cfg["data.batch_size"]
    agree = np.zeros(6)  # [loss, correct, stop] in, the sums over the ranks out
    stopped_by = ""
    note = notes()  # what this rank is doing, for the stall watchdog's reports
    t_segment = wtime()
    t_end: float | None = None  # when the previous step ended: the time since is "other"

    def save(step: int) -> Path | None:
        """Flush the log, then write a checkpoint of the state after ``step`` (collective).

        The other ranks wait while rank 0 writes (a wait the stall watchdog must not
        take for a hang), and all learn whether it worked: a failed write (a full disk)
        ends every rank with the same error.
        """
        if run_path is None:
            return None
        note["phase"] = "checkpoint"
        log.flush()
        meta = {"counters": {**counters, "elapsed_s": counters["elapsed_s"] + wtime() - t_segment},
                "exchange": {k: v for k, v in cfg.values.items() if k.startswith("exchange.")}}  # fmt: skip
        if getattr(exchange, "auto", None) is not None:  # the algorithm table auto chose from
            meta["exchange"]["auto_table_used"] = exchange.auto.to_dict()
        ckpt = capture(
            comm, model, optimizer, sampler, dropout_rng, cfg, step, meta, checkpoint_attrs(run_path)
        )
        outcome: tuple[str, str] = ("ok", "")
        if ckpt is not None:  # rank 0
            try:
                path = save_checkpoint(ckpt, checkpoint_path(run_path, step))
                prune_checkpoints(run_path, cfg["checkpoint.keep"])
                outcome = ("ok", str(path))
            except FileError as err:
                outcome = ("error", str(err))
        if size > 1:  # a write may take long; one that takes ten stall limits is reported
            with long_wait("rank 0 writes a checkpoint", limit_s=10 * cfg["debug.stall_s"] or None):
                outcome = comm.bcast(outcome, root=0)
        if outcome[0] == "error":
            raise FileError(outcome[1])
        return Path(outcome[1])

    try:
        while step < total_steps and not stopped_by:
            epoch = sampler.epoch
            for i_batch, indices in sampler:  # the sampler keeps its position (for resume)
                t0 = wtime()
                other = t0 - t_end if t_end is not None else 0.0
                note["step"], note["phase"] = step + 1, "forward/backward"
                optimizer.lr = schedule(step)
                local_loss, correct = 0.0, 0
                for m, part in enumerate(np.split(indices, micro_steps)):
                    x, y = gather_batch(data.x_train, data.y_train, part, xp)
                    x = x.astype(dtype, copy=False)
                    last = m == micro_steps - 1  # the exchange observes only the last backward
                    with observers(profiler, exchange if last else None):  # buckets start in backward
                        micro_loss, micro_correct = _forward_backward(model, loss_fn, x, y)
                    if not last:
                        exchange.accumulate()
                    local_loss += micro_loss / micro_steps
                    correct += micro_correct
                comm_before = exchange.comm_time
                note["phase"] = "gradient exchange"
                t_exchange = wtime()
                exchange.exchange()  # with buckets in flight since backward: only the rest
                exposed = wtime() - t_exchange
                optimizer.step()
                dt = wtime() - t0
                step_comm = exchange.comm_time - comm_before
                counters["compute_s"] += dt - step_comm
                counters["train_s"] += dt
                step += 1
                t_end = wtime()
                # one small Allreduce, outside the step time: global metrics, and agreement on a stop
                note["phase"] = "metrics and stop vote"
                loss, train_acc, stop_votes = _agree(
                    comm, agree, local_loss, correct, len(indices), stop.requested
                )
                if not math.isfinite(loss):
                    log.close("failed", end_time=now())
                    raise HpcdlError(
                        f"loss is {loss} at step {step}: stopped; the last good checkpoint is kept "
                        "(lower optimizer.lr or check the data)"
                    )
                row = {"step": step, "epoch": epoch, "loss": loss, "train_accuracy": train_acc,
                       "lr": optimizer.lr, "step_time": dt, "samples_per_s": global_batch / dt,
                       "bytes_sent": exchange.bytes_sent,
                       "time": counters["elapsed_s"] + wtime() - t_segment}  # fmt: skip
                end_of_epoch = i_batch == steps_per_epoch - 1
                if (
                    (eval_every and step % eval_every == 0)
                    or (not eval_every and end_of_epoch)
                    or (step == total_steps)
                ):
                    note["phase"] = "evaluation"
                    acc, test_loss = evaluate(model, data, comm, xp, dtype)
                    row.update(test_accuracy=acc, test_loss=test_loss)
                    bar.write(
                        f"step {step} epoch {epoch}: test accuracy {100 * acc:.2f}%  loss {test_loss:.4f}"
                    )
                history.append(row)
                note["phase"] = "run file"
                log.record(row, dt - step_comm, step_comm, exposed, other)
                bar.update(step, loss=loss, samples_per_s=global_batch * step / counters["train_s"])
                if stop_votes:
                    stopped_by = stop.name or "a signal to another rank"
                    break
                if step == cfg["train.stop_at"] and step < total_steps:
                    stopped_by = f"train.stop_at = {step}"
                    break
                if every and step % every == 0 and step < total_steps:
                    save(step)
                if step >= total_steps:
                    break
    except BaseException as exc:
        log.abandon("interrupted" if isinstance(exc, KeyboardInterrupt) else "failed")
        raise
    finally:
        bar.close()
    if not stopped_by and (not history or "test_accuracy" not in history[-1]):
        note["phase"] = "evaluation"
        acc, test_loss = evaluate(model, data, comm, xp, dtype)
    ckpt_path = save(step) if run_path is not None else None
    counters["elapsed_s"] += wtime() - t_segment
    samples_per_s = global_batch * step / counters["train_s"] if counters["train_s"] > 0 else 0.0
    if runfile is not None and profiler is not None:
        runfile.write_profile(profiler.table())
    log.close(
        "stopped" if stopped_by else "finished",
        end_time=now(),
        wall_s=counters["elapsed_s"],
        final_test_accuracy=acc,
        samples_per_s=samples_per_s,
        peak_rss_mb=peak_rss_mb(),  # the process's: all virtual ranks of a simulation together
    )
    return RunResult(
        config=cfg,
        ranks=size,
        steps=step,
        epochs=round(step / steps_per_epoch, 3),
        test_accuracy=acc,
        test_loss=test_loss,
        wall_s=wtime() - t_start,
        train_s=counters["train_s"],
        samples_per_s=samples_per_s,
        compute_s=counters["compute_s"],
        comm_s=exchange.comm_time,
        model=model,
        optimizer=optimizer,
        history=history,
        profile=profiler.table() if profiler is not None else None,
        run_file=run_path,
        checkpoint=ckpt_path,
        stopped_by=stopped_by,
    )


def _agree(
    comm: Communicator, buf: np.ndarray, loss: float, correct: int, count: int, stop: bool
) -> tuple[float, float, int]:
    """Mean loss and batch accuracy over the ranks, and how many ranks want to stop.

    One ``Allreduce`` of three numbers: the stop votes travel with the metrics, so
    agreeing on a stop costs nothing extra (a SUM > 0 is the MAX of the flags > 0).
    """
    size = comm.Get_size()
    buf[:3] = (loss, correct, float(stop))
    if size == 1:
        buf[3:6] = buf[:3]
    else:
        comm.Allreduce(buf[:3], buf[3:6], op=ops.SUM)
    return float(buf[3]) / size, float(buf[4]) / (count * size), int(buf[5])


def _forward_backward(model: Sequential, loss_fn: SoftmaxCrossEntropy, x: Any, y: Any) -> tuple[float, int]:
    """Forward, loss, backward; returns the local loss and the number of correct predictions."""
    logits = model.forward(x)
    loss = loss_fn.forward(logits, y)
    correct = int(to_numpy(logits.argmax(axis=1) == y).sum())
    model.backward(loss_fn.backward())
    return float(loss), correct


def default_out(cfg: Config, comm: Communicator) -> Path:
    """``runs/<name>-<UTC time>.h5``, the same on every rank (rank 0's clock)."""
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{cfg['name']}-{comm.bcast(stamp, root=0)}.h5"


def run_file_of(checkpoint: str) -> Path:
    """The run file a checkpoint belongs to: ``RUN.ckpt-00000100.h5`` -> ``RUN.h5``."""
    path = Path(checkpoint)
    stem, sep, _ = path.name.rpartition(".ckpt-")
    if not sep:
        raise ConfigError(
            f"--resume {checkpoint}: not a checkpoint name (RUN.ckpt-NNNNNNNN.h5); give --out too"
        )
    return path.with_name(f"{stem}.h5")


def continue_command(argv: list[str], out: Path, comm: Communicator) -> str:
    """The command that continues this run, as the user can paste it.

    ``HPCDL_CONTINUE`` when a job script set it (the script knows how it was submitted);
    inside the simulator, its own command line; under MPI, ``mpiexec -n N``; this
    command's arguments, with ``--out OUT --resume auto`` in place of its own.
    """
    script = os.environ.get("HPCDL_CONTINUE", "").strip()
    if script:
        return script
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--out", "--resume"):
            skip = True
        elif not arg.startswith(("--out=", "--resume=")):
            kept.append(shlex.quote(arg))
    args = [*kept, "--out", shlex.quote(str(out)), "--resume auto"]
    launcher = getattr(comm, "launcher", None)
    if launcher is not None:  # a simulated world: its own command line, up to -m hpcdl.train
        start = launcher() or f"{python_command()} -m hpcdl.simulate -n {comm.Get_size()} -m hpcdl.train"
        return " ".join([start, *args])
    python = python_command()
    mpi = [f"mpiexec -n {comm.Get_size()}"] if comm.Get_size() > 1 else []
    return " ".join([*mpi, python, "-m hpcdl.train", *args])


def main(argv: list[str] | None = None) -> int:
    """Run the command with ``argv`` (without the program name); returns the exit status."""
    parser = build_parser()
    args = parse_args(parser, list(argv or []))
    cfg = load_config(args.config, args.sets)
    with watch(cfg["debug.stall_s"]) as comm:  # every wait from here on is watched
        launch.started(comm)  # unconnected ranks refused; the job script may now forward a stop
        if args.out is not None:
            out = Path(args.out)
        elif args.resume is None:
            out = default_out(cfg, comm)
        elif args.resume == "auto":
            raise ConfigError("--resume auto needs --out RUN.h5: the run whose checkpoints to continue")
        else:
            out = run_file_of(args.resume)
        result = run(cfg, comm, progress=args.progress, out=out, resume=args.resume)
        if comm.Get_rank() == 0:
            if result.stopped_by:
                print(
                    f"{cfg['name']}: stopped by {result.stopped_by} after step {result.steps}, "
                    f"checkpoint {result.checkpoint}; continue with: "
                    f"{continue_command(list(argv or []), out, comm)}",
                    flush=True,
                )
            print(result.summary(), flush=True)
    return 0


if __name__ == "__main__":
    from hpcdl.driver.cli import entry

    entry(main, "hpcdl.train", stop_signals=True)
