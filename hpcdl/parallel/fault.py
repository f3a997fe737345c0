"""The instability model: which ranks are offline at which step, a pure function of the config.

A *schedule* is a boolean table ``offline[step, rank]`` (steps 0-based, as a strategy's
``step(step)`` counts them). It comes from one of two sources, the ``[fault]`` keys:

* **drawn** (``fault.p > 0``): one stream from ``(seed, "fault")``; at each step, for each
  rank in order, two numbers are drawn whatever the rank's state — ``u`` uniform in [0, 1)
  and a duration ``d`` uniform in ``1..fault.max_duration``. A rank online at ``t`` and at
  ``t - 1`` (an outage is followed by a step online at least) with ``u < p`` goes offline for
  steps ``t .. t + d - 1``, unless ``fault.max_concurrent`` ranks are offline already at
  ``t`` (the draw is skipped). Because every step consumes the same draws, the first ``T``
  rows are the same whatever the run's length: the schedule is the same on every rank,
  without communication, and across a resume (even one that changes ``train.steps``).
* **a file** (``fault.schedule``): CSV lines ``rank,start,end`` (an optional header line), the
  rank offline at steps ``start .. end`` inclusive.

The model itself neither communicates nor keeps state: a strategy asks :func:`fault_model`
once, at build. Which strategies honour it is theirs to say
(:attr:`hpcdl.parallel.Strategy.faults`); the others refuse ``fault.*``
(:func:`hpcdl.parallel.strategy.check_keys`). ``local`` leaves offline ranks out of its
averaging rounds; ``sync`` — the baseline that cannot leave anyone out — makes them
:class:`HoldBack` their contribution, so the others wait.

**Sync under faults: the wait model.** A rank offline at step ``t`` holds back its gradients
for one step's time ``h`` before its exchange finishes (:func:`hpcdl.comm.sleep`, a real sleep
under MPI and the virtual clock moved in the simulator); the other ranks wait in the
collective. The step counter goes on as if nothing happened: an outage costs time, not
samples. So a run of ``T`` steps takes ``Σ_t s_t + h · |{t : some rank offline at t}|``
(:func:`sync_wait_s`): ranks offline at the same step hold back at the same time, and an
outage of ``d`` steps costs ``d · h``. ``h`` is ``fault.step_s``, or (0) measured on the fly:
the rank's own time of its previous step outside communication (forward, backward, update:
the step's wall time less its time in the exchange and its own hold), and at its first step
the time of that step so far (forward and backward). The exchange is left out because it
holds the waits for other ranks: a step time taken with them would feed each outage's wait
into the next (at N = 16 and p = 0.1 some rank is offline at nearly every step, so a
fault-free step to measure may never come). On-the-fly ``h`` is thus short of a whole step
by its exposed communication; set ``fault.step_s`` (a fault-free run's step time, say) for
the wait model with a whole step.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hpcdl.comm import sleep, wtime
from hpcdl.components import Declares, Key, Plot
from hpcdl.errors import ConfigError
from hpcdl.rng import generator

__all__ = [
    "DECLARES",
    "FAULT_KEYS",
    "FaultModel",
    "HoldBack",
    "check",
    "draw",
    "fault_model",
    "faults_figure",
    "read_schedule",
    "sync_wait_s",
]

#: the fault model's config section (a shared component: every run has it, off by default)
DECLARES = Declares(
    keys={
        "fault.p": Key(
            float,
            0.0,
            "probability per step that an online rank goes offline (0: no drawn faults)",
            minimum=0.0,
            below=1.0,
        ),
        "fault.max_duration": Key(
            int, 5, "an outage lasts a whole number of steps drawn uniformly from 1 to this", minimum=1
        ),
        "fault.max_concurrent": Key(
            int,
            0,
            "most ranks offline at once, < N (0: N - 1); a draw that would exceed it is skipped",
            minimum=0,
        ),
        "fault.schedule": Key(
            str, "", "a CSV file of outages 'rank,start,end' (steps, inclusive) instead of drawing them"
        ),
        "fault.step_s": Key(
            float,
            0.0,
            "sync under faults: seconds an offline rank holds back its gradients per step offline "
            "(0: its previous step's time outside communication, measured on the fly)",
            minimum=0.0,
        ),
    },  # fmt: skip
    # fault.step_s moves time, not the trajectory: a resume may change it
    fit_keys=("fault.p", "fault.max_duration", "fault.max_concurrent", "fault.schedule"),
    plots=(Plot("faults", lambda runs: faults_figure(runs)),),  # noqa: PLW0108 (defined below)
)
#: the keys of the section
FAULT_KEYS: tuple[str, ...] = tuple(DECLARES.keys)


def active(cfg: Any) -> bool:
    """Whether the config asks for faults (``fault.p > 0`` or a schedule file)."""
    return cfg["fault.p"] > 0 or bool(cfg["fault.schedule"])


def cap(cfg: Any, world: int) -> int:
    """``fault.max_concurrent`` on ``world`` ranks (0: ``world - 1``)."""
    return cfg["fault.max_concurrent"] or world - 1


def check(cfg: Any, world: int) -> None:
    """Refuse ``[fault]`` values that do not fit ``world`` ranks (reads the schedule file, if any).

    Raises:
        ConfigError: one line: a cap of ``world`` or more, both ``fault.p`` and a schedule, or a
            schedule file that cannot be read or is wrong (:func:`read_schedule`).
    """
    if cfg["fault.max_concurrent"] >= world:
        raise ConfigError(
            f"fault.max_concurrent = {cfg['fault.max_concurrent']} on {world} ranks: at most {world - 1} "
            "(one rank stays online; 0 means N - 1)"
        )
    if cfg["fault.schedule"]:
        if cfg["fault.p"] > 0:
            raise ConfigError(
                f"fault.p = {cfg['fault.p']} and fault.schedule = {cfg['fault.schedule']!r}: set one of them"
            )
        read_schedule(cfg["fault.schedule"], world)


def read_schedule(path: str | Path, world: int) -> list[tuple[int, int, int]]:
    """The outages of a schedule file: ``(rank, start, end)`` rows, steps inclusive, sorted.

    Raises:
        ConfigError: the file is missing, a line is not three integers, a rank is not in
            ``0..world-1``, a start is negative or after its end, or two outages of one rank overlap.
    """
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"fault.schedule = {str(path)!r} cannot be read ({e.strerror})") from None
    rows: list[tuple[int, int, int]] = []
    for n, line in enumerate(csv.reader(text.splitlines()), start=1):
        if not line or not "".join(line).strip() or line[0].lstrip().startswith("#"):
            continue
        try:
            rank, start, end = (int(x) for x in line)
        except ValueError:
            if n == 1 and [x.strip() for x in line] == ["rank", "start", "end"]:
                continue  # the header
            raise ConfigError(
                f"fault.schedule {path} line {n}: {','.join(line)!r} is not 'rank,start,end' (integers)"
            ) from None
        if not 0 <= rank < world:
            raise ConfigError(f"fault.schedule {path} line {n}: rank {rank} on {world} ranks (0-{world - 1})")
        if start < 0 or start > end:
            raise ConfigError(f"fault.schedule {path} line {n}: start {start} > end {end} (or negative)")
        rows.append((rank, start, end))
    rows.sort()
    for (r0, s0, e0), (r1, s1, e1) in zip(rows, rows[1:]):
        if r0 == r1 and s1 <= e0:
            raise ConfigError(
                f"fault.schedule {path}: rank {r0}'s outages {s0}-{e0} and {s1}-{e1} overlap (merge them)"
            )
    return rows


def draw(seed: int, world: int, steps: int, p: float, max_duration: int, most: int) -> np.ndarray:
    """The drawn schedule ``offline[step, rank]`` for ``steps`` steps (module docstring).

    Args:
        seed: the run's seed.
        world: the ranks.
        steps: the steps to draw (the first rows do not depend on it).
        p: the probability per step that an online rank goes offline.
        max_duration: the longest outage, in steps.
        most: the most ranks offline at once.
    """
    offline = np.zeros((steps, world), dtype=bool)
    if p <= 0:
        return offline
    rng = generator(seed, "fault")
    remaining = np.zeros(world, dtype=np.int64)  # steps of its outage a rank still has, this one included
    for t in range(steps):
        u = rng.random(world)
        d = rng.integers(1, max_duration + 1, size=world)
        down = int((remaining > 0).sum())
        back = offline[t - 1] if t else np.zeros(world, dtype=bool)  # online again at t: not drawn yet
        for r in range(world):
            if remaining[r] == 0 and not back[r] and u[r] < p and down < most:
                remaining[r] = d[r]
                down += 1
        offline[t] = remaining > 0
        remaining = np.maximum(remaining - 1, 0)
    return offline


@dataclass(frozen=True)
class FaultModel:
    """A run's schedule: ``offline[step, rank]`` for its steps (a step past them: every rank online).

    Attributes:
        offline: (steps, ranks) booleans.
    """

    offline: np.ndarray

    @property
    def world(self) -> int:
        """The ranks."""
        return int(self.offline.shape[1])

    def is_online(self, step: int, rank: int) -> bool:
        """Whether ``rank`` is online at step ``step`` (0-based)."""
        return not (0 <= step < len(self.offline) and bool(self.offline[step, rank]))

    def online(self, step: int) -> tuple[int, ...]:
        """The ranks online at step ``step``, ascending."""
        return tuple(r for r in range(self.world) if self.is_online(step, r))

    def outages(self) -> list[tuple[int, int, int]]:
        """Every outage as ``(rank, start, end)`` (inclusive), by rank then start."""
        out = []
        for r in range(self.world):
            col = np.concatenate([[False], self.offline[:, r], [False]]).astype(np.int8)
            edges = np.flatnonzero(np.diff(col))
            out += [(r, int(s), int(e) - 1) for s, e in zip(edges[::2], edges[1::2])]
        return out

    def summary(self) -> list[str]:
        """``--plan``'s lines: the realised offline fraction per rank, the longest outage, the most
        ranks offline at once."""
        steps = len(self.offline)
        frac = self.offline.mean(axis=0) if steps else np.zeros(self.world)
        outages = self.outages()
        longest = max((e - s + 1 for _, s, e in outages), default=0)
        most = int(self.offline.sum(axis=1).max()) if steps else 0
        shown = ", ".join(f"{f:.3f}" for f in frac[:16]) + (", ..." if self.world > 16 else "")
        return [
            f"faults over {steps} steps: {len(outages)} outages; offline fraction {float(frac.mean()):.3f} "
            f"of rank-steps; longest outage {longest} steps; most ranks offline at once {most}",
            f"offline fraction per rank: {shown}",
        ]


def fault_model(cfg: Any, world: int, steps: int) -> FaultModel | None:
    """The config's schedule over ``steps`` steps on ``world`` ranks; None: no faults.

    Raises:
        ConfigError: as :func:`check`.
    """
    if not active(cfg):
        return None
    check(cfg, world)
    if cfg["fault.schedule"]:
        offline = np.zeros((steps, world), dtype=bool)
        for rank, start, end in read_schedule(cfg["fault.schedule"], world):
            offline[start : end + 1, rank] = True
        return FaultModel(offline)
    p, longest = cfg["fault.p"], cfg["fault.max_duration"]
    return FaultModel(draw(cfg["seed"], world, steps, p, longest, cap(cfg, world)))


def sync_wait_s(offline: np.ndarray, hold_s: float) -> float:
    """The wait model's extra time (module docstring): ``hold_s`` for each step at which some rank
    is offline (``offline[step, rank]``)."""
    return hold_s * int(np.asarray(offline).any(axis=1).sum()) if np.size(offline) else 0.0


class HoldBack:
    """Sync under faults: this rank's outages as time (the module docstring's wait model).

    The strategy calls :meth:`begin` when a step starts, :meth:`hold` just before its
    exchange finishes (it sleeps when the rank is offline at that step) and :meth:`end` after
    the update (it measures the step's time outside communication).

    Args:
        model: the run's schedule.
        rank: this rank.
        step_s: the hold per offline step; 0: measured on the fly.
    """

    def __init__(self, model: FaultModel, rank: int, step_s: float = 0.0) -> None:
        self.model, self.rank, self.step_s = model, rank, step_s
        self.measured: float | None = None  # the previous step's time outside communication
        self._start = 0.0
        self.held = 0.0  # seconds held back at the current step

    def online(self, step: int) -> bool:
        """Whether this rank is online at ``step``."""
        return self.model.is_online(step, self.rank)

    def begin(self, step: int) -> None:
        """A step starts."""
        self._start = wtime()
        self.held = 0.0

    def hold(self, step: int) -> float:
        """Before the exchange finishes: offline at ``step``, sleep one step's time; the seconds held."""
        if self.online(step):
            return 0.0
        h = self.step_s or (self.measured if self.measured is not None else wtime() - self._start)
        sleep(h)
        self.held = h
        return h

    def end(self, step: int, comm_s: float) -> None:
        """After the update: the step's time less ``comm_s`` (its time in the exchange) and its hold
        is the next hold (measured on the fly)."""
        self.measured = max(0.0, wtime() - self._start - comm_s - self.held)


#: most runs whose schedule the figure draws (the accuracy panel has them all)
_RASTERS = 8


def faults_figure(runs: list[tuple[Any, str]]) -> Any:
    """The report's ``faults.png``: each run's offline schedule as a raster (rank × samples
    processed, dark: offline; ``ranks/online``) above the runs' test accuracy against samples
    processed — runs compare at equal samples — and, for runs with rounds (``local``), the
    members' median divergence from the round's mean. None when no run has ``ranks/online``.

    Args:
        runs: ``(run, label)`` pairs (:class:`hpcdl.report.Run`: ``ranks``, ``metrics``, ``samples``).
    """
    with_mask = [(r, n) for r, n in runs if "online" in r.ranks and len(r.ranks["online"])]
    if not with_mask:
        return None
    import matplotlib.pyplot as plt  # noqa: PLC0415 (the report's, at draw time only)

    shown = [(r, n) for r, n in with_mask if (r.ranks["online"] == 0).any()][:_RASTERS]
    diverging = [(r, n) for r, n in with_mask if np.isfinite(r.ranks.get("divergence", [[np.nan]])).any()]
    heights = [min(2.0, 0.4 + 0.08 * r.ranks["online"].shape[1]) for r, _ in shown] + [3.0] * (
        1 + bool(diverging)
    )
    fig, axes = plt.subplots(len(heights), 1, figsize=(9, sum(heights) + 0.6), sharex=True,
                             height_ratios=heights, squeeze=False)  # fmt: skip
    axes = axes[:, 0]

    def x_of(run: Any) -> np.ndarray:
        got = run.samples if run.samples is not None else run.metrics["step"] + 1
        return np.asarray(got, dtype=np.float64)

    for ax, (run, name) in zip(axes, shown):
        offline = run.ranks["online"] == 0  # steps, ranks
        x = x_of(run)
        first = x[0] - (x[1] - x[0] if len(x) > 1 else x[0])
        ax.imshow(offline.T, aspect="auto", cmap="Greys", interpolation="nearest", vmin=0, vmax=1,
                  extent=(first, x[len(offline) - 1], offline.shape[1] - 0.5, -0.5))  # fmt: skip
        ax.set_ylabel("rank", fontsize="small")
        ax.set_title(f"{name}: offline {offline.mean():.1%} of rank-steps (dark: offline)", fontsize="small")
    acc = axes[len(shown)]
    for run, name in runs:
        m = run.metrics
        ok = np.isfinite(m.get("test_accuracy", np.array([])))
        if ok.any():
            frac = float((run.ranks["online"] == 0).mean()) if "online" in run.ranks else 0.0
            acc.plot(x_of(run)[ok], 100 * m["test_accuracy"][ok], "o-", ms=3,
                     label=f"{name} (offline {frac:.1%})")  # fmt: skip
    acc.set_ylabel("test accuracy (%)")
    acc.grid(alpha=0.3)
    acc.legend(fontsize="small")
    if diverging:
        ax = axes[-1]
        for run, name in diverging:
            d = run.ranks["divergence"]
            rounds = np.isfinite(d).any(axis=1)
            median = np.array([np.median(row[np.isfinite(row)]) for row in d[rounds]])
            ax.plot(x_of(run)[: len(d)][rounds], median, lw=1, label=name)
        ax.set_yscale("log")
        ax.set_ylabel("divergence ‖w_r − w̄‖/‖w̄‖\n(members' median, before a round)", fontsize="small")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize="small")
    axes[-1].set_xlabel("training samples processed")
    return fig
