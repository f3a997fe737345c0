"""``python -m hpcdl.report RUN.h5 [RUN2.h5 ...] [--out DIR_OR_PREFIX]``: summarize and plot run files.

One table row per run (its status told from the writer's heartbeat when the file says
``running``: :mod:`hpcdl.store.liveness`), the pipeline runs' stages under it
(:mod:`hpcdl.report.stages`), and PNGs named after the runs (:mod:`hpcdl.report.plots`,
each rank's times: :mod:`hpcdl.report.ranks`, the timeline's Gantt chart:
:mod:`hpcdl.report.gantt`).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from hpcdl.driver.cli import ArgumentParser, nonnegative_int, parse_args
from hpcdl.driver.figures import RATE_UNIT, rate_text, samples_per_s, wall_text
from hpcdl.errors import file_error
from hpcdl.report.gantt import STEPS as GANTT_STEPS
from hpcdl.report.plots import output_prefix, plot
from hpcdl.report.stages import format_stages, stage_stats
from hpcdl.report.strategy import run_config, samples_per_step, samples_processed, workers
from hpcdl.report.trace import write_chrome_trace
from hpcdl.store.checkpoint import checkpoint_run_file
from hpcdl.store.liveness import run_status
from hpcdl.store.runfile import FORMAT_VERSION, RunFileError, read_only, unreadable

__all__ = [
    "Run",
    "load",
    "samples_per_step",
    "samples_processed",
    "summarize",
    "format_table",
    "format_stages",
    "stage_stats",
    "labels",
    "plot",
    "output_prefix",
    "run_files",
    "main",
]

#: table columns: (key, header, format of a present value: a format string or a function)
COLUMNS: tuple[tuple[str, str, Any], ...] = (
    ("run", "run", "{}"),
    ("name", "config", "{}"),
    ("world", "world", "{}"),
    ("ranks", "ranks", "{}"),
    ("steps", "steps", "{}"),
    ("test_accuracy", "test acc %", "{:.2f}"),
    ("wall_s", "wall s", wall_text),  # the summary line's figures, printed alike (hpcdl.driver.figures)
    ("samples_per_s", RATE_UNIT, rate_text),
    ("status", "status", "{}"),
)
#: columns shown (before status) only when some run recorded staleness (parameter servers)
STALENESS_COLUMNS = (
    ("tau_median", "τ median", "{:g}"),
    ("tau_max", "τ max", "{}"),
)
_TEXT = {"run", "name", "world", "status"}
#: marks an accuracy that is not the run's result (the run has not finished)
NOT_FINAL = "*"
#: checkpoint files skipped are named up to this many
_NAMED = 3

DESCRIPTION = (
    "Print a table of run files and plot their loss, accuracy, per-rank times, staleness, pipeline "
    "stages and timeline as PNGs."
)
_EPILOG = """\
Checkpoint files among RUN.h5 (RUN.ckpt-00000600.h5, which a glob such as
runs/demo-*.h5 also matches) are skipped with one line on stderr.

The table has one row per run: config, world (mpi or sim), ranks, steps, test accuracy,
wall time, samples/s and status (wall time and samples/s are the training command's
summary line's: the run file's wall_s and samples_per_s, as of its last write while
it runs); when some run has parameter-server staleness rows,
also the median and largest tau of its applied pushes (- for the others). A run whose
file says running but whose process is gone (killed, a dead rank) shows as
interrupted; when that cannot be told (another host), as running with the time since
the file was last written. The accuracy of a run that has not finished is its last
evaluation, marked with *.

Plots, named PREFIX-FIGURE.png, where PREFIX is the run file's name (the names joined
by + for several runs), all runs on one figure:
  loss, accuracy  against step, samples processed and time: runs of different
                  strategies compare at equal samples and time, not at equal
                  steps (a ps step is one push). Samples: metrics/samples, or
                  for older files step x the placement's samples per step
  ranks           per rank, the mean time per step computing, communicating,
                  waiting and outside the step; below it, the spread per step.
                  When ranks/ rows are meetings (ranks/step: ps), per push a
                  worker made or a server served, and below, per meeting
                  against the pushes applied, pushes per second and busy
                  fraction
  staleness       each ps run's tau histogram: the fraction of its applied
                  pushes at each tau (log axis), labelled with its mode
                  (a: async, b: ssp s=1), ssp's bound dashed; only when some
                  run has staleness/ rows
  stages          each pipeline stage's bubble (the idle part of a step: the
                  median over the steps, whiskers least to most, against
                  (p-1)/(m+p-1) for equal stages, (p-1)/(vm+p-1) with v
                  interleaved chunks) and its peak activation
                  memory; only when some run has ranks/bubble. The same
                  numbers are printed under the table
  gantt           the timeline (trace/, recorded with log.trace = true) of each
                  run's last --gantt-steps steps: a row per rank, forward and
                  backward bars labelled with their microbatch (F3, B3), sync's
                  pack, wait and unpack; waiting (recv, wait) as thinner bars,
                  sends in a thin lane under the row; dotted lines at rank 0's
                  step ends. The steps are told apart by metrics/time (rank 0's
                  step ends): every event after the end of the step before the
                  window is drawn. Only when some run has trace/ events

  python -m hpcdl.report runs/cnn.h5                          # runs/cnn-loss.png, ...
  python -m hpcdl.report runs/a.h5 runs/b.h5 --out plots/     # plots/a+b-loss.png, ...
  python -m hpcdl.report runs/a.h5 runs/b.h5 --out plots/cmp  # plots/cmp-loss.png, ...
  python -m hpcdl.report runs/a.h5 --trace a.json              # the timeline for Perfetto
  python -m hpcdl.report runs/pipe.h5 --gantt-steps 1          # runs/pipe-gantt.png: the last step"""


#: the run file's groups the driver writes; every other group is a row table a strategy declared
_DRIVER_GROUPS = ("metrics", "ranks", "trace", "profile")


@dataclass
class Run:
    """A run file read into memory: root attributes, ``metrics/``, ``ranks/``, row groups and ``trace/``.

    Attributes:
        path: the run file.
        attrs: root attributes (strings decoded).
        metrics: ``metrics/`` series as recorded, one row per step.
        ranks: ``ranks/`` series, each (steps, ranks).
        tables: the row groups a strategy declared (``staleness/`` of a parameter server: one
            row per applied push and server), name -> column -> array.
        trace: ``trace/`` columns (``rank``, ``kind`` as str, ``start``, ``end``,
            ``microbatch``), one row per timeline event; empty when the run has none.
        samples: training samples processed up to each metrics row (see
            :func:`samples_processed`); None when the file cannot tell.
    """

    path: Path
    attrs: dict[str, Any]
    metrics: dict[str, np.ndarray]
    ranks: dict[str, np.ndarray] = field(default_factory=dict)
    tables: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    samples: np.ndarray | None = None
    trace: dict[str, np.ndarray] = field(default_factory=dict)
    #: series read only in part: a writer killed while it flushed left chunks past the file's end
    cut: tuple[str, ...] = ()

    @property
    def rows(self) -> int:
        return len(self.metrics.get("step", ()))

    @property
    def staleness(self) -> dict[str, np.ndarray]:
        """The ``staleness/`` columns (a parameter server's); empty when the run has none."""
        return self.tables.get("staleness", {})

    @property
    def config(self) -> dict[str, Any]:
        """The run's config values by dotted key (:func:`~hpcdl.report.strategy.run_config`)."""
        return run_config(self.attrs)

    @property
    def workers(self) -> int | None:
        """Ranks whose role is ``worker`` (None: unknown)."""
        return workers(self.attrs)


def load(path: str | Path) -> Run:
    """Read a run file with plain h5py (every series of ``metrics/``, ``ranks/``, the row groups, ``trace/``).

    Series of one group of unequal length (a crash between two appends) are cut to the
    shortest. A series whose last chunks lie past the file's end (its writer was killed
    while it flushed) is read up to them, and named in ``Run.cut``. ``Run.samples`` is the
    recorded ``metrics/samples`` or, for older files, computed from the steps and the
    placement (:func:`samples_processed`).

    Raises:
        RunFileError: the file is missing, is not HDF5, or is not an hpcdl run file, or it is
            damaged beyond its series' chunks (metadata past its end).
        FileError: the file cannot be read (permissions, ...).
    """
    path = Path(path)
    try:
        path.stat()
    except FileNotFoundError:
        raise RunFileError(f"{path}: no such run file") from None
    except OSError as err:
        raise file_error(path, err, what="run file", verb="read") from None
    if not path.is_file():
        raise RunFileError(f"{path} is not a file (expected an hpcdl run file)")
    try:
        is_hdf5 = h5py.is_hdf5(path)
        h5 = read_only(path) if is_hdf5 else None  # also while its run writes it
    except OSError as err:
        raise unreadable(path, err, verb="read") from None
    if h5 is None:
        raise RunFileError(f"{path} is not an HDF5 file (expected an hpcdl run file)")
    try:
        with h5:
            return _read_run(path, h5)
    except OSError as err:  # metadata past the file's end: nothing to salvage
        raise unreadable(path, err, verb="read") from None
    except RuntimeError as err:  # h5py's type when it looks a link up there
        if "addr overflow" not in str(err):
            raise
        raise unreadable(path, OSError(str(err)), verb="read") from None


def _read_run(path: Path, h5: h5py.File) -> Run:
    """:func:`load` of an open file."""
    cut: list[str] = []  # the series read in part
    version = h5.attrs.get("format_version")
    if "metrics" not in h5 and "run_file" in h5.attrs:  # a checkpoint's root attributes
        owner = path.with_name(str(_plain(h5.attrs["run_file"])))
        raise RunFileError(f"{path} is a checkpoint, not a run file: report its run file {owner}")
    if version is None or "metrics" not in h5:
        raise RunFileError(f"{path} is not an hpcdl run file (no format_version attribute or metrics/)")
    if int(version) > FORMAT_VERSION:
        raise RunFileError(
            f"{path} has run file format {int(version)}; this hpcdl reads up to {FORMAT_VERSION}"
        )
    attrs = {key: _plain(value) for key, value in h5.attrs.items()}
    metrics = _series(h5["metrics"], cut)
    ranks = _series(h5.get("ranks"), cut)
    tables = {name: _cut(_series(group, cut)) for name, group in h5.items()
              if isinstance(group, h5py.Group) and name not in _DRIVER_GROUPS}  # fmt: skip
    trace = _series(h5.get("trace"), cut)
    metrics = _cut(metrics)
    trace = _cut(trace)
    if "kind" in trace:
        trace["kind"] = np.array([k.decode() if isinstance(k, bytes) else str(k) for k in trace["kind"]])
    samples = samples_processed(metrics, attrs)
    return Run(path, attrs, metrics, _cut(ranks), tables, samples, trace, tuple(cut))


def _series(group: h5py.Group | None, cut: list[str]) -> dict[str, np.ndarray]:
    """Every dataset of ``group`` (none when the file has no such group); see :func:`_rows`."""
    if not isinstance(group, h5py.Group):
        return {}
    return {k: _rows(d, cut) for k, d in group.items() if isinstance(d, h5py.Dataset)}


def _rows(d: h5py.Dataset, cut: list[str]) -> np.ndarray:
    """All of ``d``; or, when some of its chunks lie past the file's end (a writer killed while
    it flushed: h5py's "addr overflow"), its rows up to the first such chunk, and its name in ``cut``.

    Raises:
        OSError: ``d`` is not chunked along its rows, so nothing can be read in part.
    """
    try:
        return d[...]
    except OSError as err:
        if d.chunks is None or d.ndim == 0 or "addr overflow" not in str(err):
            raise
    step = d.chunks[0]
    parts = []
    for start in range(0, d.shape[0], step):
        try:
            parts.append(d[start : start + step])
        except OSError as err:
            if "addr overflow" not in str(err):
                raise
            break
    cut.append(d.name.lstrip("/"))
    return np.concatenate(parts) if parts else np.empty((0, *d.shape[1:]), d.dtype)


def _cut(series: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The series cut to the shortest (rows appended by a writer that died half way)."""
    n = min((len(v) for v in series.values()), default=0)
    return {k: v[:n] for k, v in series.items()}


def _plain(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, np.generic):
        return value.item()
    return value


def _last_finite(values: np.ndarray | None) -> float | None:
    if values is None:
        return None
    finite = values[np.isfinite(values)]
    return float(finite[-1]) if finite.size else None


def summarize(path: str | Path | Run, *, now: float | None = None) -> dict[str, Any]:
    """The table row of one run as data (``None`` where a value is unknown).

    Args:
        path: a run file, or one already loaded.
        now: the current time in seconds since the epoch (default: now), for "last
            written N min ago".

    Returns:
        ``run`` (file stem), ``name``, ``world``, ``ranks``, ``steps`` (last step, 0 when
        empty), ``test_accuracy`` (last evaluated, in %), ``accuracy_step`` (the step it
        was evaluated at), ``final`` (True when the run finished, so that accuracy is its
        result), ``wall_s`` and ``samples_per_s`` (the run's figures,
        :mod:`hpcdl.driver.figures`: its attributes; a file without them, from its last
        row: ``time``, and ``samples`` over ``time``), ``state`` (the recorded status, or
        ``interrupted`` when the writer is known to be gone), ``error`` (why it failed or
        stalled, as recorded; None), ``status`` (as shown:
        ``running, last written 12 min ago`` when it cannot be told), ``tau_median`` and
        ``tau_max`` (the staleness of the applied pushes: None without ``staleness/`` rows),
        ``stage_bubble`` (per pipeline stage, the median over the steps of its bubble, a
        fraction of the step) and ``stage_activation_bytes`` (per stage, the most
        activation bytes held in a step): None without ``ranks/bubble``
        (:func:`stage_stats`).

    Raises:
        RunFileError: as :func:`load`.
    """
    run = path if isinstance(path, Run) else load(path)
    a, m = run.attrs, run.metrics
    acc_series = m.get("test_accuracy")
    acc = _last_finite(acc_series)
    acc_step = None
    if acc is not None and acc_series is not None:
        acc_step = int(m["step"][np.flatnonzero(np.isfinite(acc_series))[-1]])
    wall = a.get("wall_s", _last_finite(m.get("time")))
    sps = a.get("samples_per_s")
    if sps is None and run.rows and run.samples is not None and run.samples[-1] > 0 and "time" in m:
        sps = samples_per_s(float(run.samples[-1]), float(m["time"][-1]))  # a file without the figure
    ranks = a.get("ranks")
    if ranks is None and run.ranks:
        ranks = next(iter(run.ranks.values())).shape[1]
    state, status = run_status(a, run.path, now=now)
    tau = run.staleness.get("tau")
    has_tau = tau is not None and len(tau) > 0
    stages = stage_stats(run)
    act = None if stages is None or stages.activation_bytes is None else stages.activation_bytes.tolist()
    return {
        "run": run.path.stem,
        "name": a.get("name"),
        "world": a.get("world"),
        "ranks": None if ranks is None else int(ranks),
        "steps": int(m["step"][-1]) if run.rows else 0,
        "test_accuracy": None if acc is None else 100.0 * acc,
        "accuracy_step": acc_step,
        "final": state == "finished",
        "wall_s": None if wall is None else float(wall),
        "samples_per_s": None if sps is None else float(sps),
        "state": state,
        "status": status,
        "error": str(a["error"]) if a.get("error") else None,
        "tau_median": float(np.median(tau)) if has_tau else None,
        "tau_max": int(np.max(tau)) if has_tau else None,
        "stage_bubble": None if stages is None else stages.bubble.tolist(),
        "stage_activation_bytes": act,
    }


def format_table(rows: list[dict[str, Any]]) -> str:
    """Fixed-width table of :func:`summarize` rows: text left-aligned, numbers right.

    The accuracy of a run that has not finished (running, interrupted, stopped, failed)
    is its last evaluation, not its result: it is marked ``*`` and a note under the
    table says at which step it was evaluated. The staleness columns (τ median, τ max)
    are there only when some run has them, blank (``-``) for the others.
    """
    columns = COLUMNS
    if any(row.get(key) is not None for row in rows for key, _, _ in STALENESS_COLUMNS):
        columns = (*COLUMNS[:-1], *STALENESS_COLUMNS, COLUMNS[-1])
    cells = [[h for _, h, _ in columns]]
    marked = []
    for row in rows:
        line = []
        for key, _, fmt in columns:
            value = row.get(key)
            text = "-" if value is None else fmt(value) if callable(fmt) else fmt.format(value)
            if key == "test_accuracy" and value is not None and not row.get("final", True):
                text += NOT_FINAL
                marked.append(f"{row['run']} at step {row.get('accuracy_step', '?')}")
            line.append(text)
        cells.append(line)
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]

    def line(values: list[str]) -> str:
        parts = [
            v.ljust(w) if key in _TEXT else v.rjust(w) for v, w, (key, _, _) in zip(values, widths, columns)
        ]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    table = [line(cells[0]), rule, *(line(c) for c in cells[1:])]
    if marked:
        table.append(
            f"{NOT_FINAL} not a final result: the last evaluation of a run that has not finished "
            f"({'; '.join(marked)})"
        )
    for row in rows:  # why a run failed or stalled: the first line of what it recorded
        if row.get("error"):
            table.append(f"{row['run']}: {row.get('state')}: {row['error'].splitlines()[0]}")
    return "\n".join(table)


def labels(runs: list[Run]) -> list[str]:
    """Unique run labels: file stems, else ``name (N ranks)``, else stems numbered."""
    stems = [r.path.stem for r in runs]
    if len(set(stems)) == len(stems):
        return stems
    named = [f"{r.attrs.get('name', r.path.stem)} ({r.attrs.get('ranks', '?')} ranks)" for r in runs]
    if len(set(named)) == len(named):
        return named
    return [f"{stem} #{i + 1}" for i, stem in enumerate(stems)]


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m hpcdl.report``."""
    parser = ArgumentParser(prog="python -m hpcdl.report", description=DESCRIPTION, epilog=_EPILOG)
    parser.add_argument("runs", nargs="+", type=Path, metavar="RUN.h5", help="the run files to compare")
    parser.add_argument(
        "--out",
        default=None,
        metavar="DIR/|PREFIX",
        help="where the plots go: a directory (one that exists, or given with a trailing /), or a "
        "path prefix such as plots/cmp (default: beside the first run, named after the runs)",
    )
    parser.add_argument(
        "--trace",
        default=None,
        type=Path,
        metavar="OUT.json",
        help="also write the runs' timelines (trace/) as Chrome trace JSON for Perfetto or "
        "chrome://tracing; not written, with a line saying so, when no run has events (default: none)",
    )
    parser.add_argument(
        "--gantt-steps",
        default=GANTT_STEPS,
        type=nonnegative_int,
        metavar="N",
        help="the Gantt chart (gantt.png, from trace/) draws each run's last N steps; 0 for every step",
    )
    return parser


def run_files(paths: list[Path]) -> list[Path]:
    """The run files among ``paths``: checkpoint files, which a glob such as ``runs/demo-*.h5``
    also matches (``RUN.ckpt-00000600.h5``, a temporary ``RUN.ckpt-00000600.h5.PID.tmp``),
    are left out with one line on stderr.

    Raises:
        RunFileError: every path is a checkpoint file's.
    """
    skipped = {path: owner for path in paths if (owner := checkpoint_run_file(path)) is not None}
    if not skipped:
        return paths
    kept = [path for path in paths if path not in skipped]
    owners = ", ".join(dict.fromkeys(str(owner) for owner in skipped.values() if owner not in kept))
    names = ", ".join(str(path) for path in list(skipped)[:_NAMED])
    names += f" and {len(skipped) - _NAMED} more" if len(skipped) > _NAMED else ""
    if not kept and len(skipped) == 1:
        raise RunFileError(f"{names} is a checkpoint, not a run file: report its run file {owners}")
    if not kept:
        raise RunFileError(f"{names}: checkpoints, not run files: report their run file ({owners})")
    print(
        f"hpcdl.report: skipped {len(skipped)} checkpoint file{'s' * (len(skipped) > 1)} ({names}): "
        f"report their run file{f' ({owners})' if owners else ''}",
        file=sys.stderr,
    )
    return kept


def main(argv: list[str] | None = None) -> int:
    """Print the summary table of the run files and write the plots.

    Raises:
        ConfigError: a usage error.
        RunFileError: a file is missing or is not an hpcdl run file.
        FileError: a run file cannot be read, or a plot cannot be written (a plot of an
            earlier report is left as it was).
    """
    args = parse_args(build_parser(), sys.argv[1:] if argv is None else list(argv))
    paths = run_files(args.runs)
    runs = [load(path) for path in paths]
    for run in runs:
        if run.cut:
            print(
                f"hpcdl.report: {run.path}: read up to the rows its writer flushed before it died "
                f"({', '.join(run.cut)} end past the file's end)",
                file=sys.stderr,
            )
    names = labels(runs)
    rows = [summarize(run) | {"run": name} for run, name in zip(runs, names)]
    print(format_table(rows))
    staged = [(name, st) for run, name in zip(runs, names) if (st := stage_stats(run)) is not None]
    if staged:
        print()
        print(format_stages(staged))
    if args.trace is not None:
        count = write_chrome_trace(paths, args.trace)
        if count:
            print(f"{args.trace}: {count} trace events (open in https://ui.perfetto.dev or chrome://tracing)")
        else:
            print(
                f"{args.trace}: not written: the runs have no trace/ events (recorded with log.trace = true)"
            )
    try:
        import matplotlib  # noqa: F401  (only to learn whether plots can be drawn)
    except ImportError:
        print("plots need matplotlib: pip install hpcdl[plot]")
        return 0
    directory, prefix = output_prefix(args.out, runs)
    for path in plot(runs, names, directory, prefix, gantt_steps=args.gantt_steps):
        print(path)
    return 0
