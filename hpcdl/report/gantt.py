"""A run's timeline (``trace/``) over its last few steps as a Gantt chart: a row per rank, a bar per event.

Which events: those of the last ``steps`` steps (:data:`STEPS` unless told; 0: every
traced step), that is every event that starts after rank 0 ended the step before them
(``metrics/time``, on the run clock ``trace/`` uses). Times are drawn in milliseconds
from the first of those events.

How: a rank's row holds what occupies it: forward and backward (a pipeline's, labelled
``F3``/``B3`` with their microbatch where the bar is wide enough), sync's pack (labelled
with its bucket) and unpack, and any other kind of event; waiting (a pipeline's recv,
sync's wait) is a thinner bar in the row, the rank being idle; a send, in flight from
posted to seen complete while the rank goes on, is drawn in a thin lane under the row.
Past :data:`DENSE` ranks a row is a few pixels high: every bar fills its row, sends under
the rest, and no bar is labelled.
Dotted lines mark rank 0's step ends. :func:`timeline` is the data (tested as such),
:func:`draw` and :func:`label` the drawing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["STEPS", "Bar", "Timeline", "timeline", "draw", "label", "height"]

#: steps drawn when not told (``--gantt-steps``)
STEPS = 2
#: kind -> (colour, lane, legend); lanes: "busy" a full bar in the row, "idle" a thinner one,
#: "send" the thin lane under the row. Kinds not here are busy, coloured from _OTHER_COLORS.
STYLE = {
    "forward": ("tab:blue", "busy", "forward"),
    "backward": ("tab:orange", "busy", "backward"),
    "recv": ("tab:red", "idle", "recv (waiting for data)"),
    "send": ("tab:purple", "send", "send (posted to complete)"),
    "pack": ("tab:green", "busy", "pack (bucket k)"),
    "wait": ("tab:brown", "idle", "wait (for the exchange)"),
    "unpack": ("tab:olive", "busy", "unpack"),
}
_OTHER_COLORS = ("tab:pink", "tab:cyan", "tab:gray", "gold", "navy")
#: a lane's (centre offset from the rank's row, height), in rows; the y axis points down
_LANES = {"busy": (-0.08, 0.64), "idle": (-0.08, 0.28), "send": (0.33, 0.12)}
#: above this many ranks a row is a few pixels: every bar fills it (thin bars would alias into stripes)
DENSE = 64
#: the microbatch labels' font size (points)
_FONT = 7


@dataclass(frozen=True)
class Bar:
    """One event of ``trace/`` as drawn.

    Attributes:
        rank: the rank (the chart's row).
        start: milliseconds from the first event drawn (:attr:`Timeline.origin`).
        duration: milliseconds (0 for an event that ends before it starts).
        kind: ``forward``, ``backward``, ``send``, ``recv``, ``pack``, ``wait``, ``unpack``, ...
        microbatch: the microbatch (pack: the bucket), -1 when none.
    """

    rank: int
    start: float
    duration: float
    kind: str
    microbatch: int

    @property
    def text(self) -> str:
        """The label a wide enough bar carries: ``F3``, ``B3``, a bucket's number; "" for none."""
        if self.microbatch < 0 or STYLE.get(self.kind, ("", "busy", ""))[1] != "busy":
            return ""
        prefix = {"forward": "F", "backward": "B"}.get(self.kind, "")
        return f"{prefix}{self.microbatch}"


@dataclass
class Timeline:
    """The events of a run's last steps, in milliseconds from the first of them.

    Attributes:
        bars: the events, by rank then start.
        origin: the run time (seconds since the run began) of 0 ms.
        first_step, last_step: the steps drawn; None when the run file has no step times
            (then every event is drawn).
        step_ends: (step, ms) of rank 0's end of each step drawn.
    """

    bars: list[Bar]
    origin: float
    first_step: int | None
    last_step: int | None
    step_ends: list[tuple[int, float]]

    @property
    def ranks(self) -> int:
        """The rows: one more than the highest rank drawn."""
        return 1 + max((b.rank for b in self.bars), default=-1)

    @property
    def end(self) -> float:
        """Milliseconds to the end of the last bar or step."""
        ends = [b.start + b.duration for b in self.bars] + [t for _, t in self.step_ends]
        return max(ends, default=0.0)


def timeline(
    trace: Mapping[str, Sequence[Any]], metrics: Mapping[str, Sequence[Any]], steps: int = STEPS
) -> Timeline | None:
    """The bars of the last ``steps`` steps of a run's ``trace/``.

    Args:
        trace: ``trace/`` columns: rank, kind, start, end, microbatch (seconds of run time).
        metrics: ``metrics/`` columns; ``step`` and ``time`` (rank 0's end of each step)
            tell the steps apart. Without them every event is drawn.
        steps: how many of the last steps; 0 for every one.

    Returns:
        None when no event falls in the window (or the run has no ``trace/`` events).

    Raises:
        ValueError: ``steps`` is negative.
    """
    if steps < 0:
        raise ValueError(f"steps must be 0 (every step) or more ({steps} < 0)")
    start = np.asarray(trace.get("start", ()), dtype=np.float64)
    n = min((len(trace.get(k, ())) for k in ("rank", "kind", "start", "end", "microbatch")), default=0)
    if not n:
        return None
    step = np.asarray(metrics.get("step", ()), dtype=np.int64)
    time = np.asarray(metrics.get("time", ()), dtype=np.float64)
    rows = min(len(step), len(time))
    i0 = max(0, rows - steps) if steps else 0  # the window's first metrics row
    since = float(time[i0 - 1]) if i0 > 0 else -math.inf  # rank 0's end of the step before it
    first, last = (int(step[i0]), int(step[rows - 1])) if rows else (None, None)
    start = start[:n]
    keep = np.flatnonzero(start >= since)
    if not keep.size:
        return None
    origin = float(start[keep].min())
    end = np.asarray(trace["end"][:n], dtype=np.float64)
    rank = np.asarray(trace["rank"][:n], dtype=np.int64)
    micro = np.asarray(trace["microbatch"][:n], dtype=np.int64)
    kinds = trace["kind"]
    bars = [
        Bar(int(rank[i]), 1e3 * (start[i] - origin), 1e3 * max(0.0, end[i] - start[i]), _text(kinds[i]),
            int(micro[i]))
        for i in keep.tolist()
    ]  # fmt: skip
    bars.sort(key=lambda b: (b.rank, b.start))
    ends = [(int(step[i]), 1e3 * (float(time[i]) - origin)) for i in range(i0, rows) if time[i] >= origin]
    return Timeline(bars, origin, first, last, ends)


def _text(kind: Any) -> str:
    return kind.decode() if isinstance(kind, bytes) else str(kind)


def colors(kinds: Sequence[str]) -> dict[str, str]:
    """Each kind's colour: :data:`STYLE`'s, else the next of a few others (in sorted order)."""
    others = sorted(k for k in set(kinds) if k not in STYLE)
    out = {k: STYLE[k][0] for k in STYLE if k in kinds}
    out.update({k: _OTHER_COLORS[i % len(_OTHER_COLORS)] for i, k in enumerate(others)})
    return out


def height(ranks: int) -> float:
    """The height in inches of one run's panel of ``ranks`` rows (rows thin out past 20 ranks)."""
    return 1.3 + min(0.42 * ranks, 8.5)


def draw(ax: Any, tl: Timeline, name: str, roles: Sequence[str] = ()) -> None:
    """Draw ``tl`` on ``ax``: a row per rank (rank 0 on top), a bar per event, rank 0's step ends.

    Args:
        ax: a matplotlib axes.
        tl: the bars (:func:`timeline`).
        name: the run's label, for the title.
        roles: each rank's role (``stage 1``), shown beside its number when they differ.
    """
    from matplotlib.ticker import MaxNLocator

    present = [b.kind for b in tl.bars]
    order = [k for k in STYLE if k in present] + sorted(set(present) - set(STYLE))
    color = colors(present)
    lanes = _LANES
    if tl.ranks > DENSE:  # sends first, under what occupies the rank
        lanes = dict.fromkeys(_LANES, (0.0, 1.0))
        order.sort(key=lambda k: k != "send")
    for kind in order:
        mine = [b for b in tl.bars if b.kind == kind]
        offset, h = lanes[STYLE.get(kind, ("", "busy", ""))[1]]
        ax.barh([b.rank + offset for b in mine], [b.duration for b in mine], left=[b.start for b in mine],
                height=h, color=color[kind], edgecolor="white", linewidth=0.4 if tl.ranks <= 32 else 0,
                label=STYLE.get(kind, ("", "", kind))[2])  # fmt: skip
    for step, t in tl.step_ends:
        ax.axvline(t, color="0.35", ls=":", lw=1)
        ax.text(t, 1.0, f"step {step} ends ", transform=ax.get_xaxis_transform(), ha="right", va="bottom",
                fontsize="x-small", color="0.3")  # fmt: skip
    n = tl.ranks
    ax.set_ylim(n - 0.5, -0.5)  # rank 0 on top (bars of a dense chart: from r - 0.5 to r + 0.5)
    if n <= 32:
        named = len(set(roles)) > 1 and len(roles) >= n
        ax.set_yticks([r + _LANES["busy"][0] for r in range(n)])
        ax.set_yticklabels([f"rank {r}" + (f" ({roles[r]})" if named else "") for r in range(n)])
    else:
        ax.yaxis.set_major_locator(MaxNLocator(nbins=12, integer=True))
        ax.set_ylabel("rank")
    ax.tick_params(axis="y", length=0)
    ax.set_xlim(0, 1.01 * tl.end if tl.end > 0 else 1.0)
    ax.set_xlabel(f"time (ms) from {tl.origin:.3f} s into the run")
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    if tl.first_step is None:
        steps = "every step"
    elif tl.first_step == tl.last_step:
        steps = f"step {tl.last_step}"
    else:
        steps = f"steps {tl.first_step}-{tl.last_step}"
    ax.set_title(f"{name}: {steps}, one row per rank", fontsize="medium", pad=14)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False)


def label(ax: Any, tl: Timeline) -> int:
    """Write each bar's microbatch (``F3``) on it where it fits; after the layout is final.

    Returns:
        How many bars were labelled.
    """
    box = ax.get_window_extent()
    x0, x1 = ax.get_xlim()
    px_per_ms = box.width / (x1 - x0)
    pt = ax.figure.dpi / 72.0  # pixels per point
    row_px = box.height / max(tl.ranks, 1) * _LANES["busy"][1]
    if row_px < 1.2 * _FONT * pt:
        return 0
    count = 0
    for b in tl.bars:
        text = b.text
        if not text or b.duration * px_per_ms < (0.62 * _FONT * len(text) + 3) * pt:
            continue
        ax.text(b.start + b.duration / 2, b.rank + _LANES["busy"][0], text, ha="center", va="center",
                fontsize=_FONT, color="white", clip_on=True)  # fmt: skip
        count += 1
    return count
