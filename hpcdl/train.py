"""``python -m hpcdl.train``: train a model, in one process or data-parallel under mpiexec."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hpcdl import comm as ops  # ops.SUM resolved at use: importing this module starts no MPI
from hpcdl.backend import array_module, to_numpy
from hpcdl.cli import ArgumentParser, parse_args
from hpcdl.comm import Communicator, world, wtime
from hpcdl.config import Config, load_config
from hpcdl.data import Dataset, DistributedSampler, gather_batch, load_dataset
from hpcdl.errors import ConfigError, HpcdlError
from hpcdl.models import build_model
from hpcdl.nn import LayerProfiler, Sequential, SoftmaxCrossEntropy, observe
from hpcdl.optim import SGD, Adam, AdamW, Optimizer, Schedule, scaled_lr
from hpcdl.parallel import make_exchange
from hpcdl.progress import Progress, choose_mode
from hpcdl.rng import generator

__all__ = ["main", "run", "RunResult", "build_parser"]

EVAL_BATCH = 512


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

    def summary(self) -> str:
        """The one summary line printed at the end of a run."""
        return (
            f"{self.config['name']}: test accuracy {100 * self.test_accuracy:.2f}% | "
            f"{self.steps} steps ({self.epochs:g} epochs) on {self.ranks} rank{'s' * (self.ranks > 1)} | "
            f"wall {self.wall_s:.1f} s | {self.samples_per_s:.0f} samples/s"
        )


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="python -m hpcdl.train",
        description="Train a model; under `mpiexec -n N` it trains data-parallel on N ranks.",
    )
    parser.add_argument("--config", required=True, help="a preset name (e.g. digits-mlp) or a TOML file")
    parser.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key; the value is read as TOML (repeatable)",
    )
    parser.add_argument(
        "--progress",
        choices=("auto", "bar", "lines", "none"),
        default="auto",
        help="auto: a bar when interactive, plain lines in batch jobs",
    )
    return parser


def make_optimizer(cfg: Config, model: Sequential, lr: float) -> Optimizer:
    """The optimizer named in the config, over the model's parameters."""
    params = model.parameters()
    name, wd = cfg["optimizer.name"], cfg["optimizer.weight_decay"]
    if name == "sgd":
        if cfg["optimizer.nesterov"] and cfg["optimizer.momentum"] <= 0:
            raise ConfigError("optimizer.nesterov = true needs optimizer.momentum > 0 (got 0)")
        return SGD(
            params,
            lr,
            momentum=cfg["optimizer.momentum"],
            nesterov=cfg["optimizer.nesterov"],
            weight_decay=wd,
        )
    betas = (cfg["optimizer.beta1"], cfg["optimizer.beta2"])
    if name == "adam":
        return Adam(params, lr, betas=betas, eps=cfg["optimizer.eps"], weight_decay=wd)
    return AdamW(params, lr, betas=betas, eps=cfg["optimizer.eps"], weight_decay=wd)


def make_schedule(cfg: Config, ranks: int, steps_per_epoch: int, total_steps: int) -> Schedule:
    """The learning-rate schedule, with the rank-count scaling rule applied."""
    base = cfg["optimizer.lr"]
    peak = scaled_lr(base, ranks, cfg["schedule.scale"])
    return Schedule(
        peak_lr=peak,
        total_steps=total_steps,
        name=cfg["schedule.name"],
        warmup_steps=round(cfg["schedule.warmup_epochs"] * steps_per_epoch),
        start_lr=base if peak != base else None,
        step_size=max(1, round(cfg["schedule.step_epochs"] * steps_per_epoch)),
        gamma=cfg["schedule.gamma"],
        min_lr=cfg["schedule.min_lr"],
    )


def load_data(cfg: Config) -> Dataset:
    """The data set named in the config (a read-only copy shared within the process)."""
    return load_dataset(
        cfg["data.name"],
        cfg["data.path"] or None,
        seed=cfg["seed"],
        shape=tuple(cfg["data.shape"]),
        num_classes=cfg["data.num_classes"],
        train_size=cfg["data.train_size"],
        test_size=cfg["data.test_size"],
    )


def build(cfg: Config, data: Dataset, rank: int, dtype: Any, xp: Any) -> Sequential:
    """The config's model for ``data``: initialised from (seed, "init"), dropout from (seed, rank).

    Raises:
        ConfigError: the model cannot take the data set's samples.
    """
    seed = cfg["seed"]
    try:
        return build_model(
            cfg["model.name"],
            data.input_shape,
            data.num_classes,
            rng=generator(seed, "init"),
            dropout_rng=generator(seed, rank, "dropout"),
            dtype=dtype,
            xp=xp,
            depth=cfg["model.depth"],
            width=cfg["model.width"],
            width_mult=cfg["model.width_mult"],
            channels=cfg["model.channels"],
            dropout=cfg["model.dropout"],
        )
    except ValueError as err:
        raise ConfigError(
            f"model.name = {cfg['model.name']!r} does not fit data {data.name!r}: {err}"
        ) from None


def evaluate(
    model: Sequential, data: Dataset, comm: Communicator, xp: Any, dtype: Any
) -> tuple[float, float]:
    """Test accuracy and mean loss over the whole test set, sharded over the ranks.

    Rank r evaluates test images r, r+N, … with its own model. The parameters
    are the same on every rank, but BatchNorm's running statistics are local
    (DESIGN.md), so for a model with BatchNorm at N > 1 the figure pools N
    slightly different models, as DDP-style sharded evaluation does. The
    counts are summed with one small allreduce.
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    idx = np.arange(rank, len(data.y_test), size)
    loss_fn = SoftmaxCrossEntropy()
    correct, loss_sum = 0, 0.0
    model.eval()
    for start in range(0, len(idx), EVAL_BATCH):
        part = idx[start : start + EVAL_BATCH]
        x = xp.asarray(data.x_test[part], dtype=dtype)
        y = xp.asarray(data.y_test[part])
        logits = model.forward(x)
        loss_sum += loss_fn.forward(logits, y) * len(part)
        correct += int(to_numpy(logits.argmax(axis=1) == y).sum())
    model.train()
    correct, loss_sum, count = comm.allreduce(np.array([correct, loss_sum, len(idx)]), op=ops.SUM)
    return float(correct / max(1, count)), float(loss_sum / max(1, count))


def run(cfg: Config, comm: Communicator | None = None, progress: str = "none") -> RunResult:
    """Train as ``cfg`` says on ``comm`` (default: :func:`hpcdl.comm.world`).

    Args:
        cfg: a validated config.
        comm: the communicator; one rank trains alone, N ranks data-parallel.
        progress: ``bar``, ``lines``, ``none`` (rank 0 only) or ``auto``.

    Returns:
        The result, identical on every rank except for local timings.

    Raises:
        HpcdlError: the data set does not fit the rank count and batch size, and the like.
    """
    comm = comm or world()
    t_start = wtime()
    rank, size = comm.Get_rank(), comm.Get_size()
    xp = array_module(cfg["device"])
    dtype = np.dtype(cfg["dtype"])
    seed = cfg["seed"]

    data = load_data(cfg)
    sampler = DistributedSampler(
        len(data.y_train), cfg["data.batch_size"], rank, size, seed=seed, kind=cfg["data.sampler"]
    )
    model = build(cfg, data, rank, dtype, xp)
    steps_per_epoch = sampler.steps_per_epoch
    total_steps = cfg["train.steps"] or cfg["train.epochs"] * steps_per_epoch
    schedule = make_schedule(cfg, size, steps_per_epoch, total_steps)
    optimizer = make_optimizer(cfg, model, schedule(0))
    exchange = make_exchange(cfg["exchange.name"], comm, model.parameters(), debug=cfg["exchange.debug"])
    exchange.broadcast_parameters(root=0)
    loss_fn = SoftmaxCrossEntropy()
    eval_every = cfg["train.eval_every"]
    mode = choose_mode(progress)
    bar = Progress(mode, total_steps, cfg["train.log_every"], active=rank == 0)
    profiler = LayerProfiler() if cfg["profile.layers"] else None

    history: list[dict[str, float]] = []
    step, compute_s, train_s = 0, 0.0, 0.0
    acc, test_loss = float("nan"), float("nan")
    global_batch = size * cfg["data.batch_size"]
    loss_buf = np.zeros(2)  # [sum of the ranks' losses] in, out: for the mean over ranks
    try:
        while step < total_steps:
            epoch = sampler.epoch
            for i_batch, indices in sampler:  # the sampler keeps its position (for resume)
                t0 = wtime()
                x, y = gather_batch(data.x_train, data.y_train, indices, xp)
                x = x.astype(dtype, copy=False)
                optimizer.lr = schedule(step)
                if profiler is not None:
                    with observe(profiler):
                        local_loss = _forward_backward(model, loss_fn, x, y)
                else:
                    local_loss = _forward_backward(model, loss_fn, x, y)
                comm_before = exchange.comm_time
                exchange.exchange()
                optimizer.step()
                dt = wtime() - t0
                compute_s += dt - (exchange.comm_time - comm_before)
                train_s += dt
                step += 1
                loss = _mean_over_ranks(comm, local_loss, loss_buf)  # a metric: outside the step time
                if not math.isfinite(loss):
                    raise HpcdlError(f"loss is {loss} at step {step}: lower optimizer.lr or check the data")
                row = {"step": step, "epoch": epoch, "loss": loss, "lr": optimizer.lr, "step_s": dt}
                end_of_epoch = i_batch == steps_per_epoch - 1
                if (
                    (eval_every and step % eval_every == 0)
                    or (not eval_every and end_of_epoch)
                    or (step == total_steps)
                ):
                    acc, test_loss = evaluate(model, data, comm, xp, dtype)
                    row.update(test_accuracy=acc, test_loss=test_loss)
                    bar.write(
                        f"step {step} epoch {epoch}: test accuracy {100 * acc:.2f}%  loss {test_loss:.4f}"
                    )
                history.append(row)
                bar.update(step, loss=loss, samples_per_s=global_batch * step / train_s)
                if step >= total_steps:
                    break
    finally:
        bar.close()
    if not history or "test_accuracy" not in history[-1]:
        acc, test_loss = evaluate(model, data, comm, xp, dtype)
    return RunResult(
        config=cfg,
        ranks=size,
        steps=step,
        epochs=round(step / steps_per_epoch, 3),
        test_accuracy=acc,
        test_loss=test_loss,
        wall_s=wtime() - t_start,
        train_s=train_s,
        samples_per_s=global_batch * step / train_s if train_s > 0 else 0.0,
        compute_s=compute_s,
        comm_s=exchange.comm_time,
        model=model,
        optimizer=optimizer,
        history=history,
        profile=profiler.table() if profiler is not None else None,
    )


def _mean_over_ranks(comm: Communicator, value: float, buf: np.ndarray) -> float:
    """The mean of ``value`` over the ranks (one tiny ``Allreduce``; ``buf`` holds 2 floats)."""
    size = comm.Get_size()
    if size == 1:
        return value
    buf[0] = value
    comm.Allreduce(buf[:1], buf[1:], op=ops.SUM)
    return float(buf[1]) / size


def _forward_backward(model: Sequential, loss_fn: SoftmaxCrossEntropy, x: Any, y: Any) -> float:
    logits = model.forward(x)
    loss = loss_fn.forward(logits, y)
    model.backward(loss_fn.backward())
    return float(loss)


def main(argv: list[str] | None = None) -> int:
    """Run the command with ``argv`` (without the program name); returns the exit status."""
    parser = build_parser()
    args = parse_args(parser, list(argv or []))
    cfg = load_config(args.config, args.sets)
    result = run(cfg, world(), progress=args.progress)
    if world().Get_rank() == 0:
        print(result.summary(), flush=True)
    return 0


if __name__ == "__main__":
    from hpcdl.cli import entry

    entry(main, "hpcdl.train")
