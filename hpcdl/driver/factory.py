"""Objects from a config: the data set, the model, the optimizer, the schedule; evaluation."""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Any

import numpy as np

from hpcdl import comm as ops  # ops.SUM resolved at use: importing this module starts no MPI
from hpcdl.comm import Communicator
from hpcdl.config import Config
from hpcdl.data import Dataset, load_dataset
from hpcdl.driver.convplan import apply_config
from hpcdl.errors import ConfigError
from hpcdl.models import build_model
from hpcdl.nn import Parameter, Sequential
from hpcdl.optim import KFAC, SGD, Adam, AdamW, Optimizer, Schedule, scaled_lr
from hpcdl.parallel.evaluation import EVAL_BATCH, Tally, test_batches
from hpcdl.rng import generator

__all__ = [
    "make_optimizer", "make_schedule", "load_data", "build", "evaluate", "evaluation_parts", "EVAL_BATCH",
]  # fmt: skip


def make_optimizer(
    cfg: Config, params: Sequence[Parameter], lr: float, model: Sequential | None = None
) -> Optimizer:
    """The optimizer named in the config, over ``params`` (a model's, a stage's, a shard's);
    K-FAC over ``model`` (it observes the model's layers).

    Raises:
        ConfigError: K-FAC without a model (a strategy that hands only parameters), or a
            K-FAC setting out of range.
    """
    params = list(params)
    name, wd = cfg["optimizer.name"], cfg["optimizer.weight_decay"]
    if name == "kfac":
        if model is None:
            raise ConfigError(
                f"optimizer.name = 'kfac' preconditions whole layers; parallel.strategy = "
                f"{cfg['parallel.strategy']!r} hands the optimizer parameters only: "
                "use parallel.strategy = 'sync'"
            )
        try:
            return KFAC(
                model, lr, momentum=cfg["optimizer.momentum"], weight_decay=wd, damping=cfg["kfac.damping"],
                factor_decay=cfg["kfac.factor_decay"], factor_every=cfg["kfac.factor_every"],
                inv_every=cfg["kfac.inv_every"], kl_clip=cfg["kfac.kl_clip"],
            )  # fmt: skip
        except ValueError as err:
            raise ConfigError(str(err)) from None
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


def make_schedule(cfg: Config, batches: int, steps_per_epoch: int, total_steps: int) -> Schedule:
    """The learning-rate schedule, with the scaling rule applied to the global batch.

    ``batches`` is how many ``data.batch_size`` batches one update averages: the
    placement's data-parallel width times its micro-steps (accumulating k micro-steps on
    one rank counts as k ranks; a parameter server's asynchronous push counts as 1). The
    rule (``schedule.scale``) scales the learning rate by that factor.

    Raises:
        ConfigError: a cosine schedule's ``schedule.min_lr`` is above its peak rate.
    """
    base = cfg["optimizer.lr"]
    peak = scaled_lr(base, batches, cfg["schedule.scale"])
    if cfg["schedule.name"] == "cosine" and cfg["schedule.min_lr"] > peak:
        raise ConfigError(
            f"schedule.min_lr = {cfg['schedule.min_lr']} is above the peak learning rate {peak:g} "
            f"(optimizer.lr = {base} scaled for {batches} batches per update), so the cosine schedule "
            f"would rise: set schedule.min_lr <= {peak:g}"
        )
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
    """The data set named in the config (a read-only copy shared within the process).

    Raises:
        DataError: the files are missing or malformed, or their labels do not fit
            ``data.num_classes``.
        ConfigError: synthetic data of this size does not fit in memory.
    """
    try:
        return load_dataset(
            cfg["data.name"],
            cfg["data.path"] or None,
            seed=cfg["seed"],
            shape=tuple(cfg["data.shape"]),
            num_classes=cfg["data.num_classes"],
            train_size=cfg["data.train_size"],
            test_size=cfg["data.test_size"],
        )
    except MemoryError as err:
        if cfg["data.name"] != "synthetic":
            raise
        raise ConfigError(
            f"synthetic data of data.train_size = {cfg['data.train_size']}, data.test_size = "
            f"{cfg['data.test_size']} samples of data.shape = {cfg['data.shape']} does not fit in "
            f"memory ({err}): make them smaller"
        ) from None


#: the config keys that size each model, named when it does not fit in memory
_SIZE_KEYS = {
    "mlp": ("model.depth", "model.width"),
    "mlp32": (),
    "cnn": ("model.channels", "model.width_mult"),
    "vgg16": ("model.width_mult",),
    "resnet18": ("model.width_mult",),
    "resnet50": ("model.width_mult",),
}


def build(
    cfg: Config, data: Dataset, rank: int, dtype: Any, xp: Any, dropout_rng: np.random.Generator | None = None
) -> Sequential:
    """The config's model for ``data``: initialised from (seed, "init"), dropout from (seed, rank).

    Raises:
        ConfigError: the model cannot take the data set's samples, or does not fit in
            memory (the message names the keys that size it and their values).
    """
    seed = cfg["seed"]
    name = cfg["model.name"]
    try:
        model = build_model(
            name,
            data.input_shape,
            data.num_classes,
            rng=generator(seed, "init"),
            dropout_rng=dropout_rng if dropout_rng is not None else generator(seed, rank, "dropout"),
            dtype=dtype,
            xp=xp,
            depth=cfg["model.depth"],
            width=cfg["model.width"],
            width_mult=cfg["model.width_mult"],
            channels=cfg["model.channels"],
            dropout=cfg["model.dropout"],
        )
    except MemoryError as err:
        sizes = "".join(f", {k} = {cfg[k]}" for k in _SIZE_KEYS.get(name, ()))
        raise ConfigError(
            f"model.name = {name!r}{sizes}, for {data.num_classes} classes of samples of shape "
            f"{data.input_shape}, does not fit in memory ({err}): make it smaller"
        ) from None
    except ValueError as err:
        raise ConfigError(f"model.name = {name!r} does not fit data {data.name!r}: {err}") from None
    apply_config(model, cfg)  # model.winograd: which 3x3 convolutions multiply by Winograd
    return model


def evaluate(
    model: Sequential, data: Dataset, comm: Communicator, xp: Any, dtype: Any
) -> tuple[float, float]:
    """Test accuracy and mean loss over the whole test set, sharded over the ranks.

    Rank r evaluates test images r, r+N, … with its own model. The parameters
    are the same on every rank, but BatchNorm's running statistics are local
    (docs/design.md, training semantics), so for a model with BatchNorm at N > 1 the figure pools N
    slightly different models, as DDP-style sharded evaluation does. The
    counts are summed with one small allreduce.
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    parts = evaluation_parts(model, data, xp, dtype, rank, size)
    while True:
        try:
            next(parts)
        except StopIteration as done:
            counts = done.value
            break
    correct, loss_sum, count = comm.allreduce(counts, op=ops.SUM)
    return float(correct / max(1, count)), float(loss_sum / max(1, count))


def evaluation_parts(
    model: Sequential,
    data: Dataset,
    xp: Any,
    dtype: Any,
    rank: int = 0,
    size: int = 1,
    batch: int = EVAL_BATCH,
) -> Generator[None, None, np.ndarray]:
    """Evaluate test images ``rank, rank + size, …`` one batch of ``batch`` per ``next()``.

    A rank that must keep answering messages while it evaluates (a parameter server)
    runs one part at a time between them: small parts keep it from holding the others
    back for long.

    Returns (as the generator's value): ``[correct, loss sum, images]`` of this rank's share.
    """
    tally = Tally()
    parts = list(test_batches(len(data.y_test), rank, size, batch))
    for i, part in enumerate(parts):
        x = xp.asarray(data.x_test[part], dtype=dtype)
        y = xp.asarray(data.y_test[part])
        model.eval()
        try:
            logits = model.forward(x)
        finally:
            model.train()
        tally.add(logits, y)
        if i + 1 < len(parts):
            yield
    return tally.counts()
