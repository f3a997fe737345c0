"""The run file: one HDF5 file per run, readable with plain h5py, pandas or xarray.

Layout (format version 1)::

    /                       attrs: format_version, name, config (TOML text), hpcdl_version,
                                   git_commit, mpi_library, ranks, world ("mpi" | "sim"),
                                   network, compute, start_time (ISO 8601, UTC), status
                                   ("running" | "finished" | "stopped" | "failed"), end_time,
                                   wall_s, final_test_accuracy, samples_per_s, peak_rss_mb
                                   (the process's peak resident set: in a simulation, all
                                   virtual ranks together), resumed_at (steps resumed
                                   from), rows_cut (rows dropped by resumes); in a
                                   simulation network and compute are JSON (the models)
    /metrics/<series>       1-D, one row per step: step, epoch, time (s since the start),
                            loss, train_accuracy, test_accuracy, test_loss (NaN when not
                            evaluated), lr, step_time, samples_per_s, bytes_sent
    /ranks/<series>         2-D (steps, ranks): compute_time, comm_time, wait_time,
                            exposed_comm_time (the part of comm_time after backward ended)
    /trace/<field>          1-D, one row per event: rank, kind, start, end, microbatch
    /profile/<column>       1-D, one row per layer (when profile.layers is on): layer, kind,
                            forward_s, backward_s, calls, output_bytes, output_shape

Only rank 0 writes it (the h5py wheel has no MPI driver): the training command gathers
the other ranks' rows first. Every dataset is chunked and resizable; rows are appended
and the file flushed every few steps, so a crash loses at most those.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from hpcdl.errors import HpcdlError

__all__ = ["RunFile", "RunFileError", "FORMAT_VERSION", "METRICS", "RANK_SERIES", "TRACE_FIELDS"]

FORMAT_VERSION = 1

#: the metrics/ series and their dtypes
METRICS: dict[str, Any] = {
    "step": np.int64,
    "epoch": np.int64,
    "time": np.float64,
    "loss": np.float64,
    "train_accuracy": np.float64,
    "test_accuracy": np.float64,
    "test_loss": np.float64,
    "lr": np.float64,
    "step_time": np.float64,
    "samples_per_s": np.float64,
    "bytes_sent": np.int64,
}
#: the ranks/ series, each (steps, ranks)
RANK_SERIES = ("compute_time", "comm_time", "wait_time", "exposed_comm_time")
#: the trace/ fields
TRACE_FIELDS: dict[str, Any] = {
    "rank": np.int32,
    "kind": h5py.string_dtype(),
    "start": np.float64,
    "end": np.float64,
    "microbatch": np.int32,
}
_CHUNK = 1024


class RunFileError(HpcdlError):
    """The run file cannot be created, opened or continued."""


class RunFile:
    """Rank 0's handle on a run file (create with :meth:`create`, continue with :meth:`resume`)."""

    def __init__(self, h5: h5py.File) -> None:
        self.h5 = h5
        self.path = Path(h5.filename)

    # -- opening ------------------------------------------------------------------------
    @classmethod
    def create(cls, path: str | os.PathLike[str], attrs: Mapping[str, Any], ranks: int) -> RunFile:
        """Create a new run file with its groups and empty series.

        Raises:
            RunFileError: the file exists (nothing is overwritten) or cannot be written.
        """
        path = Path(path)
        if path.exists():
            raise RunFileError(
                f"{path} already exists: continue it with --resume auto, or choose another --out"
            )
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            h5 = h5py.File(path, "w-")
        except OSError as err:
            raise RunFileError(f"cannot create run file {path}: {err}") from None
        h5.attrs["format_version"] = FORMAT_VERSION
        h5.attrs["status"] = "running"
        h5.attrs["resumed_at"] = np.zeros(0, dtype=np.int64)
        h5.attrs["rows_cut"] = 0
        for key, value in attrs.items():
            h5.attrs[key] = value
        metrics = h5.create_group("metrics")
        for name, dtype in METRICS.items():
            metrics.create_dataset(name, shape=(0,), maxshape=(None,), dtype=dtype, chunks=(_CHUNK,))
        group = h5.create_group("ranks")
        for name in RANK_SERIES:
            group.create_dataset(
                name, shape=(0, ranks), maxshape=(None, ranks), dtype=np.float64, chunks=(_CHUNK, ranks)
            )
        trace = h5.create_group("trace")
        for name, dtype in TRACE_FIELDS.items():
            trace.create_dataset(name, shape=(0,), maxshape=(None,), dtype=dtype, chunks=(_CHUNK,))
        h5.create_group("profile")
        h5.flush()
        return cls(h5)

    @classmethod
    def resume(cls, path: str | os.PathLike[str], step: int, ranks: int) -> RunFile:
        """Open an existing run file to continue after a checkpoint of ``step``.

        Rows of ``metrics/`` and ``ranks/`` past ``step`` (logged after the checkpoint,
        then lost with the job) are cut; their number is added to the ``rows_cut``
        attribute and ``step`` appended to ``resumed_at``. Trace events that start
        after the last kept row's time are cut too.

        Raises:
            RunFileError: the file is not an hpcdl run file or was written for another
                rank count.
        """
        path = Path(path)
        try:
            h5 = h5py.File(path, "r+")
        except OSError as err:
            raise RunFileError(f"cannot open run file {path} to continue it: {err}") from None
        if h5.attrs.get("format_version") != FORMAT_VERSION or "metrics" not in h5:
            h5.close()
            raise RunFileError(f"{path} is not an hpcdl run file (format {FORMAT_VERSION})")
        if int(h5.attrs["ranks"]) != ranks:
            h5.close()
            raise RunFileError(f"{path} was written by {int(h5.attrs['ranks'])} ranks, not {ranks}")
        steps = h5["metrics/step"][...]
        keep = int(np.searchsorted(steps, step, side="right"))  # steps are increasing
        cut = len(steps) - keep
        last_time = float(h5["metrics/time"][keep - 1]) if keep else 0.0
        for name in METRICS:
            h5["metrics"][name].resize((keep,))
        for name in RANK_SERIES:
            h5["ranks"][name].resize((keep, ranks))
        starts = h5["trace/start"][...]
        n_events = int(np.count_nonzero(starts <= last_time)) if keep else 0
        for name in TRACE_FIELDS:
            h5["trace"][name].resize((n_events,))
        h5.attrs["rows_cut"] = int(h5.attrs["rows_cut"]) + cut
        h5.attrs["resumed_at"] = np.append(h5.attrs["resumed_at"], step).astype(np.int64)
        h5.attrs["status"] = "running"
        h5.flush()
        return cls(h5)

    # -- appending ----------------------------------------------------------------------
    def append_metrics(self, rows: Sequence[Mapping[str, float]]) -> None:
        """Append rows (dicts of :data:`METRICS` names; missing values become NaN or 0)."""
        if not rows:
            return
        group = self.h5["metrics"]
        for name, dtype in METRICS.items():
            default = np.nan if np.dtype(dtype).kind == "f" else 0
            values = np.array([row.get(name, default) for row in rows], dtype=dtype)
            _append(group[name], values)

    def append_ranks(self, series: Mapping[str, np.ndarray]) -> None:
        """Append (steps, ranks) blocks of :data:`RANK_SERIES`."""
        for name in RANK_SERIES:
            _append(self.h5["ranks"][name], np.asarray(series[name], dtype=np.float64))

    def append_trace(self, events: Mapping[str, Sequence[Any]]) -> None:
        """Append events: equal-length sequences for each of :data:`TRACE_FIELDS`."""
        for name, dtype in TRACE_FIELDS.items():
            values = np.asarray(events[name], dtype=object if name == "kind" else dtype)
            _append(self.h5["trace"][name], values)

    def write_profile(self, rows: Sequence[Mapping[str, Any]]) -> None:
        """Replace ``profile/`` by the per-layer profiler's table (one row per layer)."""
        group = self.h5["profile"]
        for name in list(group):
            del group[name]
        if not rows:
            return
        group.create_dataset("layer", data=np.array([r["layer"] for r in rows], dtype=h5py.string_dtype()))
        group.create_dataset("kind", data=np.array([r["kind"] for r in rows], dtype=h5py.string_dtype()))
        for name in ("forward_s", "backward_s"):
            group.create_dataset(name, data=np.array([r[name] for r in rows], dtype=np.float64))
        for name in ("calls", "output_bytes"):
            group.create_dataset(name, data=np.array([r[name] for r in rows], dtype=np.int64))
        shapes = ["x".join(map(str, r["output_shape"])) for r in rows]
        group.create_dataset("output_shape", data=np.array(shapes, dtype=h5py.string_dtype()))

    def set_attrs(self, **attrs: Any) -> None:
        """Set root attributes (status, end_time, summary figures)."""
        for key, value in attrs.items():
            self.h5.attrs[key] = value

    def rows(self) -> int:
        """Rows in ``metrics/``."""
        return int(self.h5["metrics/step"].shape[0])

    def flush(self) -> None:
        self.h5.flush()

    def close(self) -> None:
        if self.h5.id.valid:
            self.h5.close()

    def __enter__(self) -> RunFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _append(dataset: h5py.Dataset, values: np.ndarray) -> None:
    n = dataset.shape[0]
    dataset.resize((n + len(values), *dataset.shape[1:]))
    dataset[n:] = values
