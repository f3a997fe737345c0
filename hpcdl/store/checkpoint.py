"""Checkpoints: HDF5 files beside the run file, written to a temporary name and renamed.

Layout (format version 2)::

    /                          attrs: format_version, step, epoch, ranks (the world size),
                                      created (ISO 8601), hpcdl_version, mpi_library,
                                      run_file (name of the run file), config (TOML text),
                                      placement (JSON: every rank's role, piece and
                                      data-parallel member), meta (JSON: the driver's
                                      counters and the keys the run's trajectory depends
                                      on), digest (SHA-256 of every array and rank's meta)
    /pieces/<piece>/<group>/<name>   state several ranks hold alike (sync: the model's
                                      ``params`` and ``optimizer``), stored once; the
                                      group's attribute ``meta`` (JSON) holds its scalars
    /ranks/<rank>/<name>       each rank's own arrays (BatchNorm statistics stay local)
    /rank_meta                 one JSON text per rank: its random streams, sampler
                               position, counters

Version 1 files (before pieces: ``/params``, ``/optimizer``, ``/buffers/<rank>``, the
``rng`` attribute) are read as the sync strategy's pieces. A file is complete once it has
its final name (``os.replace`` is atomic); the digest catches a file damaged later.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from hpcdl.errors import HpcdlError, file_error
from hpcdl.store.runfile import heartbeat_now

__all__ = [
    "CKPT_VERSION",
    "Checkpoint",
    "CheckpointError",
    "checkpoint_config",
    "checkpoint_path",
    "checkpoint_run_file",
    "list_checkpoints",
    "load_checkpoint",
    "orphaned_temporaries",
    "prune_checkpoints",
    "save_checkpoint",
]

CKPT_VERSION = 2
_NAME = re.compile(r"\.ckpt-(\d{8,})\.h5$")
#: a checkpoint's temporary file, while it is written (save_checkpoint): RUN.ckpt-N.h5.PID.tmp
_TEMPORARY = re.compile(r"\.ckpt-\d{8,}\.h5\.\d+\.tmp$")


class CheckpointError(HpcdlError):
    """A checkpoint is missing, damaged, or does not fit this run."""


@dataclass
class Checkpoint:
    """Everything a run needs to continue bit for bit from the end of step ``step``.

    Attributes:
        step: steps done.
        epoch: the epoch of the next batch.
        config: the run's config (TOML text).
        placement: the placement it was written under (JSON text,
            :meth:`hpcdl.parallel.Placement.to_json`).
        pieces: state several ranks hold alike, once: piece -> group -> name -> array,
            and piece -> ``"meta"`` -> JSON-compatible scalars.
        ranks: per rank, its own arrays and its meta (JSON-compatible).
        meta: the driver's part (counters, the keys the trajectory depends on).
        attrs: other root attributes (provenance).
        path: where it was read from.
    """

    step: int
    epoch: int
    config: str
    placement: str
    pieces: dict[str, dict[str, Any]]
    ranks: list[tuple[dict[str, np.ndarray], dict[str, Any]]]
    meta: dict[str, Any] = field(default_factory=dict)
    attrs: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None

    @property
    def world(self) -> int:
        """The number of ranks that wrote it."""
        return len(self.ranks)


def checkpoint_path(run_file: str | os.PathLike[str], step: int) -> Path:
    """``RUN.ckpt-00000100.h5`` beside ``RUN.h5``."""
    run_file = Path(run_file)
    return run_file.with_name(f"{run_file.stem}.ckpt-{step:08d}.h5")


def checkpoint_config(path: str | os.PathLike[str]) -> str | None:
    """The config (TOML text) a checkpoint stores, read from its attributes alone; None when the
    file cannot be read (loading it says why, in its own words)."""
    try:
        with h5py.File(path, "r") as h5:
            text = h5.attrs.get("config")
    except (OSError, ValueError):
        return None
    return str(text) if text is not None else None


def checkpoint_run_file(path: str | os.PathLike[str]) -> Path | None:
    """The run file a checkpoint belongs to, told by its name (None: not a checkpoint's name).

    ``RUN.ckpt-00000100.h5`` (and its temporary ``RUN.ckpt-00000100.h5.PID.tmp``) gives
    ``RUN.h5`` beside it.
    """
    path = Path(path)
    m = _NAME.search(path.name) or _TEMPORARY.search(path.name)
    return path.with_name(f"{path.name[: m.start()]}.h5") if m else None


def list_checkpoints(run_file: str | os.PathLike[str]) -> list[Path]:
    """The checkpoints of ``run_file``, newest (highest step) first."""
    run_file = Path(run_file)
    found = []
    for p in run_file.parent.glob(f"{run_file.stem}.ckpt-*.h5"):
        m = _NAME.search(p.name)
        if m and p.name == f"{run_file.stem}.ckpt-{m.group(1)}.h5":
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found, reverse=True)]


def _hash_arrays(h: Any, arrays: Any) -> None:
    """Feed ``(path, array)`` pairs to the hash ``h``: each path, dtype and shape, then its bytes."""
    for path, a in arrays:
        a = np.ascontiguousarray(a)
        h.update(f"{path}:{a.dtype.str}:{a.shape}".encode())
        h.update(a.tobytes())


def _digest(ckpt: Checkpoint) -> str:
    h = hashlib.sha256()
    _hash_arrays(h, _arrays(ckpt))
    for r, (_, meta) in enumerate(ckpt.ranks):
        h.update(f"rank_meta/{r}:".encode() + _json(meta).encode())
    for piece in sorted(ckpt.pieces):
        h.update(f"pieces/{piece}/meta:".encode() + _json(ckpt.pieces[piece].get("meta", {})).encode())
    return h.hexdigest()


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def _arrays(ckpt: Checkpoint) -> list[tuple[str, np.ndarray]]:
    """Every array with its path in the file, in a fixed order."""
    out = []
    for piece in sorted(ckpt.pieces):
        for group, arrays in sorted(ckpt.pieces[piece].items()):
            if group != "meta":
                out += [(f"pieces/{piece}/{group}/{k}", np.asarray(arrays[k])) for k in sorted(arrays)]
    for r, (arrays, _) in enumerate(ckpt.ranks):
        out += [(f"ranks/{r}/{k}", np.asarray(arrays[k])) for k in sorted(arrays)]
    return out


def save_checkpoint(ckpt: Checkpoint, path: str | os.PathLike[str]) -> Path:
    """Write ``ckpt`` to a temporary file, flush it to disk, and rename it to ``path``.

    A process killed while writing leaves only the temporary file (``*.tmp``), which
    :func:`list_checkpoints` ignores: the previous checkpoint stays the newest (and
    :func:`orphaned_temporaries` finds it for ``--resume auto`` to remove).

    Raises:
        FileError: the file cannot be written (permissions, a full disk): the temporary
            file is removed, earlier checkpoints are untouched.
    """
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        _write(ckpt, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        fix = "the earlier checkpoints are kept; free space or write elsewhere"
        raise file_error(path, err, what="checkpoint", fix=fix) from None
    return path


def _write(ckpt: Checkpoint, tmp: Path) -> None:
    h5 = h5py.File(tmp, "w")
    try:
        provenance = {k: v for k, v in ckpt.attrs.items() if k not in ("format_version", "digest")}
        h5.attrs.update(
            {
                **provenance,  # what a loaded checkpoint carried; the computed values below win
                "format_version": CKPT_VERSION,
                "step": ckpt.step,
                "epoch": ckpt.epoch,
                "ranks": ckpt.world,
                "config": ckpt.config,
                "placement": ckpt.placement,
                "created": heartbeat_now(),
                "meta": _json(ckpt.meta),
                "digest": _digest(ckpt),
            }
        )
        for piece, groups in ckpt.pieces.items():
            h5.require_group(f"pieces/{piece}").attrs["meta"] = _json(groups.get("meta", {}))
            for group in groups:
                if group != "meta":
                    h5.require_group(f"pieces/{piece}/{group}")  # an empty group too (SGD without momentum)
        for path, a in _arrays(ckpt):
            h5.create_dataset(path, data=a)
        metas = [_json(meta) for _, meta in ckpt.ranks]
        h5.create_dataset("rank_meta", data=np.array(metas, dtype=h5py.string_dtype()))
        h5.flush()
    except BaseException:
        try:  # the temporary file is thrown away: no flush error of its closing matters
            h5.close()
        except (OSError, RuntimeError):
            pass
        raise
    h5.close()


def _read_group(group: h5py.Group) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}

    def visit(name: str, obj: Any) -> None:
        if isinstance(obj, h5py.Dataset):
            out[name] = obj[()]

    group.visititems(visit)
    return out


def load_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Read and verify a checkpoint (format 2, or 1: read as the sync strategy's pieces).

    Raises:
        CheckpointError: the file is missing, not HDF5 (e.g. truncated), of another
            format version, or its arrays do not match their digest.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        with h5py.File(path, "r") as h5:
            attrs = dict(h5.attrs)
            version = attrs.get("format_version")
            if version == 1:
                ckpt, digest = _read_v1(h5, attrs), _digest_v1(h5)
            elif version == CKPT_VERSION:
                ckpt, digest = _read_v2(h5, attrs), None
            else:
                raise CheckpointError(
                    f"checkpoint {path} has format version {version}, this hpcdl reads {CKPT_VERSION} (and 1)"
                )
    except CheckpointError:
        raise
    except (OSError, KeyError, ValueError) as err:
        raise CheckpointError(f"checkpoint {path} is damaged or truncated ({err})") from None
    ckpt.path = path
    if (digest if digest is not None else _digest(ckpt)) != attrs.get("digest"):
        raise CheckpointError(f"checkpoint {path} is damaged: its arrays do not match their SHA-256 digest")
    return ckpt


_KEPT = ("format_version", "created", "hpcdl_version", "mpi_library", "run_file", "digest")


def _read_v2(h5: h5py.File, attrs: dict[str, Any]) -> Checkpoint:
    pieces: dict[str, dict[str, Any]] = {}
    for piece, groups in h5["pieces"].items():
        pieces[piece] = {g: _read_group(groups[g]) for g in groups}
        pieces[piece]["meta"] = json.loads(groups.attrs["meta"])
    world = int(attrs["ranks"])
    metas = [json.loads(m) for m in h5["rank_meta"].asstr()[...]]
    ranks = [(_read_group(h5[f"ranks/{r}"]) if f"ranks/{r}" in h5 else {}, metas[r]) for r in range(world)]
    return Checkpoint(
        step=int(attrs["step"]),
        epoch=int(attrs["epoch"]),
        config=str(attrs["config"]),
        placement=str(attrs["placement"]),
        pieces=pieces,
        ranks=ranks,
        meta=json.loads(attrs["meta"]),
        attrs={k: attrs[k] for k in _KEPT if k in attrs},
    )


def _read_v1(h5: h5py.File, attrs: dict[str, Any]) -> Checkpoint:
    """A format-1 file (sync data parallel, before pieces) in the format-2 structures."""
    world = int(attrs["ranks"])
    meta, rng = json.loads(attrs["meta"]), json.loads(attrs["rng"])
    fit, counters = meta.get("fit", {}), meta.get("counters", {})
    places = [{"role": "worker", "holds": "model", "member": r} for r in range(world)]
    placement = {"strategy": "sync", "ranks": places, "batch_size": fit.get("data.batch_size", 0),
                 "micro_steps": fit.get("exchange.accumulate", 1), "notes": []}  # fmt: skip
    exchange = {"bytes_sent": counters.get("bytes_sent", 0), "comm_time": 0.0, "exposed_time": 0.0}
    ranks = [
        (
            _read_group(h5[f"buffers/{r}"]) if f"buffers/{r}" in h5 else {},
            {
                "random": rng[r],
                "sampler": meta["sampler"],
                "exchange": exchange,
                "driver": {k: counters.get(k, 0.0) for k in ("train_s", "compute_s", "elapsed_s")},
            },
        )
        for r in range(world)
    ]
    model = {"params": _read_group(h5["params"]), "optimizer": _read_group(h5["optimizer"]),
             "meta": {"optimizer": meta["optimizer"]}}  # fmt: skip
    driver = {"fit": fit}
    return Checkpoint(
        step=int(attrs["step"]),
        epoch=int(attrs["epoch"]),
        config=str(attrs["config"]),
        placement=json.dumps(placement, sort_keys=True),
        pieces={"model": model},
        ranks=ranks,
        meta=driver,
        attrs={k: attrs[k] for k in _KEPT if k in attrs},
    )


def _digest_v1(h5: h5py.File) -> str:
    """A format-1 file's digest, over its groups as they were written."""
    groups = {"params": _read_group(h5["params"]), "optimizer": _read_group(h5["optimizer"])}
    for r in range(int(h5.attrs["ranks"])):
        groups[f"buffers/{r}"] = _read_group(h5[f"buffers/{r}"]) if f"buffers/{r}" in h5 else {}
    h = hashlib.sha256()
    _hash_arrays(h, ((f"{g}/{key}", groups[g][key]) for g in sorted(groups) for key in sorted(groups[g])))
    return h.hexdigest()


def orphaned_temporaries(run_file: str | os.PathLike[str]) -> list[Path]:
    """Temporary checkpoint files of ``run_file`` (``RUN.ckpt-N.h5.PID.tmp``) left by a killed run."""
    run_file = Path(run_file)

    def ours(p: Path) -> bool:
        m = _TEMPORARY.search(p.name)
        return m is not None and p.name[: m.start()] == run_file.stem

    return sorted(filter(ours, run_file.parent.glob(f"{run_file.stem}.ckpt-*.tmp")))


def prune_checkpoints(run_file: str | os.PathLike[str], keep: int) -> list[Path]:
    """Delete all but the ``keep`` newest checkpoints of ``run_file``; returns the deleted."""
    old = list_checkpoints(run_file)[max(keep, 1) :]
    for p in old:
        p.unlink(missing_ok=True)
    return old
