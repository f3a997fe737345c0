"""Capturing a training run's whole state into a checkpoint, and putting it back.

Rank 0 writes and reads the files (the other ranks may not see rank 0's disk); each
rank's own state (BatchNorm statistics, its dropout stream) travels by ``gather`` and
``bcast``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

from hpcdl.backend import to_numpy
from hpcdl.comm import Communicator
from hpcdl.config import Config, stored_values
from hpcdl.data import DistributedSampler
from hpcdl.errors import ConfigError
from hpcdl.nn import Sequential
from hpcdl.optim import Optimizer
from hpcdl.store.checkpoint import Checkpoint, CheckpointError, list_checkpoints, load_checkpoint

__all__ = ["capture", "restore", "check_fits", "check_run_config", "find_resume", "FIT_KEYS"]

#: config keys a checkpoint must agree on: they fix the trajectory of the run
FIT_KEYS = (
    "seed", "dtype", "model.name", "model.depth", "model.width", "model.width_mult", "model.channels",
    "data.name", "data.path", "data.batch_size", "data.sampler", "data.shape", "data.num_classes",
    "data.train_size", "data.test_size", "exchange.accumulate",
)  # fmt: skip


def capture(
    comm: Communicator,
    model: Sequential,
    optimizer: Optimizer,
    sampler: DistributedSampler,
    dropout_rng: np.random.Generator,
    config: Config,
    step: int,
    meta: dict[str, Any],
    attrs: dict[str, Any],
) -> Checkpoint | None:
    """The run's state after ``step`` (collective); a :class:`Checkpoint` on rank 0, else None."""
    local = (
        {name: to_numpy(b).copy() for name, b in model.named_buffers()},
        dropout_rng.bit_generator.state,
    )
    every = comm.gather(local, root=0)
    if comm.Get_rank() != 0:
        return None
    opt_state = optimizer.state_dict()
    arrays = {k: v for k, v in opt_state.items() if isinstance(v, np.ndarray)}
    scalars = {k: v for k, v in opt_state.items() if not isinstance(v, np.ndarray)}
    return Checkpoint(
        step=step,
        epoch=sampler.epoch,
        ranks=comm.Get_size(),
        config=config.toml(),
        params={name: to_numpy(p.data).copy() for name, p in model.named_parameters()},
        optimizer=arrays,
        buffers=[bufs for bufs, _ in every],
        meta={**meta, "sampler": sampler.state(), "optimizer": scalars, "fit": _fit(config)},
        rng=[{"dropout": state} for _, state in every],
        attrs=attrs,
    )


def restore(
    ckpt: Checkpoint,
    rank: int,
    model: Sequential,
    optimizer: Optimizer,
    sampler: DistributedSampler,
    dropout_rng: np.random.Generator,
) -> None:
    """Put ``ckpt``'s state into this rank's model, optimizer, sampler and streams."""
    model.load_state_dict({**ckpt.params, **ckpt.buffers[rank]})
    optimizer.load_state_dict({**ckpt.meta["optimizer"], **ckpt.optimizer})
    sampler.load_state(ckpt.meta["sampler"])
    dropout_rng.bit_generator.state = ckpt.rng[rank]["dropout"]


def _fit(config: Config) -> dict[str, Any]:
    return {k: config[k] for k in FIT_KEYS}


def check_fits(ckpt: Checkpoint, config: Config, model: Sequential, ranks: int) -> None:
    """Refuse a checkpoint of another model, rank count or data/batch/seed setting.

    Raises:
        CheckpointError: naming the first thing that differs.
    """
    where = ckpt.path or "the checkpoint"
    if ckpt.ranks != ranks:
        raise CheckpointError(f"{where} was written by {ckpt.ranks} ranks; this run has {ranks}")
    mine = {name: tuple(p.shape) for name, p in model.named_parameters()}
    theirs = {name: tuple(a.shape) for name, a in ckpt.params.items()}
    if mine != theirs:
        diff = sorted(set(mine.items()) ^ set(theirs.items()))[:3]
        raise CheckpointError(f"{where} holds another model (parameters differ: {diff} ...)")
    for key, value in _fit(config).items():
        saved = ckpt.meta["fit"].get(key)
        if saved != value:
            raise CheckpointError(f"{where} was written with {key} = {saved!r}; this run has {value!r}")


def find_resume(
    resume: str, run_file: Path, config: Config, model: Sequential, ranks: int
) -> Checkpoint | None:
    """The checkpoint ``--resume`` names (rank 0 only).

    ``auto`` takes the newest checkpoint of ``run_file`` that loads and fits, telling on
    stderr why newer ones were passed over; None if the run has no checkpoint. A path must
    load and fit.

    Raises:
        CheckpointError: an explicit checkpoint is damaged or does not fit; or, for
            ``auto``, the run has checkpoints and none of them loads and fits (the first
            reason is named: continuing would silently start the run over).
    """
    if resume != "auto":
        ckpt = load_checkpoint(resume)
        check_fits(ckpt, config, model, ranks)
        return ckpt
    refused: list[CheckpointError] = []
    for path in list_checkpoints(run_file):
        try:
            ckpt = load_checkpoint(path)
            check_fits(ckpt, config, model, ranks)
        except CheckpointError as err:
            refused.append(err)
            continue
        for err in refused:
            print(f"hpcdl.train: skipping a checkpoint: {err}", file=sys.stderr, flush=True)
        return ckpt
    if not refused:
        return None
    more = f" (and {len(refused) - 1} more checkpoint{'s' * (len(refused) > 2)} refused)" * (len(refused) > 1)
    raise CheckpointError(
        f"no checkpoint of {run_file} can continue this run: {refused[0]}{more}; nothing was changed: "
        "continue with the run's own settings, or start a new run with another --out"
    )


def check_run_config(attrs: dict[str, Any], config: Config, ranks: int) -> dict[str, tuple[Any, Any]]:
    """Check that an existing run file can be continued by this run; its other changed settings.

    The run file's ``config`` attribute must agree with ``config`` on every key of
    :data:`FIT_KEYS` (they fix the trajectory), and its rank count with ``ranks``: a run
    may have no checkpoint yet, so this is checked on the run file itself.

    Args:
        attrs: the run file's root attributes (:func:`hpcdl.store.runfile.read_attrs`).
        config: this run's config.
        ranks: this run's rank count.

    Returns:
        The other keys whose values differ, ``{key: (in the run, now)}``: settings a
        resume may change (more steps, another learning rate), recorded in the run file.

    Raises:
        CheckpointError: the rank count or a key of :data:`FIT_KEYS` differs (named, with
            both values).
    """
    path = attrs.get("path", "the run file")
    if int(attrs.get("ranks", ranks)) != ranks:
        raise CheckpointError(
            f"{path} was written by {int(attrs['ranks'])} ranks and this run has {ranks}: continue it on "
            f"{int(attrs['ranks'])} ranks, or start a new run with another --out"
        )
    try:
        saved = stored_values(str(attrs.get("config", "")))
    except ConfigError as err:
        raise CheckpointError(f"{path} has a damaged config attribute ({err}): start a new run") from None
    changed = {}
    for key, value in config.values.items():
        if key not in saved or saved[key] == value:
            continue
        if key in FIT_KEYS:
            raise CheckpointError(
                f"{path} was written with {key} = {saved[key]!r}; this run has {value!r}: continue it "
                "with its own settings, or start a new run with another --out (nothing was changed)"
            )
        changed[key] = (saved[key], value)
    return changed
