"""Per pipeline stage: its bubble (the idle part of each step) and the activation memory it held.

A pipeline run records, per step and rank (stage), ``ranks/bubble`` (1 - busy / the
step's makespan), ``ranks/activation_bytes`` (the most bytes of forward caches held
during the step) and ``ranks/in_flight`` (the most microbatches held). The report shows
each stage's bubble as the median over the steps (the range from the least to the most
as whiskers), against ``(p - 1) / (m + p - 1)``, GPipe's and 1F1B's bubble when the p
stages cost the same (``(p - 1) / (v m + p - 1)`` for the interleaved schedule's v chunks
per stage); and each stage's activations as the most over the steps.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from hpcdl.report.strategy import config_value, micro_steps, roles

if TYPE_CHECKING:  # pragma: no cover
    from hpcdl.report import Run

__all__ = ["StageStats", "stage_stats", "format_stages", "draw"]

MIB = 2.0**20


@dataclass
class StageStats:
    """A pipeline run's per-stage figures (one value per stage, rank s being stage s).

    Attributes:
        names: each stage's name (its placement role, ``stage 0``; else ``rank 0``).
        bubble: median over the steps of the stage's bubble (a fraction of the step).
        bubble_low, bubble_high: its least and most over the steps.
        activation_bytes: the most activation bytes held in a step; None if not recorded.
        in_flight: the most microbatches held in a step; None if not recorded.
        equal_stages: ``(p - 1) / (v m + p - 1)``; None when m is unknown.
        chunks: v, the model chunks per stage (``pipeline.virtual_stages`` of an
            ``interleaved`` schedule; 1 otherwise).
    """

    names: list[str]
    bubble: np.ndarray
    bubble_low: np.ndarray
    bubble_high: np.ndarray
    activation_bytes: np.ndarray | None
    in_flight: np.ndarray | None
    equal_stages: float | None
    chunks: int = 1

    @property
    def stages(self) -> int:
        return len(self.names)

    @property
    def formula(self) -> str:
        """How :attr:`equal_stages` is worked out, for labels."""
        return "(p-1)/(m+p-1)" if self.chunks == 1 else f"(p-1)/(vm+p-1), v={self.chunks}"


def _over_steps(series: np.ndarray, how: str) -> np.ndarray:
    """Per column, ``how`` (nanmedian, nanmin, nanmax) over the finite rows; NaN for a column without."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # an all-NaN column: NaN
        return getattr(np, how)(series, axis=0)


def stage_stats(run: Run) -> StageStats | None:
    """The per-stage bubble and activation memory of ``run`` (None without ``ranks/bubble`` rows)."""
    bubble = run.ranks.get("bubble")
    if bubble is None or np.ndim(bubble) != 2 or not len(bubble) or not np.isfinite(bubble).any():
        return None
    bubble = np.asarray(bubble, dtype=np.float64)
    p = bubble.shape[1]
    named = roles(run.attrs)
    if len(named) == p and len(set(named)) == p:
        names = named
    elif len(named) == p:  # replicated stages: a stage's ranks share its role
        names = [f"{role} (rank {r})" for r, role in enumerate(named)]
    else:
        names = [f"rank {r}" for r in range(p)]
    stages = len(set(named)) if len(named) == p else p
    m = micro_steps(run.attrs)
    v = 1
    if config_value(run.attrs, "pipeline.schedule") == "interleaved":
        v = config_value(run.attrs, "pipeline.virtual_stages", 1)
        v = v if isinstance(v, int) and v >= 1 else 1
    extra = {}
    for key in ("activation_bytes", "in_flight"):
        series = run.ranks.get(key)
        ok = series is not None and np.ndim(series) == 2 and np.isfinite(series).any()
        extra[key] = _over_steps(np.asarray(series, dtype=np.float64), "nanmax") if ok else None
    return StageStats(
        names=names,
        bubble=_over_steps(bubble, "nanmedian"),
        bubble_low=_over_steps(bubble, "nanmin"),
        bubble_high=_over_steps(bubble, "nanmax"),
        activation_bytes=extra["activation_bytes"],
        in_flight=extra["in_flight"],
        equal_stages=None if m is None else (stages - 1) / (v * m + stages - 1),
        chunks=v,
    )


def format_stages(rows: list[tuple[str, StageStats]]) -> str:
    """The per-stage block printed under the report's table ("" when no run has stages).

    Args:
        rows: (run label, its :func:`stage_stats`) of the pipeline runs.
    """
    if not rows:
        return ""
    header = ["run", "stage", "bubble %", "(min-max)", "activations MiB", "microbatches held"]
    cells = [header]
    for name, st in rows:
        for s in range(st.stages):
            act = "-" if st.activation_bytes is None else f"{st.activation_bytes[s] / MIB:.2f}"
            held = "-" if st.in_flight is None else f"{st.in_flight[s]:.0f}"
            spread = f"({100 * st.bubble_low[s]:.1f}-{100 * st.bubble_high[s]:.1f})"
            cells.append(
                [name if s == 0 else "", st.names[s], f"{100 * st.bubble[s]:.1f}", spread, act, held]
            )
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
    text = {0, 1}  # left-aligned columns

    def line(values: list[str]) -> str:
        cols = enumerate(zip(values, widths))
        return "  ".join(v.ljust(w) if i in text else v.rjust(w) for i, (v, w) in cols)

    out = [
        "per pipeline stage: bubble = the idle part of a step (median over the steps); "
        "activations, microbatches held = the most in a step",
        line(cells[0]).rstrip(),
        "  ".join("-" * w for w in widths),
    ]
    out += [line(c).rstrip() for c in cells[1:]]
    for name, st in rows:
        if st.equal_stages is not None:
            out.append(f"{name}: equal stages would idle {st.formula} = {100 * st.equal_stages:.1f}%")
    return "\n".join(out)


def draw(axes: Any, pairs: list[tuple[StageStats, str]]) -> None:
    """Two panels: each stage's bubble (median, whiskers least to most) and its peak activations.

    Args:
        axes: two matplotlib axes.
        pairs: (stage figures, run label) of the pipeline runs, drawn side by side per stage.
    """
    bub, act = axes
    width = 0.8 / len(pairs)
    most = max(st.stages for st, _ in pairs)
    for i, (st, name) in enumerate(pairs):
        x = np.arange(st.stages) + (i - (len(pairs) - 1) / 2) * width
        err = np.vstack([st.bubble - st.bubble_low, st.bubble_high - st.bubble])
        bars = bub.bar(x, 100 * st.bubble, width=0.9 * width, yerr=100 * err, capsize=3, label=name,
                       color=f"C{i}", error_kw={"lw": 1, "ecolor": "0.25"})  # fmt: skip
        bub.bar_label(bars, fmt="%.1f", fontsize="x-small", padding=2, label_type="center", color="white")
        if st.activation_bytes is not None:
            bars = act.bar(x, st.activation_bytes / MIB, width=0.9 * width, color=f"C{i}", label=name)
            if st.in_flight is not None:
                texts = [f"{n:.0f} held" for n in st.in_flight]
                act.bar_label(bars, labels=texts, fontsize="x-small", padding=2)
    equal: dict[tuple[float, str], list[str]] = {}  # a dashed line per value: runs alike share it
    for st, name in pairs:
        if st.equal_stages is not None:
            equal.setdefault((round(st.equal_stages, 12), st.formula), []).append(name)
    for (value, formula), runs in equal.items():
        which = f" ({', '.join(runs)})" if len(equal) > 1 else ""
        bub.axhline(100 * value, color="0.2", ls="--", lw=1,
                    label=f"equal stages{which}: {formula} = {100 * value:.1f}%")  # fmt: skip
    names = max((st.names for st, _ in pairs), key=len)
    for ax in axes:
        ax.set_xticks(np.arange(most))
        ax.set_xticklabels(names if len(names) == most else [str(s) for s in range(most)])
        ax.set_xlabel("pipeline stage")
        ax.grid(axis="y", alpha=0.3)
        ax.set_ylim(bottom=0)
        ax.set_ylim(top=1.35 * ax.get_ylim()[1])  # room for the legend above the bars
    bub.set_ylabel("bubble (% of the step, median over steps)")
    bub.set_title("idle part of each step (whiskers: least to most)", fontsize="medium")
    act.set_ylabel("activation memory (MiB, most in a step)")
    act.set_title("peak activations held (microbatches held above)", fontsize="medium")
    bub.legend(fontsize="small", loc="upper left", ncol=2)
    if act.containers:
        act.legend(fontsize="small", loc="upper right", ncol=2)
    else:
        act.text(0.5, 0.5, "not recorded", transform=act.transAxes, ha="center", va="center")
