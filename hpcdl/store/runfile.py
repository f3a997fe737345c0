"""The run file: one HDF5 file per run, readable with plain h5py, pandas or xarray.

Layout (format version 2; docs/runfile.md is the full reference)::

    /                       attrs: format_version, name, config (TOML text), hpcdl_version,
                                   git_commit, mpi_library, ranks, strategy, placement
                                   (JSON: each rank's role, piece, data-parallel member),
                                   world ("mpi" | "sim"),
                                   network, compute, start_time (ISO 8601, UTC), status
                                   ("running" | "finished" | "stopped" | "failed"), end_time,
                                   wall_s and samples_per_s (the run's wall time and
                                   throughput, as the training command defines them:
                                   hpcdl/driver/figures.py; updated at each write while it
                                   runs), final_test_accuracy, peak_rss_mb
                                   (the process's peak resident set: in a simulation, all
                                   virtual ranks together), resumed_at (steps resumed
                                   from), rows_cut (rows dropped by resumes); in a
                                   simulation network and compute are JSON (the models);
                                   host, pid, pid_start (rank 0's, of the latest
                                   segment; pid_start: the process's start in clock
                                   ticks after boot, to tell it from a later process
                                   with the same pid) and heartbeat (ISO 8601, UTC:
                                   renewed at each flush and at least every 30 s at step
                                   boundaries), heartbeat_gap_s (the longest time between
                                   two heartbeats of that writer), so that a run killed
                                   without a word (SIGKILL, a dead node) can be told from
                                   a live one (:mod:`hpcdl.store.liveness`);
                                   config_changes (JSON list: settings changed by
                                   resumes, with the step)
    /metrics/<series>       1-D, one row per step: step, epoch, samples (training samples
                            processed up to the step), time (s since the start),
                            loss, train_accuracy, test_accuracy, test_loss (NaN when not
                            evaluated), lr, step_time, samples_per_s (the step's own
                            rate: the global batch over step_time), bytes_sent; and the
                            metric columns the run's strategy declares
    /ranks/<series>         2-D (steps, ranks) — (meetings, ranks) for a strategy whose
                            ranks run free between meetings (ps), with ranks/step the
                            step each meeting ended at: compute_time, comm_time, wait_time,
                            exposed_comm_time (the part of comm_time after backward ended),
                            other_time (the rank's time between the end of the previous
                            step and this one: metrics agreement, evaluation, logging,
                            checkpoints; compute + comm + other is the wall time per step);
                            and a strategy's own series (ps: pushes_per_s of each worker,
                            busy_fraction of each server; NaN on the other ranks)
    /<table>/<column>       1-D: a row table the run's strategy declares, its attribute
                            cut_by naming the column a resume cuts it by (format 1 had
                            none: the declaration says). ps's staleness/: one row per
                            push applied and shard: update (the server's version after
                            applying it), worker, server, tau (the server's version when
                            applying it less the version the worker computed it from),
                            time (s since the start, the server's clock)
    /trace/<field>          1-D, one row per event: rank, kind, start, end, microbatch
    /profile/<column>       1-D, one row per layer (when profile.layers is on): layer, kind,
                            forward_s, backward_s, calls, output_bytes, output_shape
    /profile/ops/<column>   1-D, one row per op and dimensions the run announced (K-FAC's
                            factor, eigh, precondition; hpcdl.nn.hooks.op): op, dims
                            ("64x1025"), seconds (the median), calls

Only rank 0 writes it (the h5py wheel has no MPI driver): the training command gathers
the other ranks' rows first. Every dataset is chunked and resizable; rows are appended
and the file flushed every few steps, so a crash loses at most those.

**A full disk loses nothing already written.** HDF5 updates its metadata in place, so a
write that fails half way (no space left, a file size limit) can leave a file that no
longer opens. Before each write, :class:`RunFile` therefore allocates the space the write
may take beyond the file's end (``posix_fallocate``): on a full disk that allocation
fails, before HDF5 has touched the file, and the run file keeps every row of its last
flush. (Copy-on-write file systems such as btrfs or ZFS can still fail an in-place write.)
"""

from __future__ import annotations

import datetime
import errno
import json
import os
import re
import socket
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from hpcdl.errors import FileError, HpcdlError, file_error
from hpcdl.store.liveness import HEARTBEAT_S, start_ticks

__all__ = [
    "RunFile",
    "RunFileError",
    "FORMAT_VERSION",
    "METRICS",
    "RANK_SERIES",
    "TableSpec",
    "TRACE_FIELDS",
    "heartbeat_now",
    "read_attrs",
    "read_only",
    "unreadable",
]

#: 2: the metric columns and row groups are those the run's components declare (a row group
#: carries the column a resume cuts it by); a strategy's keys in its own section (``ps.mode``).
#: Files of format 1 are read and continued (a resume makes them format 2).
FORMAT_VERSION = 2
_READABLE = (1, 2)

#: the driver's metrics/ series and their dtypes (a strategy declares more of its own)
METRICS: dict[str, Any] = {
    "step": np.int64,
    "epoch": np.int64,
    "samples": np.int64,
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
RANK_SERIES = ("compute_time", "comm_time", "wait_time", "exposed_comm_time", "other_time")
#: a row group's columns (name -> dtype) and the column a resume cuts it by
TableSpec = tuple[Mapping[str, Any], str]


def __getattr__(name: str) -> Any:
    if name == "TABLES":  # moved: each strategy declares its row groups (hpcdl.components.Declares)
        import warnings  # noqa: PLC0415

        from hpcdl.components import all_declared  # noqa: PLC0415

        warnings.warn("TABLES is declared by each strategy now (hpcdl.components.all_declared().tables)",
                      DeprecationWarning, stacklevel=2)  # fmt: skip
        return {n: (dict(t.columns), t.cut_by) for n, t in all_declared().tables.items()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: the trace/ fields
TRACE_FIELDS: dict[str, Any] = {
    "rank": np.int32,
    "kind": h5py.string_dtype(),
    "start": np.float64,
    "end": np.float64,
    "microbatch": np.int32,
}
_CHUNK = 1024
#: bytes reserved beyond the file's end for metadata (B-tree nodes, heaps, attributes)
_SLACK = 1 << 20
_FIX_WRITE = "rows up to the last flush are kept; free space or write elsewhere, then --resume auto"


class RunFileError(HpcdlError):
    """The run file cannot be created, opened or continued."""


def heartbeat_now() -> str:
    """The time written as ``heartbeat`` (and ``start_time``, ``end_time``): ISO 8601, UTC."""
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


class RunFile:
    """Rank 0's handle on a run file (create with :meth:`create`, continue with :meth:`resume`).

    Every write first reserves its space on disk (see the module's docstring); a write that
    fails raises :class:`~hpcdl.errors.FileError` and leaves the file as its last flush
    left it. After that the handle writes nothing more (closing it included).
    """

    def __init__(
        self,
        h5: h5py.File,
        metrics: Mapping[str, Any] | None = None,
        tables: Mapping[str, TableSpec] | None = None,
    ) -> None:
        self.h5 = h5
        #: the metrics/ columns a row may carry: the driver's and those the run declares
        self.metrics: dict[str, Any] = {**METRICS, **(metrics or {})}
        #: the row groups the run declares: name -> (columns, the column a resume cuts by)
        self.tables: dict[str, TableSpec] = dict(tables or {})
        self.path = Path(h5.filename)
        self.failed: FileError | None = None  # the write error after which nothing is written
        self._padded = False  # space reserved past HDF5's end of file, trimmed by close()
        self._beat_at = time.monotonic()  # the last heartbeat (the real clock: the process is alive)
        self._gap = 0.0  # the longest time between two heartbeats so far

    # -- guarded writes ---------------------------------------------------------------------
    def _reserve(self, nbytes: int) -> None:
        """Allocate ``nbytes`` (+ slack for metadata) past HDF5's end of file, or raise.

        Raises:
            FileError: no space (or a file size limit): nothing was written.
        """
        if self.failed is not None:
            raise self.failed
        end = int(self.h5.id.get_filesize())
        try:
            os.posix_fallocate(int(self.h5.id.get_vfd_handle()), end, int(nbytes) + _SLACK)  # HDF5's own fd
            self._padded = True
        except OSError as err:
            raise self._fail(file_error(self.path, err, what="run file", fix=_FIX_WRITE)) from None

    def _written(self, what: str, call: Any, *args: Any) -> Any:
        """Run an HDF5 write; an ``OSError`` becomes the :class:`FileError` of this file."""
        try:
            return call(*args)
        except (OSError, RuntimeError) as err:  # HDF5 reports some write failures as RuntimeError
            if isinstance(err, RuntimeError) and "errno" not in str(err):
                raise
            reason = err if isinstance(err, OSError) else OSError(str(err))
            error = file_error(self.path, reason, what=f"run file ({what})", fix=_FIX_WRITE)
            raise self._fail(error) from None

    def _fail(self, error: FileError) -> FileError:
        """After a failed write: HDF5 writes nothing more to the file, closing it included.

        HDF5 would flush its metadata cache when the file is closed, in place, describing
        data that never reached the disk: the file would not open again. Its file
        descriptor is therefore replaced by a read-only one of the same file, so that every
        later write fails and the file stays as its last flush left it.
        """
        self.failed = error
        try:
            fd = self.h5.id.get_vfd_handle()
            readonly = os.open(self.path, os.O_RDONLY)
            try:
                os.dup2(readonly, int(fd))
            finally:
                os.close(readonly)
        except (OSError, ValueError, TypeError, RuntimeError):
            pass  # another driver: nothing to freeze, the close below is best effort
        return error

    # -- opening ------------------------------------------------------------------------
    @classmethod
    def create(
        cls,
        path: str | os.PathLike[str],
        attrs: Mapping[str, Any],
        ranks: int,
        metrics: Mapping[str, Any] | None = None,
        tables: Mapping[str, TableSpec] | None = None,
    ) -> RunFile:
        """Create a new run file with its groups and empty series.

        ``metrics``: the metric columns the run declares beyond :data:`METRICS`; ``tables``:
        its row groups (created by their first rows).

        Raises:
            RunFileError: the file exists (nothing is overwritten) or cannot be written.
        """
        path = Path(path)
        if path.exists():
            raise RunFileError(
                f"{path} already exists: continue it with --resume auto, or choose another --out"
            )
        fix = "choose another --out, or fix the permissions or free space"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            where = err.filename or path.parent
            if isinstance(err, FileExistsError) and not Path(where).is_dir():  # a file stands in the way
                err = NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), where)
            raise file_error(where, err, what="directory", verb="create", fix=fix) from None
        try:
            h5 = h5py.File(path, "w-")
        except OSError as err:
            raise file_error(path, err, what="run file", verb="create", fix=fix) from None
        try:
            h5.attrs["format_version"] = FORMAT_VERSION
            h5.attrs["status"] = "running"
            h5.attrs["resumed_at"] = np.zeros(0, dtype=np.int64)
            h5.attrs["rows_cut"] = 0
            h5.attrs["config_changes"] = "[]"
            for key, value in {**attrs, **_alive()}.items():
                h5.attrs[key] = value
            group = h5.create_group("metrics")
            for name, dtype in {**METRICS, **(metrics or {})}.items():
                _metric_series(group, name, dtype, 0)
            group = h5.create_group("ranks")
            for name in RANK_SERIES:
                _rank_series(group, name, 0, ranks)
            trace = h5.create_group("trace")
            for name, dtype in TRACE_FIELDS.items():
                trace.create_dataset(name, shape=(0,), maxshape=(None,), dtype=dtype, chunks=(_CHUNK,))
            h5.create_group("profile")
            h5.flush()
        except OSError as err:  # a new file of ours, not yet worth keeping
            try:
                h5.close()
            except (OSError, RuntimeError):
                pass
            path.unlink(missing_ok=True)
            raise file_error(path, err, what="run file", verb="create", fix=fix) from None
        return cls(h5, metrics, tables)

    @classmethod
    def resume(
        cls,
        path: str | os.PathLike[str],
        step: int,
        ranks: int,
        metrics: Mapping[str, Any] | None = None,
        tables: Mapping[str, TableSpec] | None = None,
    ) -> RunFile:
        """Open an existing run file to continue after a checkpoint of ``step``.

        ``metrics`` and ``tables``: what the run declares (as for :meth:`create`); a column
        newer than the file is added with its default for the rows kept. A file of format 1
        becomes format 2.

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
            raise unreadable(path, err) from None
        if h5.attrs.get("format_version") not in _READABLE or "metrics" not in h5:
            h5.close()
            raise RunFileError(f"{path} is not an hpcdl run file (format {FORMAT_VERSION})")
        written_by = int(h5.attrs["ranks"])
        if written_by != ranks:
            h5.close()
            raise RunFileError(
                f"{path} was written by {written_by} ranks and this run has {ranks}: continue it on "
                f"{written_by} ranks, or start a new run with another --out"
            )
        runfile = cls(h5, metrics, tables)
        runfile._reserve(0)
        runfile._written("resume", runfile._cut, step, ranks)
        return runfile

    def _cut(self, step: int, ranks: int) -> None:
        """Cut the rows after ``step`` and mark the file as running again (see :meth:`resume`)."""
        h5 = self.h5
        steps = h5["metrics/step"][...]
        keep = int(np.searchsorted(steps, step, side="right"))  # steps are increasing
        cut = len(steps) - keep
        last_time = float(h5["metrics/time"][keep - 1]) if keep else 0.0
        for name, dtype in self.metrics.items():
            if name not in h5["metrics"]:  # a series newer than the file: its default for the rows
                _metric_series(h5["metrics"], name, dtype, len(steps))
        for dataset in h5["metrics"].values():
            dataset.resize((keep,))
        for name in RANK_SERIES:
            if name not in h5["ranks"]:  # a series newer than the file: NaN for the rows it has
                _rank_series(h5["ranks"], name, len(steps), ranks, fill=np.nan)
        kept = keep  # ranks/ rows are steps, or meetings ending at ranks/step (a free-running strategy)
        if "step" in h5["ranks"]:
            kept = int(np.count_nonzero(h5["ranks/step"][...] <= step))
        for dataset in h5["ranks"].values():  # a strategy's own series too
            dataset.resize((kept, *dataset.shape[1:]))
        for table, group in h5.items():
            by = group.attrs.get("cut_by") if isinstance(group, h5py.Group) else None
            if by is None and table in self.tables:  # format 1: the strategy's declaration says
                by = self.tables[table][1]
                group.attrs["cut_by"] = by
            if by is not None:
                kept = int(np.count_nonzero(group[by][...] <= step))  # rows of the kept pushes, say
                for dataset in group.values():
                    dataset.resize((kept,))
        starts = h5["trace/start"][...]
        n_events = int(np.count_nonzero(starts <= last_time)) if keep else 0
        for name in TRACE_FIELDS:
            h5["trace"][name].resize((n_events,))
        h5.attrs["rows_cut"] = int(h5.attrs["rows_cut"]) + cut
        h5.attrs["resumed_at"] = np.append(h5.attrs["resumed_at"], step).astype(np.int64)
        h5.attrs["status"] = "running"
        h5.attrs["format_version"] = FORMAT_VERSION
        if "error" in h5.attrs:  # why an earlier segment failed or stalled: not this one's
            del h5.attrs["error"]
        for key, value in _alive().items():
            h5.attrs[key] = value
        h5.flush()

    # -- appending ----------------------------------------------------------------------
    def _table_columns(self, name: str, columns: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The columns of row group ``name`` (:attr:`tables`), in their dtypes.

        Raises:
            ValueError: a group nobody declared, or columns that are not the group's.
        """
        if name not in self.tables:
            raise ValueError(f"row group {name!r} is declared by no component (Declares.tables)")
        dtypes, _ = self.tables[name]
        if set(columns) != set(dtypes):
            raise ValueError(f"{name}/ has columns {sorted(dtypes)}, not {sorted(columns)}")
        return {column: np.asarray(columns[column], dtype=dtype) for column, dtype in dtypes.items()}

    def append_metrics(self, rows: Sequence[Mapping[str, float]]) -> None:
        """Append rows (dicts of :attr:`metrics` names; missing values become NaN or 0)."""
        if not rows:
            return
        self._append_all(self.h5["metrics"], self._metric_columns(rows), "metrics")

    def check_row(self, row: Mapping[str, float]) -> None:
        """Refuse a row with a key no component declares.

        Raises:
            ValueError: naming the keys (a strategy's metric column is declared in its
                ``Declares.metrics``): never dropped in silence.
        """
        unknown = sorted(set(row) - self.metrics.keys())
        if unknown:
            raise ValueError(
                f"metrics rows carry {', '.join(map(repr, unknown))}, which no component declares: "
                "declare them in the strategy's Declares.metrics"
            )

    def _metric_columns(self, rows: Sequence[Mapping[str, float]]) -> dict[str, np.ndarray]:
        """The rows as columns (each row checked: :meth:`check_row`)."""
        for row in rows:
            self.check_row(row)
        columns = {}
        for name, dtype in self.metrics.items():
            default = np.nan if np.dtype(dtype).kind == "f" else 0
            columns[name] = np.array([row.get(name, default) for row in rows], dtype=dtype)
        return columns

    def append_ranks(self, series: Mapping[str, np.ndarray]) -> None:
        """Append (steps, ranks) blocks of :data:`RANK_SERIES`."""
        columns = {name: np.asarray(series[name], dtype=np.float64) for name in RANK_SERIES}
        self._append_all(self.h5["ranks"], columns, "ranks")

    def append_trace(self, events: Mapping[str, Sequence[Any]]) -> None:
        """Append events: equal-length sequences for each of :data:`TRACE_FIELDS`."""
        columns = {
            name: np.asarray(events[name], dtype=object if name == "kind" else dtype)
            for name, dtype in TRACE_FIELDS.items()
        }
        self._append_all(self.h5["trace"], columns, "trace")

    def _append_all(self, group: h5py.Group, columns: Mapping[str, np.ndarray], what: str) -> None:
        """Append each column to its dataset of ``group``, after reserving the space."""
        self._reserve(_space(group, columns))
        self._put(group, columns, what)

    def _put(self, group: h5py.Group, columns: Mapping[str, np.ndarray], what: str) -> None:
        for name, values in columns.items():
            self._written(what, _append, group[name], values)

    def append_rows(
        self,
        rows: Sequence[Mapping[str, float]],
        series: Mapping[str, np.ndarray],
        tables: Mapping[str, Mapping[str, np.ndarray]] | None = None,
        rank_steps: Sequence[int] | None = None,
    ) -> None:
        """A flush of the training log: metrics rows, per-rank blocks, row groups
        (:attr:`tables`), heartbeat, then to disk.

        ``series`` holds every :data:`RANK_SERIES` block and may hold a strategy's own
        (created on first use, NaN for the rows before). ``rank_steps``: the ``ranks/``
        rows are meetings of a free-running strategy, not steps; the step each ended at
        goes to ``ranks/step``. The space of the whole batch is
        reserved before HDF5 is called at all, so a full disk leaves the file exactly as
        its previous flush did (no metrics rows without their per-rank rows).
        """
        metrics = self._metric_columns(rows)
        ranks = {name: np.asarray(values, dtype=np.float64) for name, values in series.items()}
        if rank_steps is not None:
            ranks["step"] = np.asarray(rank_steps, dtype=np.int64)
        groups = {name: self._table_columns(name, columns) for name, columns in (tables or {}).items()}
        new = set(ranks) - set(self.h5["ranks"]) or any(name not in self.h5 for name in groups)
        if new:  # the new datasets' headers are written into reserved space too
            self._reserve(0)
            self._written("layout", self._add_datasets, ranks, groups)
        space = _space(self.h5["metrics"], metrics) + _space(self.h5["ranks"], ranks) + 4096
        space += sum(_space(self.h5[name], columns) for name, columns in groups.items())
        self._reserve(space)
        self._put(self.h5["metrics"], metrics, "metrics")
        self._put(self.h5["ranks"], ranks, "ranks")
        for name, columns in groups.items():
            self._put(self.h5[name], columns, name)
        self._heartbeat()
        self._written("flush", self.h5.flush)

    def beat(self) -> None:
        """Renew the heartbeat when :data:`~hpcdl.store.liveness.HEARTBEAT_S` have passed since
        the last one (rank 0, at each step boundary: cheap otherwise).

        Flushes renew it too; this keeps a live run's heartbeat fresh between flushes far
        apart (a large ``log.flush_every``, long steps), so that a job on another host can
        tell it from a dead one (:func:`hpcdl.store.liveness.stale_after`).
        """
        if self.failed is None and time.monotonic() - self._beat_at >= HEARTBEAT_S:
            self._reserve(4096)
            self._heartbeat()
            self._written("flush", self.h5.flush)

    def _heartbeat(self) -> None:
        """Write ``heartbeat`` (now) and ``heartbeat_gap_s`` (the longest gap so far); not flushed."""
        now = time.monotonic()
        self._gap = max(self._gap, now - self._beat_at)
        self._beat_at = now
        self._written("attributes", self.h5.attrs.__setitem__, "heartbeat", heartbeat_now())
        self._written("attributes", self.h5.attrs.__setitem__, "heartbeat_gap_s", round(self._gap, 1))

    def _add_datasets(
        self, ranks: Mapping[str, np.ndarray], groups: Mapping[str, Mapping[str, np.ndarray]]
    ) -> None:
        """Create the per-rank series and row groups this flush is the first to write."""
        group = self.h5["ranks"]
        rows, nranks = group[RANK_SERIES[0]].shape
        for name in ranks:
            if name == "step" and name not in group:
                group.create_dataset(name, shape=(rows,), maxshape=(None,), dtype=np.int64, chunks=(_CHUNK,))
            elif name not in group:
                _rank_series(group, name, rows, nranks, fill=np.nan)
        for name, columns in groups.items():
            table = self.h5.require_group(name)
            table.attrs["cut_by"] = self.tables[name][1]
            for column, values in columns.items():
                if column not in table:
                    table.create_dataset(column, shape=(0,), maxshape=(None,), dtype=values.dtype,
                                         chunks=(_CHUNK,))  # fmt: skip

    def write_profile(self, rows: Sequence[Mapping[str, Any]], ops: Sequence[Mapping[str, Any]] = ()) -> None:
        """Replace ``profile/`` by the per-layer profiler's table (one row per layer) and its ops
        (``profile/ops/``, one row per op and dimensions; none: no group)."""
        self._reserve(256 * (len(rows) + len(ops)) * 8)
        self._written("profile", self._write_profile, rows, ops)

    def _write_profile(self, rows: Sequence[Mapping[str, Any]], ops: Sequence[Mapping[str, Any]]) -> None:
        group = self.h5["profile"]
        for name in list(group):
            del group[name]
        if ops:
            sub = group.create_group("ops")
            sub.create_dataset("op", data=np.array([r["op"] for r in ops], dtype=h5py.string_dtype()))
            dims = ["x".join(map(str, r["dims"])) for r in ops]
            sub.create_dataset("dims", data=np.array(dims, dtype=h5py.string_dtype()))
            sub.create_dataset("seconds", data=np.array([r["seconds"] for r in ops], dtype=np.float64))
            sub.create_dataset("calls", data=np.array([r["calls"] for r in ops], dtype=np.int64))
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
        self._reserve(4096 + sum(len(str(v)) for v in attrs.values()))
        for key, value in attrs.items():
            self._written("attributes", self.h5.attrs.__setitem__, key, value)

    def record_config_change(self, step: int, changes: Mapping[str, tuple[Any, Any]], config: str) -> None:
        """Note settings a resume changed (``config_changes``) and store the new ``config`` text."""
        past = json.loads(str(self.h5.attrs.get("config_changes", "[]")))
        past.append({"step": step, "changed": {k: list(v) for k, v in changes.items()}})
        self.set_attrs(config_changes=json.dumps(past), config=config)

    def rows(self) -> int:
        """Rows in ``metrics/``."""
        return int(self.h5["metrics/step"].shape[0])

    def flush(self) -> None:
        """Write what HDF5 holds in memory to disk."""
        self._reserve(0)
        self._written("flush", self.h5.flush)

    def close(self) -> None:
        """Close the file (after a failed write: without writing anything more).

        Space reserved past the data is given back: HDF5 trims a file to its data when it
        closes a file it opened with extra bytes at the end, so the file is opened and
        closed once more.
        """
        if not self.h5.id.valid:
            return
        try:
            self.h5.close()
        except (OSError, RuntimeError):
            if self.failed is None:
                raise
        if self._padded and self.failed is None:
            try:
                h5py.File(self.path, "r+").close()
            except OSError as err:
                raise file_error(self.path, err, what="run file", verb="close", fix=_FIX_WRITE) from None

    def __enter__(self) -> RunFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _alive() -> dict[str, Any]:
    """Who writes the file now: rank 0's host, pid and its start, and the time (the gap starts anew)."""
    ticks = start_ticks()
    return {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": -1 if ticks is None else ticks,
            "heartbeat": heartbeat_now(), "heartbeat_gap_s": 0.0}  # fmt: skip


def _metric_series(group: h5py.Group, name: str, dtype: Any, rows: int) -> None:
    fill = np.nan if np.dtype(dtype).kind == "f" else 0
    group.create_dataset(name, shape=(rows,), maxshape=(None,), dtype=dtype, chunks=(_CHUNK,), fillvalue=fill)


def _rank_series(group: h5py.Group, name: str, rows: int, ranks: int, fill: float = 0.0) -> None:
    group.create_dataset(
        name,
        shape=(rows, ranks),
        maxshape=(None, ranks),
        dtype=np.float64,
        chunks=(_CHUNK, ranks),
        fillvalue=fill,
    )


def _space(group: h5py.Group, columns: Mapping[str, np.ndarray]) -> int:
    """Bytes an append of ``columns`` to ``group`` may add past the file's end.

    Rows go into chunks, allocated whole when first written: the chunks the new rows
    touch that are not allocated yet (a series added to an older file has none), and
    for variable-length strings their heap.
    """
    need = 0
    for name, values in columns.items():
        if not len(values):
            continue
        dataset = group[name]
        chunk_rows = dataset.chunks[0]
        row_bytes = dataset.dtype.itemsize * int(np.prod(dataset.shape[1:], dtype=np.int64))
        old = dataset.shape[0]
        for first in range(old // chunk_rows * chunk_rows, old + len(values), chunk_rows):
            coord = (first, *([0] * (dataset.ndim - 1)))
            allocated = first < old and dataset.id.get_chunk_info_by_coord(coord).byte_offset is not None
            if not allocated:
                need += chunk_rows * row_bytes
        if dataset.dtype.kind == "O":
            need += sum(64 + len(str(v)) for v in values)
    return need


def _append(dataset: h5py.Dataset, values: np.ndarray) -> None:
    n = dataset.shape[0]
    dataset.resize((n + len(values), *dataset.shape[1:]))
    dataset[n:] = values
    dataset.flush()  # a failure to write the chunk shows here, not when the dataset is let go


def read_only(path: str | os.PathLike[str]) -> h5py.File:
    """Open a run file for reading, also while its run is writing it.

    HDF5 locks a file its writer holds open; reading without the lock is safe here
    (nothing is written, and the writer flushes whole rows).

    Raises:
        OSError: h5py's, as :func:`unreadable` reads it.
    """
    try:
        return h5py.File(path, "r")
    except OSError as err:
        if "unable to lock file" not in str(err):
            raise
    return h5py.File(path, "r", locking=False)


#: h5py's words for a file cut short: "truncated file: eof = 20000, ..., stored_eof = 195088"
_TRUNCATED = re.compile(r"truncated file: eof = (\d+).*stored_eof = (\d+)")


def unreadable(
    path: str | os.PathLike[str], err: OSError, *, verb: str = "open", fix: str = ""
) -> HpcdlError:
    """The one line for a run file that h5py cannot open: damaged, or refused by the file system.

    A file cut short (a copy or a disk that failed while writing) or without HDF5's
    signature inside is called damaged, by ``report`` and ``train --resume`` alike.

    Args:
        path: the run file.
        err: h5py's ``OSError``.
        verb: ``open`` or ``read``.
        fix: what to do about a damaged file (the command knows); other failures get the
            fix of their errno (:func:`hpcdl.errors.file_error`).

    Returns:
        A :class:`RunFileError` (damaged) or :class:`~hpcdl.errors.FileError` to raise.
    """
    text = str(err)
    if "truncated" in text or "signature" in text or "addr overflow" in text:
        cut = _TRUNCATED.search(text)
        how = f" (truncated: {cut[1]} of its {cut[2]} bytes)" if cut else ""
        return RunFileError(f"cannot {verb} run file {path}: it is damaged{how} or not an hpcdl run file"
                            + (f"; {fix}" if fix else ""))  # fmt: skip
    return file_error(path, err, what="run file", verb=verb)


def read_attrs(path: str | os.PathLike[str], *, fix: str = "") -> dict[str, Any]:
    """The root attributes of an existing run file (read-only, also while its writer has it open;
    strings decoded).

    Args:
        path: the run file.
        fix: what to do when it is damaged or not HDF5 (added to the error).

    Raises:
        RunFileError: the file is damaged or not an hpcdl run file.
        FileError: the file cannot be opened.
    """
    path = Path(path)
    try:
        with read_only(path) as h5:
            if "metrics" not in h5 or "format_version" not in h5.attrs:
                raise RunFileError(f"{path} is not an hpcdl run file (no format_version or metrics/)")
            attrs = dict(h5.attrs)
    except OSError as err:
        if path.is_file() and not h5py.is_hdf5(path):
            raise RunFileError(
                f"{path} is not an HDF5 file (expected an hpcdl run file)" + (f"; {fix}" if fix else "")
            ) from None
        raise unreadable(path, err, fix=fix) from None
    return {k: v.decode() if isinstance(v, bytes) else v for k, v in attrs.items()}
