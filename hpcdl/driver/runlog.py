"""The training command's run file: opening it (and the checkpoint to continue from), and
per-step metrics from every rank into rank 0's copy, gathered every few steps."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hpcdl import __version__
from hpcdl.comm import Communicator, on_root
from hpcdl.components import declared
from hpcdl.config import Config, legacy_values, stored_values
from hpcdl.driver.checkpoints import check_run_config, find_resume
from hpcdl.errors import ConfigError, HpcdlError
from hpcdl.parallel import Placement, Strategy
from hpcdl.store import FORMAT_VERSION, RunFile, RunFileError
from hpcdl.store.checkpoint import Checkpoint, list_checkpoints, orphaned_temporaries
from hpcdl.store.liveness import ago, writer
from hpcdl.store.runfile import TableSpec, heartbeat_now, read_attrs

__all__ = ["Opened", "RunLog", "open_run", "checkpoint_attrs", "peak_rss_mb"]


class RunLog:
    """Collects one metrics row per step (rank 0) and each rank's timings (all ranks).

    When the driver's ``flush`` extension fires (every ``log.flush_every`` steps, at a meeting:
    :mod:`hpcdl.driver.loop`), :meth:`flush` gathers the ranks' compute and
    communication times to rank 0 (one small ``gather``: a collective, called by
    every rank at the same step), which appends them with its metrics rows and
    flushes the file. Waiting time is estimated per step as a rank's
    communication time minus the smallest over the ranks: the part of the
    exchange spent waiting for slower ranks rather than moving data. A rank's
    *other* time is what it spent between the end of the previous step and the
    start of this one (metrics agreement, evaluation, logging, checkpoints), so that
    compute + communication + other is each rank's wall time per step. Each flush
    also writes the ``heartbeat`` attribute (the run is alive) and the attributes in
    :attr:`figures` (the driver's ``wall_s`` and ``samples_per_s`` so far), so that a
    running or killed run's file has them as of its last write.
    """

    def __init__(
        self,
        comm: Communicator,
        runfile: RunFile | None,
        placement: Placement,
        series: tuple[str, ...] = (),
        events: list[tuple[str, float, float, int]] | None = None,
    ) -> None:
        self.comm = comm
        self.runfile = runfile  # only rank 0 has one
        self._rows: list[dict[str, Any]] = []
        self._tables: dict[str, dict[str, list[Any]]] = {}  # rank 0's rows of declared row groups
        self._times: list[tuple[float, ...]] = []
        # a row's lr is a data-parallel member's; its step time and bytes the slowest and busiest rank's
        self._member = next(r for r, p in enumerate(placement.ranks) if p.member >= 0)
        self._global_batch = placement.step_samples
        self._series = series  # the strategy's own per-rank series (Strategy.rank_series)
        self._events = events if events is not None else []  # this rank's timeline, drained at writes
        #: root attributes written with the rows (rank 0): the run's figures so far
        self.figures: dict[str, float] = {}

    def record(
        self,
        row: dict[str, Any],
        compute_s: float,
        comm_s: float,
        exposed_s: float,
        other_s: float,
        series: dict[str, float] | None = None,
        tables: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        """Add this step's row (kept on rank 0) and this rank's timings, until the driver's flush.

        ``exposed_s`` is the part of ``comm_s`` the step spent waiting after backward;
        ``other_s`` the time since the previous step ended, outside any step. At the flush,
        rank 0's row takes its ``lr`` from the first data-parallel member, its
        ``step_time`` (and ``samples_per_s``) from the slowest rank and its ``bytes_sent``
        from the rank that sent most (each rank's own are in its ``row``): rank 0 may read
        no batches at all. ``series``: this rank's values of the strategy's own per-rank
        series for the step (a pipeline stage's bubble), into ``ranks/`` beside the times.
        ``tables``: rows of the strategy's declared row groups (rank 0's), as columns.
        """
        if self.runfile is not None:
            self.runfile.check_row(row)  # an undeclared key fails at its step, not at the flush
            self._rows.append(row)
            for name, columns in (tables or {}).items():
                kept = self._tables.setdefault(name, {})
                for column, values in columns.items():
                    kept.setdefault(column, []).extend(np.asarray(values).ravel().tolist())
        own = (row["step_time"], float(row["bytes_sent"]), row["lr"])
        extra = tuple((series or {}).get(name, math.nan) for name in self._series)
        self._times.append((compute_s, comm_s, exposed_s, other_s, *own, *extra))
        if self.runfile is not None:
            self.runfile.beat()  # the heartbeat, at least every HEARTBEAT_S between flushes

    def flush(self) -> None:
        """Gather and write what is buffered (collective)."""
        mine = np.array(self._times, dtype=np.float64).reshape(-1, 7 + len(self._series))
        every, events = self._gather(mine)
        self._times = []
        if self.runfile is None:
            return
        self._write_events(events)
        times = np.stack(every, axis=1)  # steps, ranks, 7 + series
        compute, comm_t, exposed, other = (times[..., i] for i in range(4))
        wait = comm_t - comm_t.min(axis=1, keepdims=True)
        self._agreed_columns(times)
        self._write_figures()  # flushed with the rows
        self.runfile.append_rows(
            self._rows,
            {"compute_time": compute, "comm_time": comm_t, "wait_time": wait, "exposed_comm_time": exposed,
             "other_time": other, **{name: times[..., 7 + i] for i, name in enumerate(self._series)}},
            {name: {c: np.asarray(v) for c, v in columns.items()} for name, columns in self._tables.items()},
        )  # fmt: skip
        self._rows, self._tables = [], {}

    def write_rows(self, rows: list[dict[str, Any]], tables: dict[str, dict[str, Any]]) -> None:
        """Rank 0, during a free-running phase: append metrics rows and row groups, then flush.

        No collective: the ranks' times of the phase come with :meth:`record_phase`.
        """
        if self.runfile is not None and rows:
            self._write_figures()
            self.runfile.append_rows(rows, {}, tables)

    def record_phase(
        self,
        rows: list[dict[str, Any]],
        step: int,
        compute_s: float,
        comm_s: float,
        other_s: float,
        series: dict[str, float],
        tables: dict[str, dict[str, Any]],
    ) -> None:
        """A free-running strategy's meeting: rank 0's rows and row groups, each rank's phase (collective).

        Each rank's compute, communication and other time over the phase (and the
        strategy's own series) make one row of ``ranks/``, with ``ranks/step`` the step
        the phase ended at; the rows and ``tables`` (rank 0's) are written and flushed
        at once: one gather per meeting, however many steps the phase did.
        """
        mine = np.array([compute_s, comm_s, other_s, *(series.get(s, math.nan) for s in self._series)])
        every, events = self._gather(mine)
        if self.runfile is None:
            return
        self._write_events(events)
        times = np.stack(every)[None]  # 1 row, ranks, 3 + series
        compute, comm_t, other = times[..., 0], times[..., 1], times[..., 2]
        blocks = {"compute_time": compute, "comm_time": comm_t, "wait_time": comm_t - comm_t.min(),
                  "exposed_comm_time": np.full_like(compute, np.nan), "other_time": other}  # fmt: skip
        blocks.update({name: times[..., 3 + i] for i, name in enumerate(self._series)})
        self._write_figures()
        self.runfile.append_rows(rows, blocks, tables, rank_steps=[step])

    def _write_figures(self) -> None:
        if self.runfile is not None and self.figures:
            self.runfile.set_attrs(**self.figures)

    def _gather(self, mine: np.ndarray) -> tuple[list[np.ndarray], list[list[tuple[Any, ...]]]]:
        """Every rank's timings and timeline events on rank 0 (one gather; events only when traced)."""
        events, self._events[:] = list(self._events), []
        gathered = self.comm.gather((mine, events), root=0)
        if gathered is None:
            return [], []
        return [t for t, _ in gathered], [e for _, e in gathered]

    def _write_events(self, events: list[list[tuple[Any, ...]]]) -> None:
        rows = [(rank, *event) for rank, own in enumerate(events) for event in own]
        if self.runfile is None or not rows:
            return
        rank, kind, start, end, micro = zip(*rows)
        self.runfile.append_trace(
            {"rank": rank, "kind": kind, "start": start, "end": end, "microbatch": micro}
        )

    def _agreed_columns(self, times: np.ndarray) -> None:
        """Rank 0's rows take lr, step time, throughput and bytes from the ranks that set them."""
        for row, wall, sent, lr in zip(
            self._rows, times[..., 4].max(axis=1), times[..., 5].max(axis=1), times[:, self._member, 6]
        ):
            row["lr"], row["step_time"], row["bytes_sent"] = float(lr), float(wall), int(sent)
            row["samples_per_s"] = self._global_batch / wall if wall > 0 else math.nan

    def close(self, status: str, **attrs: Any) -> None:
        """Flush (collective), then set the final attributes and close the file (rank 0)."""
        self.flush()
        if self.runfile is not None:
            self.runfile.set_attrs(status=status, **attrs)
            self.runfile.close()
            self.runfile = None

    def abandon(self, status: str, error: str = "") -> None:
        """After a failure on this rank: mark the file and close it, without collectives.

        Rows still buffered are dropped (their per-rank timings cannot be gathered);
        what was flushed stays. After a failed write (a full disk) nothing more is
        written: the status stays ``running`` and the heartbeat tells it is over.

        Args:
            status: ``failed``, ``stalled``, ``interrupted``.
            error: why (the error's message, the stall report), kept as attribute ``error``.
        """
        if self.runfile is not None:
            if self.runfile.failed is None:
                try:
                    extra = {"error": error} if error else {}
                    self.runfile.set_attrs(status=status, end_time=heartbeat_now(), **extra)
                    self.runfile.flush()
                except HpcdlError:
                    pass
            self.runfile.close()
            self.runfile = None


def refuse_directory(out: str, name: str) -> None:
    """Refuse ``--out`` naming a directory (an existing one, or a path ending in a separator).

    Raises:
        RunFileError: one line saying what to give instead.
    """
    if out.endswith(("/", os.sep)) or Path(out).is_dir():
        raise RunFileError(
            f"--out {out} is a directory: --out names the run file, its checkpoints go beside it; "
            f"give a file in it, e.g. --out {Path(out) / (name + '.h5')}"
        )


@dataclass
class Opened:
    """What :func:`open_run` found: the run file (rank 0) and the checkpoint to continue from.

    Attributes:
        runfile: the run file, on rank 0 (None elsewhere, or without ``--out``).
        checkpoint: the checkpoint to continue from, on rank 0 only (the other ranks get
            their part from :func:`hpcdl.driver.checkpoints.distribute`).
        step: the checkpoint's step, on every rank (None: a fresh start).
    """

    runfile: RunFile | None = None
    checkpoint: Checkpoint | None = None
    step: int | None = None


def _declared_rows(cfg: Config) -> tuple[dict[str, Any], dict[str, TableSpec]]:
    """The metric columns and row groups the run's components declare (:mod:`hpcdl.components`)."""
    mine = declared(cfg["parallel.strategy"])
    return dict(mine.metrics), {name: (dict(t.columns), t.cut_by) for name, t in mine.tables.items()}


def open_run(
    comm: Communicator,
    cfg: Config,
    placement: Placement,
    run_path: Path | None,
    resume: str | None,
    strategy: Strategy | None = None,
    take_over: bool = False,
) -> Opened:
    """Rank 0 finds the checkpoint and opens the run file; every rank learns whether to resume.

    A failure on rank 0 (a checkpoint that does not fit, a run file that exists, a run that
    another job still writes) is raised on every rank, so that none waits. Only the
    checkpoint's step travels: each rank's part of it is sent by
    :func:`~hpcdl.driver.checkpoints.distribute`. ``take_over``: continue a run whose
    writer looks alive (``--take-over``: the user knows it is dead).
    """
    opened = Opened()

    def decide() -> int | None:
        opened.checkpoint, opened.runfile = _open_on_root(
            comm, cfg, placement, run_path, resume, strategy, take_over
        )
        ckpt = opened.checkpoint
        if ckpt is None:
            return None
        print(f"hpcdl.train: resuming from {ckpt.path} (step {ckpt.step})", file=sys.stderr, flush=True)
        return ckpt.step

    opened.step = on_root(comm, decide)
    return opened


def _open_on_root(
    comm: Communicator,
    cfg: Config,
    placement: Placement,
    run_path: Path | None,
    resume: str | None,
    strategy: Strategy | None,
    take_over: bool = False,
) -> tuple[Checkpoint | None, RunFile | None]:
    """What :func:`open_run` does on rank 0: check everything first, then change files.

    * No ``--resume``: a new run; refused if the run file or checkpoints of its name exist
      (a fresh start never deletes another run's checkpoints).
    * ``--resume auto``: a fresh start only when there is no run yet. An existing run file
      must fit (rank count, the keys that fix the trajectory); its newest checkpoint that
      loads and fits is taken; checkpoints that exist but none fit is an error. Settings
      the resume changes (more steps, say) are recorded in the run file.
    * ``--resume CKPT``: that checkpoint must load and fit.

    A resume of a run file whose status is ``running`` and whose writer is alive (another
    job: :func:`_check_writer`) is refused before any checkpoint is read or anything changed, unless
    ``take_over``. Partial checkpoint files a killed run left (``*.tmp``) are removed once
    the run file is open.
    """
    ranks = comm.Get_size()
    if resume == "auto" and run_path is None:
        raise ConfigError("--resume auto needs --out RUN.h5: the run whose checkpoints to continue")
    if run_path is None:
        return (find_resume(resume, Path(resume), cfg, placement, strategy) if resume else None), None
    refuse_directory(str(run_path), cfg["name"])
    changes: dict[str, tuple[Any, Any]] = {}
    attrs: dict[str, Any] = {}
    exists = run_path.exists()
    if resume is None:
        if exists:
            raise RunFileError(
                f"{run_path} already exists: continue it with --resume auto, or choose another --out"
            )
        left = list_checkpoints(run_path)
        if left:
            raise RunFileError(
                f"{left[0]} of an earlier run lies beside {run_path}: continue that run with --resume auto, "
                "or choose another --out"
            )
    elif exists:
        attrs = {**read_attrs(run_path, fix=_damaged_fix(run_path)), "path": str(run_path)}
        _check_writer(attrs, run_path, take_over)
        changes = check_run_config(attrs, cfg, ranks)
    ckpt = find_resume(resume, run_path, cfg, placement, strategy) if resume is not None else None
    if ckpt is None and exists and attrs.get("status") in ("finished", "stopped"):
        raise RunFileError(
            f"{run_path} is a {attrs['status']} run with no checkpoint to continue from (deleted?): "
            "nothing was changed; start a new run with another --out"
        )
    if resume is not None and exists:  # continue it; no checkpoint yet (killed before one): from step 0
        runfile = RunFile.resume(run_path, ckpt.step if ckpt else 0, ranks, *_declared_rows(cfg))
        if int(attrs.get("format_version", FORMAT_VERSION)) < FORMAT_VERSION or _predates(attrs):
            runfile.set_attrs(config=cfg.toml())  # today's names; legacy values recorded
        if changes:
            step = ckpt.step if ckpt else 0
            runfile.record_config_change(step, changes, cfg.toml())
            shown = ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changes.items())
            print(f"hpcdl.train: {run_path} continues with changed settings: {shown}", file=sys.stderr)
    else:
        attrs = {**_run_attrs(cfg, comm, placement), **(strategy.run_attrs() if strategy is not None else {})}
        runfile = RunFile.create(run_path, attrs, ranks, *_declared_rows(cfg))
    _remove_orphans(run_path)
    return ckpt, runfile


def _predates(attrs: dict[str, Any]) -> bool:
    """True when the run file's config lacks keys that declare a legacy value (it predates them)."""
    try:
        return bool(legacy_values(stored_values(str(attrs.get("config", "")))))
    except ConfigError:
        return False


def _check_writer(attrs: dict[str, Any], run_path: Path, take_over: bool) -> None:
    """Refuse to continue a run file that another job is writing (changing nothing).

    Its writer is alive (:func:`hpcdl.store.liveness.writer`) when the status is
    ``running`` and, on this host, its process (the recorded pid and start) still runs;
    from another host, when its heartbeat is fresh (younger than
    :func:`~hpcdl.store.liveness.stale_after`). HDF5's file lock would refuse such a
    resume too, but not where locking is off (``HDF5_USE_FILE_LOCKING=FALSE``, as on
    Lustre and NFS). A writer that is this very process is an earlier run in it (called
    in-process, as from a notebook), which has ended. ``take_over``: the user knows the
    writer is dead; said on stderr.

    Raises:
        RunFileError: the writer is alive: its host, pid and the heartbeat's age, and how
            to override.
    """
    found = writer(attrs, run_path)
    if found is None or not found.alive:
        return
    if found.local and found.pid == os.getpid():  # this process: an earlier run in it (a notebook), ended
        return
    when = "heartbeat" if "heartbeat" in attrs else "last written"
    who = f"host {found.host or '?'}, pid {found.pid or '?'}, {when} {ago(found.age_s or 0.0)} ago"
    if take_over:
        print(f"hpcdl.train: taking over {run_path} from its writer ({who}): --take-over", file=sys.stderr)
        return
    if found.process is None:  # told by the heartbeat alone
        bound = ago(found.stale_after_s)
        who += f"; from another host a writer counts as alive until its {when} is {bound} old"
    raise RunFileError(
        f"{run_path} is being written by another job ({who}): nothing was changed; let that job end or "
        "stop it, or, if you know it is dead, add --take-over"
    )


def _damaged_fix(run_path: Path) -> str:
    """What to do about a run file that cannot be read (damaged), given its checkpoints."""
    newest = list_checkpoints(run_path)
    if newest:
        return (
            "nothing was changed: move it aside and run again; --resume auto then continues from its "
            f"newest checkpoint that loads ({newest[0].name} is the newest) in a new run file"
        )
    return "nothing was changed: move it aside to start the run anew, or choose another --out"


def _remove_orphans(run_path: Path) -> None:
    """Remove the partial checkpoint files (``*.tmp``) a killed run of ``run_path`` left, and say so."""
    orphans = orphaned_temporaries(run_path)
    for tmp in orphans:
        tmp.unlink(missing_ok=True)
    if orphans:
        names = ", ".join(p.name for p in orphans)
        print(
            f"hpcdl.train: removed {len(orphans)} partial checkpoint file{'s' * (len(orphans) > 1)} "
            f"a killed run left: {names}",
            file=sys.stderr,
            flush=True,
        )


def _run_attrs(cfg: Config, comm: Communicator, placement: Placement) -> dict[str, Any]:
    """The root attributes of a new run file."""
    sim = getattr(comm, "sim_attrs", None)  # a simulated world says what it simulates
    if sim is not None:
        library = ""
    else:
        from hpcdl.comm.mpi import library_version

        library = library_version().splitlines()[0].strip()
    attrs = {
        "name": cfg["name"],
        "config": cfg.toml(),
        "hpcdl_version": __version__,
        "git_commit": _git_commit(),
        "mpi_library": library,
        "ranks": comm.Get_size(),
        "world": "mpi",
        "network": "",
        "compute": "real",
        "start_time": heartbeat_now(),
        "argv": " ".join(sys.argv),
        "strategy": placement.strategy,
        "placement": placement.to_json(),
    }
    if sim is not None:
        attrs.update(sim())
    return attrs


def checkpoint_attrs(run_path: Path | None) -> dict[str, Any]:
    from hpcdl.comm import world

    if getattr(world(), "sim_attrs", None) is not None:
        library = "hpcdl.sim (virtual ranks)"
    else:
        from hpcdl.comm.mpi import library_version

        library = library_version().splitlines()[0].strip()
    return {
        "hpcdl_version": __version__,
        "mpi_library": library,
        "run_file": run_path.name if run_path is not None else "",
    }


def peak_rss_mb() -> float:
    """This process's peak resident set so far, in MiB (``getrusage``; 0 where unavailable)."""
    try:
        import resource
    except ImportError:  # pragma: no cover  (not on Windows)
        return 0.0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes on macOS, KiB on Linux


def _git_commit() -> str:
    """The commit of the hpcdl checkout in use, or "" (installed package, no git)."""
    root = Path(__file__).resolve().parent.parent
    if not (root / ".git").exists():
        return ""
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
    except OSError:
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""
