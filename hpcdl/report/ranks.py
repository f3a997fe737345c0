"""The ranks figure: each rank's time per step (or per push) and its spread, from ``ranks/``.

``ranks/`` has one row per step, or, when it holds ``ranks/step`` (a strategy whose ranks
run free between meetings: ``ps``), one row per meeting, ``ranks/step`` being the step the
meeting ended at. A meeting's row totals the rank's time over the many steps of its phase,
so the report divides it by what the rank did in them: a rank that records the strategy's
declared rate series (:attr:`hpcdl.components.Declares.rate`: a parameter-server worker's
``pushes_per_s``) made its share of the meeting's steps, in proportion to its rate (the
phases last equally long); any other rank (a server) served every step. The rows' own
series (a server's ``busy_fraction``, in the words the strategy declares) are drawn per
meeting, against the steps applied.

Above, each rank's mean time per step (per push), stacked: compute, communication
(moving data), waiting (the part of its communication spent waiting for slower ranks)
and the time outside the step (evaluation, logging, progress output, checkpoints):
``ranks/other_time`` in newer runs, estimated for older files as the step clock's mean
period minus the rank's compute and communication. Every rank of a run that meets every
step spends the same wall time per step, so the bars are equally high: a rank that does
more outside the step (rank 0 writes the run file) makes the others wait. Below, per
step, the median over the ranks and the band from the fastest to the slowest rank:
readable at 2 and at 1,024 ranks.
"""

from __future__ import annotations

import textwrap
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from hpcdl.report.strategy import runs_free, strategy_declares
from hpcdl.store.runfile import RANK_SERIES

if TYPE_CHECKING:  # pragma: no cover
    from hpcdl.report import Run

__all__ = ["RankTimes", "rank_times", "draw_ranks", "draw_rows", "caption"]

#: above this many ranks the per-rank panel is an area, not bars
_BARS_UP_TO = 64
#: up to this many ranks each has its tick (with its role when the ranks' roles differ)
_TICKS_UP_TO = 16
_COLORS = {"compute": "C0", "communication": "C1", "waiting": "C3", "other": "C7"}
_LABELS = {
    "compute": "compute",
    "communication": "communication",
    "waiting": "waiting for slower ranks",
    "other": "outside the step",
}
_PLURAL = {"push": "pushes", "step": "steps"}
#: the caption under ranks.png
_CAPTION = (
    "communication: moving data; waiting: the part of a rank's communication time above the fastest rank's"
)
_OUTSIDE = "; outside the step: evaluation, logging, progress output, checkpoints{how}"
_MEETINGS = (
    "{names}: a row of ranks/ is a meeting: the times of a rank that records {rate} are divided by the "
    "{plural} it made (its share of the meeting's {plural}, by its {rate}), another rank's by the {plural} "
    "it served (every {unit}); communication includes the meeting; between the phases: the run file, "
    "progress, checkpoints"
)


@dataclass
class RankTimes:
    """Per-rank times of a run in milliseconds per step, or per push when the rows are meetings.

    Attributes:
        steps: the step each row ended at (``metrics/step`` for a step's row,
            ``ranks/step`` for a meeting's).
        per_row: series name -> (rows, ranks) array, milliseconds per :attr:`unit`:
            ``compute``, ``communication``, ``waiting`` and, when the run recorded it,
            ``other``. A meeting's row is the rank's time in it divided by
            :attr:`counts`.
        mean: series name -> per-rank mean per unit, the series above plus ``other``
            when it could be estimated (over meetings: the rank's whole time divided by
            everything it made or served).
        other_estimated: ``other`` is the step clock's period minus the measured parts.
        unit: what a time is per: ``step``, or ``push`` (the rows are meetings and the
            ranks record ``pushes_per_s``).
        starts: rows that are meetings: the step each meeting began after; None for
            rows that are steps.
        counts: rows that are meetings: (rows, ranks), the units each rank made or
            served in each meeting; None for rows that are steps.
        series: rows that are meetings: the rows' own per-rank series (``pushes_per_s``,
            ``busy_fraction``: NaN on the ranks without one), each (rows, ranks).
    """

    steps: np.ndarray
    per_row: dict[str, np.ndarray]
    mean: dict[str, np.ndarray]
    other_estimated: bool
    unit: str = "step"
    starts: np.ndarray | None = None
    counts: np.ndarray | None = None
    series: dict[str, np.ndarray] = field(default_factory=dict)
    #: the strategy's own series in words (:attr:`hpcdl.components.Declares.series`)
    words: dict[str, str] = field(default_factory=dict)
    #: the series that gave each rank's share of a meeting's steps ('': none)
    rate: str = ""

    @property
    def ranks(self) -> int:
        return next(iter(self.per_row.values())).shape[1] if self.per_row else 0

    @property
    def meetings(self) -> bool:
        """The rows are meetings (``ranks/step``), not steps."""
        return self.starts is not None


def rank_times(run: Run) -> RankTimes | None:
    """The per-rank times of ``run`` (None when it has no per-rank rows).

    ``communication`` is ``comm_time`` less ``wait_time``. Rows that are meetings
    (``ranks/step`` present) are divided by the steps (pushes) each rank made or served
    (module docstring). For rows that are steps, without a recorded ``other_time``,
    the time outside the step is estimated per rank as the mean interval between the
    rows' ``time`` (rank 0's clock, which every rank shares when the ranks meet each
    step) less the rank's mean compute and communication, over the rows after the first;
    not for an older ``ps`` file, whose ranks do not meet each step.
    """
    r = {k: np.asarray(v, dtype=np.float64) for k, v in run.ranks.items() if np.ndim(v) == 2}
    if "compute_time" not in r or "comm_time" not in r or not len(r["compute_time"]):
        return None
    rows = len(r["compute_time"])
    wait = r.get("wait_time", np.zeros_like(r["comm_time"]))
    totals = {
        "compute": 1e3 * r["compute_time"],
        "communication": 1e3 * (r["comm_time"] - wait),
        "waiting": 1e3 * wait,
    }
    if "other_time" in r:
        totals["other"] = 1e3 * r["other_time"]
    if "step" in run.ranks:
        declared = strategy_declares(run.attrs)
        ends = np.asarray(run.ranks["step"][:rows], dtype=np.int64)
        return _per_meeting(ends, totals, r, declared.rate, declared.step_name, dict(declared.series))
    step = run.metrics.get("step")
    steps = np.asarray(step[:rows]) if step is not None and len(step) >= rows else np.arange(1, rows + 1)
    time = run.metrics.get("time")
    n = min(rows, len(time)) if time is not None else 0
    estimate = "other" not in totals and n >= 2 and not runs_free(run.attrs)  # a push ends no round
    window = slice(1, n) if estimate else slice(None)
    mean = {k: _column_means(v[window]) for k, v in totals.items()}
    if estimate:
        period = 1e3 * np.diff(np.asarray(time[:n], dtype=np.float64))
        period = period[np.isfinite(period)]
        if period.size:
            inside = sum(mean.values())
            mean["other"] = np.clip(float(period.mean()) - inside, 0.0, None)
    return RankTimes(steps, totals, mean, "other" in mean and "other" not in totals)


def _per_meeting(
    ends: np.ndarray,
    totals: dict[str, np.ndarray],
    r: dict[str, np.ndarray],
    rate_series: str = "",
    step_name: str = "step",
    words: dict[str, str] | None = None,
) -> RankTimes:
    """Rows that are meetings ending at steps ``ends``: each rank's times per step (a ``push``,
    ``step_name``) it made — its share by ``rate_series`` — or served."""
    starts = np.concatenate(([0], ends[:-1]))
    done = (ends - starts).astype(np.float64)[:, None]  # the steps (pushes applied) of each meeting
    counts = np.repeat(done, len(next(iter(totals.values()))[0]), axis=1)
    rate = r.get(rate_series) if rate_series else None
    unit = "step"
    if rate is not None:  # a rank with a rate made its share of the steps; the others served every one
        unit = step_name
        made = np.isfinite(rate)
        total = np.where(made, rate, 0.0).sum(axis=1, keepdims=True)
        with np.errstate(invalid="ignore", divide="ignore"):
            share = np.where(total > 0, rate / total, np.nan)
        counts = np.where(made, done * share, counts)
    ok = counts > 0  # (NaN compares False: a meeting whose share is unknown is left out)
    with np.errstate(invalid="ignore", divide="ignore"):
        per_row = {k: np.where(ok, v / np.where(ok, counts, 1.0), np.nan) for k, v in totals.items()}
    mean = {}
    for k, v in totals.items():  # a rank's whole time over everything it made or served
        use = ok & np.isfinite(v)
        spent, units = np.where(use, v, 0.0).sum(axis=0), np.where(use, counts, 0.0).sum(axis=0)
        mean[k] = np.divide(spent, units, out=np.zeros_like(spent), where=units > 0)
    series = {k: v for k, v in r.items() if k not in RANK_SERIES}
    return RankTimes(ends, per_row, mean, False, unit, starts, counts, series, dict(words or {}), rate_series)


def _column_means(a: np.ndarray) -> np.ndarray:
    """Mean of each column over its finite values (0 where a column has none)."""
    ok = np.isfinite(a)
    return np.where(ok, a, 0.0).sum(axis=0) / np.maximum(ok.sum(axis=0), 1)


def caption(timed: list[tuple[RankTimes, str]], width: int) -> str:
    """The text under the ranks figure, wrapped at ``width`` characters: what the parts are, and
    how a meeting's row is divided."""
    estimated = any(t.other_estimated for t, _ in timed)
    how = " (hatched: estimated as the mean step period less compute and communication)" if estimated else ""
    lines = [_CAPTION + (_OUTSIDE.format(how=how) if any(not t.meetings for t, _ in timed) else "")]
    by_rate: dict[tuple[str, str], list[str]] = {}
    for t, name in timed:
        if t.meetings and t.rate and t.unit != "step":
            by_rate.setdefault((t.rate, t.unit), []).append(name)
    for (rate, unit), names in by_rate.items():
        plural = _PLURAL.get(unit, f"{unit}s")
        lines.append(_MEETINGS.format(names=", ".join(names), rate=rate, plural=plural, unit=unit))
    return "\n".join(textwrap.fill(line, width) for line in lines)


def draw_ranks(ax: Any, times: RankTimes, name: str, roles: list[str]) -> None:
    """Each rank's mean time per step (per push), stacked: bars up to 64 ranks, an area above."""
    from matplotlib.ticker import MaxNLocator

    n = times.ranks
    x = np.arange(n)
    parts = {k: v for k, v in times.mean.items() if k in _LABELS}
    labels = dict(_LABELS)
    if times.other_estimated:
        labels["other"] = "outside the step (estimated)"
    if times.meetings:
        labels["other"] = "between the phases"
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
    if n <= _TICKS_UP_TO:
        ax.set_xticks(x)
        if len(roles) == n and len(set(roles)) > 1:  # say which rank is what (server, worker, stage)
            ax.set_xticklabels([f"{i}\n{role}" for i, role in enumerate(roles)])
    else:
        ax.xaxis.set_major_locator(MaxNLocator(nbins=12, integer=True))
    compute = times.mean["compute"]
    if n > 4:  # name the ranks that compute longest: at scale, the bars are too thin to read
        top = np.argsort(compute, kind="stable")[::-1][:3]
        slowest = ", ".join(f"{r} ({compute[r]:.2f})" for r in top)
        ax.text(0.99, 0.97, f"longest compute, ms: rank {slowest}; median {np.median(compute):.2f}",
                transform=ax.transAxes, ha="right", va="top", fontsize="x-small")  # fmt: skip
    unit = times.unit
    ax.set_xlabel("rank")
    if times.meetings and times.rate and unit != "step":
        ax.set_ylabel(f"mean time per {unit} made or served (ms)")
        ax.set_title(f"{name}: {n} ranks, mean per {unit} (with {times.rate}: made; without: served)",
                     fontsize="medium")  # fmt: skip
    else:
        ax.set_ylabel(f"mean time per {unit} (ms)")
        ax.set_title(f"{name}: {n} ranks, mean per {unit}", fontsize="medium")
    ax.use_sticky_edges = False  # a part of height 0 on top would stop the margin at the bars' top
    ax.margins(y=0.3)  # room for the legend above the bars
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper left", bbox_to_anchor=(0, 0.93), fontsize="small", ncol=2)


def draw_rows(ax: Any, times: RankTimes, roles: list[str]) -> None:
    """Below the bars: per step the spread of the times, or per meeting the rows' own series."""
    if times.meetings:
        _per_meeting_panel(ax, times, roles)
    else:
        _per_step(ax, times)


def _spread(values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row, the least, the median and the most over the ranks' finite values (NaN: none)."""
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a row where no rank has a value: a gap
        return np.nanmin(values, axis=1), np.nanmedian(values, axis=1), np.nanmax(values, axis=1)


def _per_step(ax: Any, times: RankTimes) -> None:
    """Per step: the median over the ranks and the band from the fastest to the slowest rank (log scale)."""
    from matplotlib.ticker import MaxNLocator

    x = times.steps
    shown = {"compute": ("compute", times.per_row["compute"])}
    comm = times.per_row["communication"] + times.per_row["waiting"]  # its spread is the waiting
    shown["communication"] = ("communication incl. waiting", comm)
    if "other" in times.per_row:
        shown["other"] = ("outside the step", times.per_row["other"])
    for key, (label, ms) in shown.items():
        lo, mid, hi = _spread(np.where(ms > 0, ms, np.nan))  # a log axis: zero is off the scale
        ax.fill_between(x, lo, hi, color=_COLORS[key], alpha=0.25, linewidth=0, step="mid")
        ax.plot(x, mid, color=_COLORS[key], lw=1, drawstyle="steps-mid", label=f"{label}: median, min-max")
    ax.set_yscale("log")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("time in the step (ms, log scale)")
    ax.set_title(f"spread over the {times.ranks} ranks, per step", fontsize="medium")
    ax.grid(alpha=0.3, which="both")
    ax.legend(loc="best", fontsize="small")


def _per_meeting_panel(ax: Any, times: RankTimes, roles: list[str]) -> None:
    """Per meeting, over the pushes (steps) it spans: the rows' own series, a rate on the left axis
    and a fraction on the right one; without such series, the time per push (step)."""
    from matplotlib.ticker import MaxNLocator

    starts = times.starts if times.starts is not None else times.steps - 1
    edges = np.concatenate((starts[:1], times.steps))
    plural = _PLURAL.get(times.unit, f"{times.unit}s")
    shown = {k: v for k, v in times.series.items() if np.isfinite(v).any()}
    rates = {_label(k, v, roles, times.words): v for k, v in shown.items() if not k.endswith("_fraction")}
    fractions = {_label(k, v, roles, times.words): v for k, v in shown.items() if k.endswith("_fraction")}
    if shown:
        ax.set_ylabel(" / ".join(_name(k, times.words) for k in shown if not k.endswith("_fraction")))
    else:  # no series of its own: the times per push (step)
        comm = times.per_row["communication"] + times.per_row["waiting"]
        rates = {f"compute per {times.unit}": times.per_row["compute"],
                 f"communication incl. waiting per {times.unit}": comm}  # fmt: skip
        ax.set_ylabel(f"time per {times.unit} (ms)")
    colors = iter(["C2", "C4", "C5", "C6", "C8", "C9"])
    highest = max((_band(ax, edges, v, next(colors), label) for label, v in rates.items()), default=0.0)
    ax.set_ylim(0, 1.45 * highest if highest > 0 else 1.0)  # room for the legend above the lines
    top = ax
    if fractions:  # a second axis, 0 to 1
        top = ax.twinx()
        for label, values in fractions.items():
            _band(top, edges, values, next(colors), label)
        top.set_ylim(0, 1.45)
        top.set_yticks(np.linspace(0, 1, 6))
        top.set_ylabel("fraction of the phase")
    handles = [h for a in dict.fromkeys((ax, top)) for h in a.get_legend_handles_labels()[0]]
    top.legend(handles=handles, loc="upper left", fontsize="small", ncol=2)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel(f"{plural} applied (a line spans the {plural} of one meeting)")
    ax.set_title(f"per meeting ({len(times.steps)}), over the {times.ranks} ranks", fontsize="medium")
    ax.grid(alpha=0.3)


def _band(ax: Any, edges: np.ndarray, values: np.ndarray, color: str, label: str) -> float:
    """Per row over ``edges``: the median over the ranks as a line, least to most as a band; the most."""
    lo, mid, hi = _spread(values)
    ax.stairs(hi, edges, baseline=lo, fill=True, color=color, alpha=0.25, linewidth=0)
    ax.stairs(mid, edges, baseline=None, color=color, lw=1.5, label=f"{label}: median, min-max")
    return float(np.nanmax(hi)) if np.isfinite(hi).any() else 0.0


def _label(key: str, values: np.ndarray, roles: list[str], words: dict[str, str]) -> str:
    """``pushes per second (2 workers)``: the series and the ranks that record it."""
    has = np.flatnonzero(np.isfinite(values).any(axis=0))
    kinds = sorted({roles[r] for r in has}) if len(roles) == values.shape[1] else []
    who = f"{len(has)} {kinds[0]}{'s' * (len(has) > 1)}" if len(kinds) == 1 else f"{len(has)} ranks"
    return f"{_name(key, words)} ({who})"


def _name(key: str, words: dict[str, str]) -> str:
    """A rank series in words: as the strategy declares it (``pushes per second`` for a parameter
    server's ``pushes_per_s``), else its name with spaces."""
    return words.get(key, key.replace("_", " "))
