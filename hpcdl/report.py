"""Summarize and plot run files: ``python -m hpcdl.report RUN.h5 [RUN2.h5 ...] [--out DIR]``."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from hpcdl.cli import ArgumentParser, parse_args
from hpcdl.store.runfile import FORMAT_VERSION, RANK_SERIES, RunFileError

__all__ = ["Run", "load", "summarize", "format_table", "labels", "plot", "main"]

#: table columns: (key, header, format of a present value)
COLUMNS = (
    ("run", "run", "{}"),
    ("name", "config", "{}"),
    ("world", "world", "{}"),
    ("ranks", "ranks", "{}"),
    ("steps", "steps", "{}"),
    ("test_accuracy", "test acc %", "{:.2f}"),
    ("wall_s", "wall s", "{:.1f}"),
    ("samples_per_s", "samples/s", "{:.0f}"),
    ("status", "status", "{}"),
)
_TEXT = {"run", "name", "world", "status"}


@dataclass
class Run:
    """A run file read into memory: root attributes, ``metrics/`` and ``ranks/`` series."""

    path: Path
    attrs: dict[str, Any]
    metrics: dict[str, np.ndarray]
    ranks: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return len(self.metrics.get("step", ()))


def load(path: str | Path) -> Run:
    """Read a run file with plain h5py.

    Series of unequal length (a crash between two appends) are cut to the shortest.

    Raises:
        RunFileError: the file is missing, is not HDF5, or is not an hpcdl run file.
    """
    path = Path(path)
    if not path.is_file():
        raise RunFileError(f"{path}: no such run file")
    if not h5py.is_hdf5(path):
        raise RunFileError(f"{path} is not an HDF5 file (expected an hpcdl run file)")
    try:
        h5 = h5py.File(path, "r")
    except OSError as err:
        raise RunFileError(f"cannot open run file {path}: {err}") from None
    with h5:
        version = h5.attrs.get("format_version")
        if version is None or "metrics" not in h5:
            raise RunFileError(f"{path} is not an hpcdl run file (no format_version attribute or metrics/)")
        if int(version) > FORMAT_VERSION:
            raise RunFileError(
                f"{path} has run file format {int(version)}; this hpcdl reads up to {FORMAT_VERSION}"
            )
        attrs = {key: _plain(value) for key, value in h5.attrs.items()}
        metrics = {k: d[...] for k, d in h5["metrics"].items() if isinstance(d, h5py.Dataset)}
        ranks = {k: h5["ranks"][k][...] for k in RANK_SERIES if "ranks" in h5 and k in h5["ranks"]}
    n = min((len(v) for v in metrics.values()), default=0)
    metrics = {k: v[:n] for k, v in metrics.items()}
    m = min((len(v) for v in ranks.values()), default=0)
    ranks = {k: v[:m] for k, v in ranks.items()}
    return Run(path, attrs, metrics, ranks)


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


def summarize(path: str | Path | Run) -> dict[str, Any]:
    """The table row of one run as data (``None`` where a value is unknown).

    Returns:
        ``run`` (file stem), ``name``, ``world``, ``ranks``, ``steps`` (last step, 0 when
        empty), ``test_accuracy`` (last evaluated, in %), ``wall_s``, ``samples_per_s``
        and ``status``.

    Raises:
        RunFileError: as :func:`load`.
    """
    run = path if isinstance(path, Run) else load(path)
    a, m = run.attrs, run.metrics
    acc = _last_finite(m.get("test_accuracy"))
    wall = a.get("wall_s", _last_finite(m.get("time")))
    sps = a.get("samples_per_s")
    if sps is None and "samples_per_s" in m:
        finite = m["samples_per_s"][np.isfinite(m["samples_per_s"])]
        sps = float(np.median(finite)) if finite.size else None
    ranks = a.get("ranks")
    if ranks is None and run.ranks:
        ranks = next(iter(run.ranks.values())).shape[1]
    return {
        "run": run.path.stem,
        "name": a.get("name"),
        "world": a.get("world"),
        "ranks": None if ranks is None else int(ranks),
        "steps": int(m["step"][-1]) if run.rows else 0,
        "test_accuracy": None if acc is None else 100.0 * acc,
        "wall_s": None if wall is None else float(wall),
        "samples_per_s": None if sps is None else float(sps),
        "status": a.get("status"),
    }


def format_table(rows: list[dict[str, Any]]) -> str:
    """Fixed-width table of :func:`summarize` rows: text left-aligned, numbers right."""
    cells = [[h for _, h, _ in COLUMNS]]
    for row in rows:
        cells.append(["-" if row.get(k) is None else fmt.format(row[k]) for k, _, fmt in COLUMNS])
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]

    def line(values: list[str]) -> str:
        parts = [
            v.ljust(w) if key in _TEXT else v.rjust(w) for v, w, (key, _, _) in zip(values, widths, COLUMNS)
        ]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule, *(line(c) for c in cells[1:])])


def labels(runs: list[Run]) -> list[str]:
    """Unique run labels: file stems, else ``name (N ranks)``, else stems numbered."""
    stems = [r.path.stem for r in runs]
    if len(set(stems)) == len(stems):
        return stems
    named = [f"{r.attrs.get('name', r.path.stem)} ({r.attrs.get('ranks', '?')} ranks)" for r in runs]
    if len(set(named)) == len(named):
        return named
    return [f"{stem} #{i + 1}" for i, stem in enumerate(stems)]


def plot(runs: list[Run], names: list[str], out: Path) -> list[Path]:
    """Write ``loss.png``, ``accuracy.png`` and ``ranks.png`` into ``out``; empty runs are skipped.

    A figure with nothing to show (no rows, no evaluated step, no per-rank times) is not
    written. Returns the paths written.

    Raises:
        ImportError: matplotlib is not installed.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    pairs = [(r, n) for r, n in zip(runs, names) if r.rows]

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=120)
        plt.close(fig)
        written.append(out / name)

    if pairs:
        fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
        for run, name in pairs:
            m = run.metrics
            by_step.plot(m["step"], m["loss"], label=name)
            by_time.plot(m["time"], m["loss"], label=name)
        _axes(by_step, by_time, "loss")
        save(fig, "loss.png")

    evaluated = [(r, n) for r, n in pairs if _last_finite(r.metrics.get("test_accuracy")) is not None]
    if evaluated:
        fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
        for run, name in evaluated:
            m = run.metrics
            for ax, x in ((by_step, m["step"]), (by_time, m["time"])):
                ok = np.isfinite(m["test_accuracy"])
                (line,) = ax.plot(x[ok], 100 * m["test_accuracy"][ok], "o-", ms=3, label=f"{name} test")
                train = m.get("train_accuracy")
                if train is not None and np.isfinite(train).any():
                    ok = np.isfinite(train)
                    ax.plot(x[ok], 100 * train[ok], "--", color=line.get_color(), label=f"{name} train")
        _axes(by_step, by_time, "accuracy (%)")
        save(fig, "accuracy.png")

    with_ranks = [(r, n) for r, n in pairs if r.ranks and len(next(iter(r.ranks.values())))]
    if with_ranks:
        fig, axes = plt.subplots(
            1, len(with_ranks), figsize=(4 + 3 * len(with_ranks), 4), squeeze=False, sharey=True
        )
        for ax, (run, name) in zip(axes[0], with_ranks):
            # comm_time includes wait_time (the part spent waiting for slower ranks): stack
            # compute, the rest of the communication, and the wait, so the bar is the step
            stacked = ("compute_time", "comm_time", "wait_time")  # exposed_comm_time is inside comm_time
            parts = {k: 1e3 * _column_means(run.ranks[k]) for k in stacked if k in run.ranks}
            if "comm_time" in parts and "wait_time" in parts:
                parts["comm_time"] = parts["comm_time"] - parts["wait_time"]
            labels = {"compute_time": "compute", "comm_time": "communication", "wait_time": "waiting"}
            bottom = None
            for series, ms in parts.items():
                x = np.arange(len(ms))
                ax.bar(x, ms, bottom=bottom, label=labels.get(series, series))
                bottom = ms if bottom is None else bottom + ms
            ax.set_title(name)
            ax.set_xlabel("rank")
            ax.set_xticks(np.arange(len(bottom)) if bottom is not None else [])
        axes[0][0].set_ylabel("mean time per step (ms)")
        axes[0][0].margins(y=0.15)  # room for the legend above the bars
        axes[0][0].legend(loc="upper left", ncol=3, fontsize="small")
        save(fig, "ranks.png")
    return written


def _axes(by_step: Any, by_time: Any, ylabel: str) -> None:
    by_step.set_xlabel("step")
    by_time.set_xlabel("time (s)")
    by_step.set_ylabel(ylabel)
    for ax in (by_step, by_time):
        ax.grid(alpha=0.3)
    by_step.legend(fontsize="small")


def _column_means(a: np.ndarray) -> np.ndarray:
    """Mean of each column over its finite values (0 where a column has none)."""
    ok = np.isfinite(a)
    counts = ok.sum(axis=0)
    return np.where(ok, a, 0.0).sum(axis=0) / np.maximum(counts, 1)


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="python -m hpcdl.report", description=__doc__)
    parser.add_argument("runs", nargs="+", type=Path, metavar="RUN.h5", help="run files to compare")
    parser.add_argument(
        "--out", type=Path, default=None, help="directory for the plots (default: the first run's)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Print the summary table of the run files and write the plots.

    Raises:
        ConfigError: a usage error.
        RunFileError: a file is missing or is not an hpcdl run file.
    """
    args = parse_args(build_parser(), sys.argv[1:] if argv is None else list(argv))
    runs = [load(path) for path in args.runs]
    names = labels(runs)
    rows = [summarize(run) | {"run": name} for run, name in zip(runs, names)]
    print(format_table(rows))
    try:
        import matplotlib  # noqa: F401  (only to learn whether plots can be drawn)
    except ImportError:
        print("plots need matplotlib: pip install hpcdl[plot]")
        return 0
    for path in plot(runs, names, args.out or args.runs[0].parent):
        print(path)
    return 0


if __name__ == "__main__":
    from hpcdl.cli import entry

    entry(main, "hpcdl.report")
