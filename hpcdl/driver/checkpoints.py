"""Capturing a training run's state into a checkpoint at a meeting point, and putting it back.

Rank 0 writes and reads the files (the other ranks may not see rank 0's disk). Every rank
contributes what it holds (:meth:`hpcdl.parallel.Strategy.state`): a piece several ranks
hold alike (the model of sync data parallel, a server's shard, a pipeline stage) comes from
its first holder only; each rank's own arrays and small values come from every rank. On
resume each rank receives only its part — its own values (scattered from rank 0) and the
pieces it holds (broadcast among their holders) — never the whole file.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hpcdl.comm import Communicator, recv_object, scatter_objects, send_object, subcomm
from hpcdl.components import all_declared, declared
from hpcdl.config import DRIVER_FIT_KEYS, Config, legacy_values, stored_values
from hpcdl.errors import ConfigError, HpcdlError
from hpcdl.parallel import Placement, RankState, Strategy
from hpcdl.store.checkpoint import Checkpoint, CheckpointError, list_checkpoints, load_checkpoint

__all__ = ["DRIVER", "capture", "distribute", "check_fits", "check_run_config", "find_resume", "fit_keys"]


def fit_keys(config: Config) -> tuple[str, ...]:
    """The config keys a checkpoint or run file must agree on: they fix the trajectory of the run —
    the driver's (:data:`~hpcdl.config.DRIVER_FIT_KEYS`), and those the run's components declare
    (:func:`hpcdl.components.declared`: the exchange's ``exchange.accumulate``, a strategy's own)."""
    return (*DRIVER_FIT_KEYS, *declared(config["parallel.strategy"]).fit_keys)


def __getattr__(name: str) -> Any:
    if name == "FIT_KEYS":  # moved: each component declares its own
        import warnings  # noqa: PLC0415

        warnings.warn("FIT_KEYS is fit_keys(config) now: components declare their own", DeprecationWarning,
                      stacklevel=2)  # fmt: skip
        return (*DRIVER_FIT_KEYS, *all_declared().fit_keys)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: the key of the driver's counters in each rank's meta (the strategy's part holds the rest)
DRIVER = "driver"

#: tag of the point-to-point messages that move pieces between rank 0 and their holders
_PIECE_TAG = 31_001


def capture(
    comm: Communicator,
    strategy: Strategy,
    placement: Placement,
    config: Config,
    *,
    step: int,
    epoch: int,
    counters: dict[str, float],
    attrs: dict[str, Any],
) -> Checkpoint | None:
    """The run's state after ``step`` (collective, at a meeting); a :class:`Checkpoint` on rank 0.

    Args:
        comm: the world.
        strategy: this rank's strategy.
        placement: who holds what.
        config: the run's config.
        step: steps done.
        epoch: the epoch of the next batch.
        counters: this rank's driver counters (kept with its own part: timings differ per rank).
        attrs: provenance attributes for the file.

    Returns:
        The checkpoint on rank 0, None elsewhere.
    """
    rank = comm.Get_rank()
    holds = placement.ranks[rank].holds
    part = strategy.state(pieces=bool(holds) and placement.holders(holds)[0] == rank)
    own = comm.gather((part.arrays, {**part.meta, DRIVER: counters}), root=0)
    pieces = dict(part.pieces) if rank == 0 else {}
    for piece in placement.pieces():
        first = placement.holders(piece)[0]
        if first == 0:
            continue
        if rank == first:
            send_object(comm, part.pieces[piece], 0, _PIECE_TAG)
        elif rank == 0:
            pieces[piece] = recv_object(comm, first, _PIECE_TAG)
    if rank != 0:
        return None
    assert own is not None
    return Checkpoint(
        step=step,
        epoch=epoch,
        config=config.toml(),
        placement=placement.to_json(),
        pieces=pieces,
        ranks=list(own),
        meta={"fit": _fit(config)},
        attrs=attrs,
    )


def distribute(comm: Communicator, ckpt: Checkpoint | None, placement: Placement) -> RankState:
    """This rank's part of ``ckpt`` (which rank 0 read; collective): its own values and its pieces.

    Each piece goes from rank 0 to its first holder, which broadcasts it to the other
    holders (on a communicator of the holders when they are not every rank).
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    arrays, meta = scatter_objects(comm, ckpt.ranks if ckpt is not None else None)
    pieces: dict[str, Any] = {}
    for piece in placement.pieces():
        holders = placement.holders(piece)
        value = ckpt.pieces[piece] if ckpt is not None else None
        if holders[0] != 0:
            if rank == 0:
                send_object(comm, value, holders[0], _PIECE_TAG)
            elif rank == holders[0]:
                value = recv_object(comm, 0, _PIECE_TAG)
        if len(holders) == size:
            value = comm.bcast(value, root=holders[0])
        elif len(holders) > 1 and rank in holders:
            group = subcomm(comm, holders)
            value = group.bcast(value, root=0)
            group.Free()
        if rank in holders:
            pieces[piece] = value
    return RankState(pieces=pieces, arrays=arrays, meta=meta)


def _fit(config: Config) -> dict[str, Any]:
    return {k: config[k] for k in fit_keys(config)}


def _saved_fit(fit: dict[str, Any], config: Config) -> dict[str, Any]:
    """A checkpoint's fit keys under their names now (an older file's ``parallel.mode`` is ``ps.mode``)."""
    renamed = all_declared(config["parallel.strategy"]).renamed
    return {renamed.get(k, k): v for k, v in fit.items()}


def check_fits(
    ckpt: Checkpoint, config: Config, placement: Placement, strategy: Strategy | None = None
) -> None:
    """Refuse a checkpoint of another rank count, trajectory (:func:`fit_keys`), placement, or
    pieces the strategy cannot take (:meth:`~hpcdl.parallel.Strategy.check_state`: another model).

    Raises:
        CheckpointError: naming the first thing that differs, and both values.
    """
    where = ckpt.path or "the checkpoint"
    if ckpt.world != placement.world:
        raise CheckpointError(
            f"{where} was written by {ckpt.world} ranks; this run has {placement.world}: continue it on "
            f"{ckpt.world} ranks, or start a new run with another --out"
        )
    fit = _saved_fit(ckpt.meta["fit"], config)
    for key, value in _fit(config).items():
        legacy = config.schema[key].legacy if key in config.schema else None
        saved = fit.get(key, value if legacy is None else legacy)  # a key newer than the file: its legacy
        if saved != value:
            raise CheckpointError(f"{where} was written with {key} = {saved!r}; this run has {value!r}")
    theirs = Placement.from_json(ckpt.placement)
    if not theirs.same_as(placement):
        raise CheckpointError(
            f"{where} was written under another placement ({theirs.summary()}); this run's is "
            f"{placement.summary()}: continue it as it was placed, or start a new run with another --out"
        )
    if strategy is not None:
        try:
            strategy.check_state(ckpt.pieces)
        except HpcdlError as err:
            raise CheckpointError(f"{where}: {err}") from None


def find_resume(
    resume: str, run_file: Path, config: Config, placement: Placement, strategy: Strategy | None = None
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
        check_fits(ckpt, config, placement, strategy)
        return ckpt
    refused: list[CheckpointError] = []
    for path in list_checkpoints(run_file):
        try:
            ckpt = load_checkpoint(path)
            check_fits(ckpt, config, placement, strategy)
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
    :func:`fit_keys` (they fix the trajectory), and its rank count with ``ranks``: a run
    may have no checkpoint yet, so this is checked on the run file itself.

    Args:
        attrs: the run file's root attributes (:func:`hpcdl.store.runfile.read_attrs`).
        config: this run's config.
        ranks: this run's rank count.

    Returns:
        The other keys whose values differ, ``{key: (in the run, now)}``: settings a
        resume may change (more steps, another learning rate), recorded in the run file.

    Raises:
        CheckpointError: the rank count or a key of :func:`fit_keys` differs (named, with
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
        saved = {**legacy_values(saved), **saved}  # keys newer than the file: the values it ran with
    except ConfigError as err:
        raise CheckpointError(f"{path} has a damaged config attribute ({err}): start a new run") from None
    changed = {}
    fit = fit_keys(config)
    for key, value in config.values.items():
        if key not in saved or saved[key] == value:
            continue
        if key in fit:
            raise CheckpointError(
                f"{path} was written with {key} = {saved[key]!r}; this run has {value!r}: continue it "
                "with its own settings, or start a new run with another --out (nothing was changed)"
            )
        changed[key] = (saved[key], value)
    return changed
