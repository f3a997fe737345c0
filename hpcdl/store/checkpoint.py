"""Checkpoints: HDF5 files beside the run file, written to a temporary name and renamed.

Layout (format version 1)::

    /                     attrs: format_version, step, epoch, ranks, created (ISO 8601),
                                 hpcdl_version, mpi_library, run_file (name of the run file),
                                 config (TOML text), meta (JSON: sampler position, optimizer
                                 scalars, exchange settings, counters), rng (JSON list: each
                                 rank's generator states), digest (SHA-256 of every array)
    /params/<name>        the parameters (equal on every rank)
    /optimizer/<key>      optimizer state arrays (equal on every rank)
    /buffers/<rank>/<name> each rank's buffers (BatchNorm statistics stay local)

A file is complete once it has its final name (``os.replace`` is atomic); the digest
catches a file damaged later.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from hpcdl.errors import HpcdlError, file_error

__all__ = [
    "CKPT_VERSION",
    "Checkpoint",
    "CheckpointError",
    "checkpoint_path",
    "list_checkpoints",
    "load_checkpoint",
    "orphaned_temporaries",
    "prune_checkpoints",
    "save_checkpoint",
]

CKPT_VERSION = 1
_NAME = re.compile(r"\.ckpt-(\d{8,})\.h5$")


class CheckpointError(HpcdlError):
    """A checkpoint is missing, damaged, or does not fit this run."""


@dataclass
class Checkpoint:
    """Everything a run needs to continue bit for bit from the end of step ``step``."""

    step: int
    epoch: int
    ranks: int
    config: str
    params: dict[str, np.ndarray]
    optimizer: dict[str, np.ndarray]
    buffers: list[dict[str, np.ndarray]]
    meta: dict[str, Any] = field(default_factory=dict)
    rng: list[dict[str, Any]] = field(default_factory=list)
    attrs: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None


def checkpoint_path(run_file: str | os.PathLike[str], step: int) -> Path:
    """``RUN.ckpt-00000100.h5`` beside ``RUN.h5``."""
    run_file = Path(run_file)
    return run_file.with_name(f"{run_file.stem}.ckpt-{step:08d}.h5")


def list_checkpoints(run_file: str | os.PathLike[str]) -> list[Path]:
    """The checkpoints of ``run_file``, newest (highest step) first."""
    run_file = Path(run_file)
    found = []
    for p in run_file.parent.glob(f"{run_file.stem}.ckpt-*.h5"):
        m = _NAME.search(p.name)
        if m and p.name == f"{run_file.stem}.ckpt-{m.group(1)}.h5":
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found, reverse=True)]


def _digest(groups: Mapping[str, Mapping[str, np.ndarray]]) -> str:
    h = hashlib.sha256()
    for gname in sorted(groups):
        for key in sorted(groups[gname]):
            a = np.ascontiguousarray(groups[gname][key])
            h.update(f"{gname}/{key}:{a.dtype.str}:{a.shape}".encode())
            h.update(a.tobytes())
    return h.hexdigest()


def _array_groups(ckpt: Checkpoint) -> dict[str, Mapping[str, np.ndarray]]:
    groups: dict[str, Mapping[str, np.ndarray]] = {"params": ckpt.params, "optimizer": ckpt.optimizer}
    for r, bufs in enumerate(ckpt.buffers):
        groups[f"buffers/{r}"] = bufs
    return groups


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
    groups = _array_groups(ckpt)
    h5 = h5py.File(tmp, "w")
    try:
        h5.attrs.update(
            {
                "format_version": CKPT_VERSION,
                "step": ckpt.step,
                "epoch": ckpt.epoch,
                "ranks": ckpt.ranks,
                "config": ckpt.config,
                "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                "meta": json.dumps(ckpt.meta),
                "rng": json.dumps(ckpt.rng),
                "digest": _digest(groups),
                **ckpt.attrs,
            }
        )
        for gname, arrays in groups.items():
            g = h5.require_group(gname)
            for key, a in arrays.items():
                g.create_dataset(key, data=np.asarray(a))
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
    """Read and verify a checkpoint.

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
            if version != CKPT_VERSION:
                raise CheckpointError(
                    f"checkpoint {path} has format version {version}, this hpcdl reads {CKPT_VERSION}"
                )
            ranks = int(attrs["ranks"])
            ckpt = Checkpoint(
                step=int(attrs["step"]),
                epoch=int(attrs["epoch"]),
                ranks=ranks,
                config=str(attrs["config"]),
                params=_read_group(h5["params"]),
                optimizer=_read_group(h5["optimizer"]),
                buffers=[
                    _read_group(h5[f"buffers/{r}"]) if f"buffers/{r}" in h5 else {} for r in range(ranks)
                ],
                meta=json.loads(attrs["meta"]),
                rng=json.loads(attrs["rng"]),
                attrs={k: v for k, v in attrs.items() if k not in ("meta", "rng", "config")},
                path=path,
            )
    except CheckpointError:
        raise
    except (OSError, KeyError, ValueError) as err:
        raise CheckpointError(f"checkpoint {path} is damaged or truncated ({err})") from None
    if _digest(_array_groups(ckpt)) != attrs.get("digest"):
        raise CheckpointError(f"checkpoint {path} is damaged: its arrays do not match their SHA-256 digest")
    return ckpt


def orphaned_temporaries(run_file: str | os.PathLike[str]) -> list[Path]:
    """Temporary checkpoint files of ``run_file`` (``RUN.ckpt-N.h5.PID.tmp``) left by a killed run."""
    run_file = Path(run_file)
    pattern = re.compile(rf"^{re.escape(run_file.stem)}\.ckpt-\d{{8,}}\.h5\.\d+\.tmp$")
    return sorted(p for p in run_file.parent.glob(f"{run_file.stem}.ckpt-*.tmp") if pattern.match(p.name))


def prune_checkpoints(run_file: str | os.PathLike[str], keep: int) -> list[Path]:
    """Delete all but the ``keep`` newest checkpoints of ``run_file``; returns the deleted."""
    old = list_checkpoints(run_file)[max(keep, 1) :]
    for p in old:
        p.unlink(missing_ok=True)
    return old
