"""The report's figures (loss, accuracy, per-rank times, staleness, stages, timeline), named after the runs.

``loss.png`` and ``accuracy.png`` draw every run against steps, samples processed and
time: runs of different strategies compare at equal samples and equal time, not at
equal steps (a ``ps`` step is one push). ``staleness.png`` has the τ histogram of each
run that recorded ``staleness/`` (parameter servers), as fractions of its applied
pushes, with SSP's bound where one applies.

``ranks.png`` has two panels per run. Above, each rank's mean time per step, stacked:
compute, communication (moving data), waiting (the part of its communication spent
waiting for slower ranks) and the time spent outside the step (evaluation, logging,
progress output, checkpoints): recorded as ``ranks/other_time`` by newer runs,
estimated for older files as the step clock's mean period minus the rank's compute and
communication. Every rank of a run that meets every step spends the same wall time per
step, so the bars are equally high: a rank that does more outside the step (rank 0
writes the run file) makes the others wait. Below, per step, the median over the ranks
and the band from the fastest to the slowest rank: readable at 2 and at 1,024 ranks.

``stages.png`` (pipeline runs: ``ranks/bubble``) has each stage's bubble and peak
activation memory (:mod:`hpcdl.report.stages`); ``gantt.png`` (runs with ``trace/``
events) the timeline of each run's last steps, a row per rank (:mod:`hpcdl.report.gantt`).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hpcdl.atomic import write_atomic
from hpcdl.errors import file_error
from hpcdl.report import gantt, stages
from hpcdl.report.strategy import config_value, mode_label, roles, tau_histogram, workers

if TYPE_CHECKING:  # pragma: no cover
    from hpcdl.report import Run

__all__ = ["FIGURES", "RankTimes", "rank_times", "x_axes", "output_prefix", "plot"]

#: the figures, in the order they are written: ``<prefix>-<name>.png``
FIGURES = ("loss", "accuracy", "ranks", "staleness", "stages", "gantt")
#: above this many ranks the per-rank panel is an area, not bars
_BARS_UP_TO = 64
#: a prefix made of the runs' names is cut to this length (then ``first+N-more``)
_PREFIX_MAX = 80
_COLORS = {"compute": "C0", "communication": "C1", "waiting": "C3", "other": "C7"}
_LABELS = {
    "compute": "compute",
    "communication": "communication",
    "waiting": "waiting for slower ranks",
    "other": "outside the step",
}
#: the caption under ranks.png
_CAPTION = (
    "communication: moving data; waiting: the part of a rank's communication time above the fastest "
    "rank's; outside the step: evaluation, logging, progress output, checkpoints{how}"
)


@dataclass
class RankTimes:
    """Per-rank times of a run in milliseconds.

    Attributes:
        steps: the step of each row.
        per_step: series name -> (rows, ranks) array: ``compute``, ``communication``,
            ``waiting`` and, when the run recorded it, ``other``.
        mean: series name -> per-rank mean per step, the series above plus ``other``
            when it could be estimated.
        other_estimated: ``other`` is the step clock's period minus the measured parts.
    """

    steps: np.ndarray
    per_step: dict[str, np.ndarray]
    mean: dict[str, np.ndarray]
    other_estimated: bool

    @property
    def ranks(self) -> int:
        return next(iter(self.per_step.values())).shape[1] if self.per_step else 0


def rank_times(run: Run) -> RankTimes | None:
    """The per-rank times of ``run`` (None when it has no per-rank rows).

    ``communication`` is ``comm_time`` less ``wait_time``. Without a recorded
    ``other_time``, the time outside the step is estimated per rank as the mean interval
    between the rows' ``time`` (rank 0's clock, which every rank shares when the ranks
    meet each step) less the rank's mean compute and communication, over the rows after
    the first; not for ``ps`` runs, whose ranks do not meet each step.
    """
    r = {k: np.asarray(v, dtype=np.float64) for k, v in run.ranks.items() if np.ndim(v) == 2}
    if "compute_time" not in r or "comm_time" not in r or not len(r["compute_time"]):
        return None
    rows = len(r["compute_time"])
    wait = r.get("wait_time", np.zeros_like(r["comm_time"]))
    per_step = {
        "compute": 1e3 * r["compute_time"],
        "communication": 1e3 * (r["comm_time"] - wait),
        "waiting": 1e3 * wait,
    }
    if "other_time" in r:
        per_step["other"] = 1e3 * r["other_time"]
    step = run.metrics.get("step")
    steps = np.asarray(step[:rows]) if step is not None and len(step) >= rows else np.arange(1, rows + 1)
    time = run.metrics.get("time")
    n = min(rows, len(time)) if time is not None else 0
    estimate = "other" not in per_step and n >= 2 and run.attrs.get("strategy") != "ps"
    window = slice(1, n) if estimate else slice(None)
    mean = {k: _column_means(v[window]) for k, v in per_step.items()}
    if estimate:
        period = 1e3 * np.diff(np.asarray(time[:n], dtype=np.float64))
        period = period[np.isfinite(period)]
        if period.size:
            inside = sum(mean.values())
            mean["other"] = np.clip(float(period.mean()) - inside, 0.0, None)
    return RankTimes(steps, per_step, mean, "other" in mean and "other" not in per_step)


def _column_means(a: np.ndarray) -> np.ndarray:
    """Mean of each column over its finite values (0 where a column has none)."""
    ok = np.isfinite(a)
    return np.where(ok, a, 0.0).sum(axis=0) / np.maximum(ok.sum(axis=0), 1)


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

    timed = [(t, n) for t, n in ((rank_times(r), n) for r, n in pairs) if t is not None]
    if timed:
        cols = len(timed)
        fig, axes = plt.subplots(2, cols, figsize=(2 + 6 * cols, 8.5), squeeze=False)
        for col, (times, name) in enumerate(timed):
            _per_rank(axes[0][col], times, name)
            _per_step(axes[1][col], times)
        estimated = any(t.other_estimated for t, _ in timed)
        how = " (hatched: estimated as the mean step period less compute and communication)"
        how = how if estimated else ""
        fig.tight_layout(rect=(0, 0.04, 1, 1))
        fig.text(0.01, 0.01, _CAPTION.format(how=how), fontsize="x-small", wrap=True)
        save(fig, "ranks", layout=False)

    stale = [(r, n) for r, n in pairs if len(r.staleness.get("tau", ()))]
    if stale:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        _staleness(ax, stale)
        save(fig, "staleness")

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


def _staleness(ax: Any, stale: list[tuple[Run, str]]) -> None:
    """Each run's τ histogram (integer bins, fractions of its applied pushes, log y), SSP's bound dashed."""
    from matplotlib.ticker import MaxNLocator

    smallest = 1.0
    for run, name in stale:
        values, frequency = tau_histogram(run.staleness["tau"])
        label = f"{name}: {mode_label(run.attrs)}"
        bound = _ssp_bound(run.attrs)
        if bound is not None:
            label += f" (SSP allows τ <= {bound})"
        shown = np.where(frequency > 0, frequency, np.nan)  # a log axis: an empty bin is a gap
        (line,) = ax.plot(values, shown, drawstyle="steps-mid", lw=1.5, label=label)
        ax.plot(values, shown, "o", ms=3, color=line.get_color())  # a lone bin (sync: all at 0) shows
        if bound is not None:
            ax.axvline(bound, color=line.get_color(), ls="--", lw=1)
        smallest = min(smallest, float(frequency[frequency > 0].min()))
    ax.set_yscale("log")
    ax.set_ylim(smallest / 3, 1.5)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("staleness τ (server versions between a worker's pull and its push's apply)")
    ax.set_ylabel("fraction of applied pushes (log scale)")
    ax.set_title("staleness of the applied pushes (one count per push and server)", fontsize="medium")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize="small")


def _ssp_bound(attrs: dict[str, Any]) -> int | None:
    """The largest τ SSP allows for an ``ssp`` run, ``(W - 1)(2 s + 1)`` (None: not ssp, or unknown)."""
    if attrs.get("strategy") != "ps" or config_value(attrs, "parallel.mode") != "ssp":
        return None
    s, w = config_value(attrs, "parallel.staleness"), workers(attrs)
    if not isinstance(s, int) or w is None:
        return None
    from hpcdl.parallel.ps_plan import max_staleness

    return max_staleness(w, s)


def _per_rank(ax: Any, times: RankTimes, name: str) -> None:
    """Each rank's mean time per step, stacked: bars up to 64 ranks, an area above."""
    from matplotlib.ticker import MaxNLocator

    n = times.ranks
    x = np.arange(n)
    parts = {k: v for k, v in times.mean.items() if k in _LABELS}
    labels = dict(_LABELS)
    if times.other_estimated:
        labels["other"] = "outside the step (estimated)"
    bottom = np.zeros(n)
    for key, ms in parts.items():
        style = {"facecolor": _COLORS[key], "edgecolor": _COLORS[key], "label": labels[key], "linewidth": 0}
        if key == "other" and times.other_estimated:
            style.update(hatch="//", edgecolor="0.2")
        if n <= _BARS_UP_TO:
            ax.bar(x, ms, bottom=bottom, width=0.8 if n <= 16 else 1.0, **style)
        else:  # thousands of bars alias into stripes: a stepped area instead
            ax.fill_between(x, bottom, bottom + ms, step="mid", **style)
        bottom = bottom + ms
    ax.set_xlim(-0.6, n - 0.4)
    if n <= 16:
        ax.set_xticks(x)
    else:
        ax.xaxis.set_major_locator(MaxNLocator(nbins=12, integer=True))
    compute = times.mean["compute"]
    if n > 4:  # name the ranks that compute longest: at scale, the bars are too thin to read
        top = np.argsort(compute, kind="stable")[::-1][:3]
        slowest = ", ".join(f"{r} ({compute[r]:.2f})" for r in top)
        ax.text(0.99, 0.97, f"longest compute, ms: rank {slowest}; median {np.median(compute):.2f}",
                transform=ax.transAxes, ha="right", va="top", fontsize="x-small")  # fmt: skip
    ax.set_xlabel("rank")
    ax.set_ylabel("mean time per step (ms)")
    ax.set_title(f"{name}: {n} ranks, mean per step", fontsize="medium")
    ax.margins(y=0.3)  # room for the legend above the bars
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper left", bbox_to_anchor=(0, 0.93), fontsize="small", ncol=2)


def _per_step(ax: Any, times: RankTimes) -> None:
    """Per step: the median over the ranks and the band from the fastest to the slowest rank (log scale)."""
    from matplotlib.ticker import MaxNLocator

    x = times.steps
    shown = {"compute": ("compute", times.per_step["compute"])}
    comm = times.per_step["communication"] + times.per_step["waiting"]  # its spread is the waiting
    shown["communication"] = ("communication incl. waiting", comm)
    if "other" in times.per_step:
        shown["other"] = ("outside the step", times.per_step["other"])
    for key, (label, ms) in shown.items():
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a step where every rank has 0: a gap
            ms = np.where(ms > 0, ms, np.nan)  # a log axis: zero is off the scale
            lo, mid, hi = np.nanmin(ms, axis=1), np.nanmedian(ms, axis=1), np.nanmax(ms, axis=1)
        ax.fill_between(x, lo, hi, color=_COLORS[key], alpha=0.25, linewidth=0, step="mid")
        ax.plot(x, mid, color=_COLORS[key], lw=1, drawstyle="steps-mid", label=f"{label}: median, min-max")
    ax.set_yscale("log")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("time in the step (ms, log scale)")
    ax.set_title(f"spread over the {times.ranks} ranks, per step", fontsize="medium")
    ax.grid(alpha=0.3, which="both")
    ax.legend(loc="best", fontsize="small")
