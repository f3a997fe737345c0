"""``python -m hpcdl.train``: train a model with a parallel strategy, in one process or under mpiexec.

The command reads its arguments and hands the run to the driver (:func:`hpcdl.driver.train`);
``--plan`` prints the strategy's placement instead, for any rank count.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys
from pathlib import Path
from typing import Any

import numpy as np

from hpcdl.backend import array_module
from hpcdl.comm import Communicator, watch, world
from hpcdl.comm.machine import fit_blas_threads
from hpcdl.config import Config, add_set_argument, load_config
from hpcdl.driver import launch
from hpcdl.driver.cli import ArgumentParser, parse_args, positive_int, python_command
from hpcdl.driver.context import arithmetic
from hpcdl.driver.factory import build, load_data
from hpcdl.driver.memory import estimate, plan_lines, read_limits
from hpcdl.driver.run import RunResult, plan
from hpcdl.driver.run import train as run
from hpcdl.driver.runlog import refuse_directory
from hpcdl.driver.settle import PlanInputs, settle
from hpcdl.errors import ConfigError
from hpcdl.optim import scaled_lr
from hpcdl.parallel import strategy_class
from hpcdl.parallel.fault import fault_model
from hpcdl.parallel.strategy import ignored_keys
from hpcdl.rng import generator
from hpcdl.store.checkpoint import checkpoint_run_file

__all__ = ["main", "run", "RunResult", "build_parser", "continue_command", "print_plan"]


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m hpcdl.train``."""
    parser = ArgumentParser(
        prog="python -m hpcdl.train",
        description="Train a model: in one process, or spread over N ranks under mpiexec -n N "
        "as parallel.strategy says (sync: data parallel).",
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
        "--take-over",
        action="store_true",
        help="with --resume: continue a run whose file says another job still writes it (its pid "
        "alive on this host, or a fresh heartbeat from another), when you know that job is dead",
    )
    parser.add_argument(
        "--progress",
        choices=("auto", "bar", "lines", "none"),
        default="auto",
        help="auto: a bar when interactive, plain lines in batch jobs",
    )
    parser.add_argument(
        "--plan",
        action="store_true",
        help="print the strategy's placement (each rank's role, what it holds, the batch arithmetic) "
        "and exit without training",
    )
    parser.add_argument(
        "-n",
        dest="ranks",
        type=positive_int,
        default=None,
        metavar="RANKS",
        help="with --plan: the rank count to plan for, without starting ranks (default: this world's)",
    )
    return parser


def default_out(cfg: Config, comm: Communicator) -> Path:
    """``runs/<name>-<UTC time>.h5``, the same on every rank (rank 0's clock)."""
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{cfg['name']}-{comm.bcast(stamp, root=0)}.h5"


def run_file_of(checkpoint: str) -> Path:
    """The run file a checkpoint belongs to: ``RUN.ckpt-00000100.h5`` -> ``RUN.h5``."""
    run_file = checkpoint_run_file(checkpoint)
    if run_file is None:
        raise ConfigError(
            f"--resume {checkpoint}: not a checkpoint name (RUN.ckpt-NNNNNNNN.h5); give --out too"
        )
    return run_file


def continue_command(argv: list[str], out: Path, comm: Communicator) -> str:
    """The command that continues this run, as the user can paste it.

    ``HPCDL_CONTINUE`` when a job script set it (the script knows how it was submitted);
    inside the simulator, its own command line; under MPI, ``mpiexec -n N``; this
    command's arguments, with ``--out OUT --resume auto`` in place of its own (and without
    ``--take-over``: the run it continues is this one, stopped).
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
        elif arg != "--take-over" and not arg.startswith(("--out=", "--resume=")):
            kept.append(shlex.quote(arg))
    args = [*kept, "--out", shlex.quote(str(out)), "--resume auto"]
    launcher = getattr(comm, "launcher", None)
    if launcher is not None:  # a simulated world: its own command line, up to -m hpcdl.train
        start = launcher() or f"{python_command()} -m hpcdl.simulate -n {comm.Get_size()} -m hpcdl.train"
        return " ".join([start, *args])
    python = python_command()
    mpi = [f"mpiexec -n {comm.Get_size()}"] if comm.Get_size() > 1 else []
    return " ".join([*mpi, python, "-m hpcdl.train", *args])


class _PlanModel:
    """``--plan``'s model builder, handed to a strategy's ``describe``: each call builds the
    config's model on the plan's stream. Its ``data`` is the loaded data set, for a strategy
    that plans from samples (a pipeline's time balance): the driver loads, the strategy reads."""

    def __init__(self, cfg: Config, data: Any) -> None:
        self.cfg, self.data = cfg, data

    def __call__(self) -> Any:
        cfg = self.cfg
        xp = array_module(cfg["device"])
        return build(cfg, self.data, 0, np.dtype(cfg["dtype"]), xp, generator(cfg["seed"], "plan"))


def print_plan(cfg: Config, world_size: int) -> None:
    """``--plan``: the strategy's placement for ``world_size`` ranks, the batch and step arithmetic,
    and each rank's memory (:func:`hpcdl.driver.memory.estimate`) against this host's limits.

    Nothing is trained and no rank is started; the data set is loaded to count its samples.
    Everything is worked out before anything is printed, so that a plan that does not fit (a
    partition, a schedule) is one line of error, not a table followed by one.
    """
    data = load_data(cfg)
    cfg = settle(cfg, world_size, inputs=PlanInputs(cfg, data))  # the pipeline's planner
    placement = plan(cfg, world_size)
    samples = len(data.y_train)
    batches, steps_per_epoch, total = arithmetic(cfg, placement, samples)
    peak = scaled_lr(cfg["optimizer.lr"], batches, cfg["schedule.scale"])

    model = _PlanModel(cfg, data)
    lines = strategy_class(cfg["parallel.strategy"]).describe(cfg, placement, model)
    faults = fault_model(cfg, world_size, total)
    if faults is not None:
        lines = [*lines, *([""] if lines else []), *faults.summary()]
    memory = plan_lines(estimate(cfg, placement, data, model()), read_limits())
    print(placement.table())
    if lines:
        print("\n".join(["", *lines]))
    print(
        f"\nlearning rate {peak:g} (optimizer.lr {cfg['optimizer.lr']:g}, schedule.scale = "
        f"{cfg['schedule.scale']!r} for {batches} batch{'es' * (batches > 1)} per update); "
        f"{steps_per_epoch} step{'s' * (steps_per_epoch > 1)} per epoch of {samples} training samples; "
        f"{total} steps in all"
    )
    for line in [*cfg.notes, *ignored_keys(cfg)]:
        print(f"! {line}")
    if placement.global_batch > samples and cfg["data.sampler"] == "shuffle":
        print(
            f"! the global batch of {placement.global_batch} exceeds the {samples} training samples: "
            'lower data.batch_size or set data.sampler = "random"'
        )
    if memory:
        print("\n".join(["", *memory]))


def main(argv: list[str] | None = None) -> int:
    """Run the command with ``argv`` (without the program name); returns the exit status."""
    parser = build_parser()
    args = parse_args(parser, list(argv or []))
    cfg = load_config(args.config, args.sets)
    if args.plan:
        print_plan(cfg, args.ranks if args.ranks is not None else world().Get_size())
        return 0
    if args.ranks is not None:
        raise ConfigError("-n RANKS goes with --plan; to train on N ranks, run under mpiexec -n N")
    if args.take_over and args.resume is None:
        raise ConfigError("--take-over goes with --resume: it continues a run whose writer looks alive")
    if args.out is not None:
        refuse_directory(args.out, cfg["name"])  # as typed: a trailing "/" is gone from a Path
    with watch(cfg["debug.stall_s"]) as comm:  # every wait from here on is watched
        launch.started(comm)  # unconnected ranks refused; the job script may now forward a stop
        fitted = fit_blas_threads(comm)  # N ranks on a node: a share of its cores each
        if comm.Get_rank() == 0:
            for line in [*cfg.notes, *ignored_keys(cfg)]:
                print(f"hpcdl.train: ! {line}", file=sys.stderr, flush=True)
            if fitted is not None:
                before, now = fitted
                print(f"hpcdl.train: BLAS threads per rank {before} -> {now}, a share of this node's cores "
                      "(set OPENBLAS_NUM_THREADS to choose)", file=sys.stderr, flush=True)  # fmt: skip
        if args.out is not None:
            out = Path(args.out)
        elif args.resume is None:
            out = default_out(cfg, comm)
        elif args.resume == "auto":
            raise ConfigError("--resume auto needs --out RUN.h5: the run whose checkpoints to continue")
        else:
            out = run_file_of(args.resume)
        result = run(cfg, comm, progress=args.progress, out=out, resume=args.resume, take_over=args.take_over)
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
