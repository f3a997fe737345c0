"""The report's figures (loss, accuracy, per-rank times, staleness, stages, timeline), named after the runs.

``loss.png`` and ``accuracy.png`` draw every run against steps, samples processed and
time: runs of different strategies compare at equal samples and equal time, not at
equal steps (a ``ps`` step is one push). A strategy's own figures are those it declares
(:class:`hpcdl.components.Plot`): a parameter server's ``staleness.png``, say.

``ranks.png`` has two panels per run (:mod:`hpcdl.report.ranks`): each rank's mean time
per step, stacked (per push it made or served when the run's ``ranks/`` rows are
meetings), and below it the spread over the ranks per step (per meeting: the rows' own
series, pushes per second and busy fraction).

``stages.png`` (pipeline runs: ``ranks/bubble``) has each stage's bubble and peak
activation memory (:mod:`hpcdl.report.stages`); ``gantt.png`` (runs with ``trace/``
events) the timeline of each run's last steps, a row per rank (:mod:`hpcdl.report.gantt`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hpcdl.atomic import write_atomic
from hpcdl.errors import file_error
from hpcdl.report import gantt, ranks, stages
from hpcdl.report.ranks import RankTimes, rank_times
from hpcdl.report.strategy import roles, strategy_declares

if TYPE_CHECKING:  # pragma: no cover
    from hpcdl.report import Run

__all__ = ["FIGURES", "RankTimes", "rank_times", "x_axes", "output_prefix", "plot"]

#: the report's own figures, in the order they are written (``<prefix>-<name>.png``); the
#: figures a strategy declares come between ``ranks`` and ``stages``
FIGURES = ("loss", "accuracy", "ranks", "stages", "gantt")
#: a prefix made of the runs' names is cut to this length (then ``first+N-more``)
_PREFIX_MAX = 80


def output_prefix(out: str | os.PathLike[str] | None, runs: list[Run]) -> tuple[Path, str]:
    """The directory and the file-name prefix of the plots.

    ``out`` None: beside the first run, named after the runs. ``out`` an existing
    directory or ending in a path separator: in it, named after the runs. Otherwise
    ``out`` is the prefix itself (``plots/cmp`` gives ``plots/cmp-loss.png``, ...).
    Named after the runs is the file stem of one run, the stems joined by ``+`` for
    several (``first+N-more`` when that grows long).
    """
    stems = [r.path.stem for r in runs]
    named = "+".join(stems)
    if len(named) > _PREFIX_MAX:
        named = f"{stems[0]}+{len(stems) - 1}-more"
    if out is None:
        return runs[0].path.parent, named
    text = os.fspath(out)  # as typed: a trailing separator says "a directory"
    path = Path(text)
    if path.is_dir() or text.endswith(("/", os.sep)):
        return path, named
    name = path.name.removesuffix(".png")
    return path.parent, name or named


def plot(
    runs: list[Run], names: list[str], directory: Path, prefix: str, *, gantt_steps: int = gantt.STEPS
) -> list[Path]:
    """Write ``<prefix>-<figure>.png`` into ``directory`` for each of :data:`FIGURES` with something to show.

    Runs without rows are left out; a figure with nothing to show (no rows, no evaluated
    step, no per-rank times, no ``staleness/`` rows, no ``ranks/bubble``, no ``trace/``
    events) is not written. Each file is written atomically: a plot that cannot be
    written leaves the file of an earlier report as it was.

    Args:
        runs, names: the runs and their labels.
        directory, prefix: where the files go (:func:`output_prefix`).
        gantt_steps: the Gantt chart's last steps (0: every step with events).

    Returns:
        The paths written.

    Raises:
        ImportError: matplotlib is not installed.
        FileError: the directory cannot be created or a plot cannot be written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise file_error(directory, err, what="the plot directory", verb="create") from None
    written: list[Path] = []
    pairs = [(r, n) for r, n in zip(runs, names) if r.rows]

    def save(fig: Any, figure: str, layout: bool = True) -> None:
        path = directory / f"{prefix}-{figure}.png"
        try:
            if layout:
                fig.tight_layout()
            write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=120), what="the plot")
        finally:
            plt.close(fig)
        written.append(path)

    if pairs:
        panels = x_axes(pairs)
        fig, axes = plt.subplots(1, len(panels), figsize=(1 + 5 * len(panels), 4), sharey=True, squeeze=False)
        for ax, (_, xs) in zip(axes[0], panels):
            for run, name in pairs:
                if xs[name] is not None:
                    ax.plot(xs[name], run.metrics["loss"], label=name)
        axes[0][0].set_yscale("log")  # shared with the others
        _axes(axes[0], panels, pairs, "training loss (log scale)")
        save(fig, "loss")

    evaluated = [(r, n) for r, n in pairs if np.isfinite(r.metrics.get("test_accuracy", [np.nan])).any()]
    if evaluated:
        panels = x_axes(evaluated)
        fig, axes = plt.subplots(1, len(panels), figsize=(1 + 5 * len(panels), 4), sharey=True, squeeze=False)
        for ax, (_, xs) in zip(axes[0], panels):
            for run, name in evaluated:
                x, m = xs[name], run.metrics
                if x is None:
                    continue
                ok = np.isfinite(m["test_accuracy"])
                (line,) = ax.plot(x[ok], 100 * m["test_accuracy"][ok], "o-", ms=3, label=f"{name} test")
                train = m.get("train_accuracy")
                if train is not None and np.isfinite(train).any():
                    ok = np.isfinite(train)
                    ax.plot(x[ok], 100 * train[ok], "--", color=line.get_color(), label=f"{name} train")
        _axes(axes[0], panels, evaluated, "accuracy (%)")
        save(fig, "accuracy")

    timed = [(t, r, n) for r, n in pairs if (t := rank_times(r)) is not None]
    if timed:
        width = 2 + 6 * len(timed)
        text = ranks.caption([(t, n) for t, _, n in timed], width=15 * width)  # x-small: ~15 a inch
        height = 8.5 + 0.15 * (1 + text.count("\n"))  # inches, with the caption's lines
        fig, axes = plt.subplots(2, len(timed), figsize=(width, height), squeeze=False)
        for col, (times, run, name) in enumerate(timed):
            ranks.draw_ranks(axes[0][col], times, name, roles(run.attrs))
            ranks.draw_rows(axes[1][col], times, roles(run.attrs))
        fig.tight_layout(rect=(0, (height - 8.5) / height, 1, 1))
        fig.text(0.01, 0.01, text, fontsize="x-small")
        save(fig, "ranks", layout=False)

    declared: dict[str, tuple[Any, list[tuple[Run, str]]]] = {}  # the strategies' own figures
    for run, name in pairs:
        for figure in strategy_declares(run.attrs).plots:
            declared.setdefault(figure.name, (figure, []))[1].append((run, name))
    for figure, of_runs in declared.values():
        fig = figure.draw(of_runs)
        if fig is not None:
            save(fig, figure.name)

    staged = [(st, n) for st, n in ((stages.stage_stats(r), n) for r, n in pairs) if st is not None]
    if staged:
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        stages.draw(axes, staged)
        save(fig, "stages")

    timed_events = [(tl, r, n) for r, n in pairs if (tl := gantt.timeline(r.trace, r.metrics, gantt_steps))]
    if timed_events:
        _gantt(timed_events, save)
    return written


def _gantt(timelines: list[tuple[gantt.Timeline, Run, str]], save: Any) -> None:
    """One panel per run, stacked; the caption says what the lanes are (and under MPI, whose clock)."""
    import matplotlib.pyplot as plt

    heights = [gantt.height(tl.ranks) for tl, _, _ in timelines]
    caption = _gantt_caption(timelines)
    foot = 0.18 * (1 + caption.count("\n"))  # inches for the caption
    fig, axes = plt.subplots(len(timelines), 1, figsize=(13, sum(heights) + foot),
                             height_ratios=heights, squeeze=False)  # fmt: skip
    for ax, (tl, run, name) in zip(axes[:, 0], timelines):
        gantt.draw(ax, tl, name, roles(run.attrs))
    fig.tight_layout(rect=(0, foot / fig.get_figheight(), 1, 1))
    fig.text(0.01, 0.01, caption, fontsize="x-small", va="bottom")
    for ax, (tl, _, _) in zip(axes[:, 0], timelines):
        gantt.label(ax, tl)
    save(fig, "gantt", layout=False)


def _gantt_caption(timelines: list[tuple[gantt.Timeline, Run, str]]) -> str:
    kinds = {b.kind for tl, _, _ in timelines if tl.ranks <= gantt.DENSE for b in tl.bars}  # in lanes
    parts = []
    if kinds & {"recv", "wait"}:
        parts.append("thin bars in a row: the rank waiting")
    if "send" in kinds:
        parts.append("the lane under a row: sends in flight, from posted to seen complete")
    parts.append("dotted: rank 0's step ends")
    lines = ["; ".join(parts)]
    if any(r.attrs.get("world") == "mpi" for _, r, _ in timelines):
        lines.append("under mpiexec the ranks' clocks start at a common barrier: rows agree to within its "
                     "skew (microseconds on one node; clock drift across nodes adds to it)")  # fmt: skip
    return "\n".join(lines)


def x_axes(pairs: list[tuple[Run, str]]) -> list[tuple[str, dict[str, np.ndarray | None]]]:
    """The x axes of the loss and accuracy panels: step, samples processed (when some run can tell), time.

    Args:
        pairs: (run, label) of the runs drawn.

    Returns:
        ``(axis label, {run label: x of each metrics row, or None when unknown})`` per panel.
    """
    panels: list[tuple[str, dict[str, np.ndarray | None]]] = [
        ("step", {n: r.metrics["step"] for r, n in pairs})
    ]
    if any(r.samples is not None for r, _ in pairs):
        panels.append(("samples processed", {n: r.samples for r, n in pairs}))
    panels.append(("time (s)", {n: r.metrics.get("time") for r, n in pairs}))
    return panels


def _axes(axes: Any, panels: list, pairs: list[tuple[Run, str]], ylabel: str) -> None:
    axes[0].set_ylabel(ylabel)
    for ax, (xlabel, xs) in zip(axes, panels):
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
        missing = [n for _, n in pairs if xs[n] is None]
        if missing:  # an older run file without a placement: its samples are unknown
            ax.text(0.99, 0.01, f"not shown (unknown): {', '.join(missing)}", transform=ax.transAxes,
                    ha="right", va="bottom", fontsize="x-small")  # fmt: skip
