"""What the parameter-server strategy declares (:class:`hpcdl.components.Declares`): its config
section ``[ps]``, the keys that fix its trajectory, its ``staleness/`` row table, its label in
the report's legends and the report's staleness figure; and how the conformance suite runs it
(:data:`CONFORMANCE`).

``[ps]`` was ``parallel.servers``, ``parallel.mode``, ... before run-file format 2: those names
are still read (:attr:`~hpcdl.components.Declares.renamed`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from hpcdl.components import Declares, Key, Plot, Table
from hpcdl.parallel.conformance import Case, Conformance
from hpcdl.parallel.ps_plan import max_staleness

__all__ = [
    "CONFORMANCE",
    "DECLARES",
    "legend",
    "master_parameters",
    "sync_data_parallel",
    "staleness_figure",
    "tau_histogram",
]

#: the section's keys
KEYS: dict[str, Key] = {
    "ps.servers": Key(
        int, 1, "parameter servers (ranks 0 .. S-1), each holding a shard of the parameters", minimum=1
    ),
    "ps.mode": Key(
        str,
        "async",
        "async (apply pushes on arrival), ssp (bounded staleness) or sync (sum the W pushes of a round)",
        choices=("async", "ssp", "sync"),
    ),
    "ps.staleness": Key(
        int, 1, "ssp: the bound s (a worker at clock c waits until every clock is >= c - s)", minimum=0
    ),
    "ps.compensation": Key(
        str,
        "none",
        "none, lr (the push's lr divided by max(tau, 1)) or dc (DC-ASGD's delay compensation)",
        choices=("none", "lr", "dc"),
    ),
    "ps.dc_lambda": Key(float, 0.04, "dc: lambda of g + lambda g*g*(w_now - w_used)", minimum=0.0),
}


def legend(config: Mapping[str, Any]) -> str:
    """A ps run's label: its mode (``ssp s=1``), and its compensation when not ``none`` (``async, dc``)."""
    mode = str(config.get("ps.mode", "async"))
    label = f"ssp s={config.get('ps.staleness', '?')}" if mode == "ssp" else mode
    compensation = config.get("ps.compensation", "none")
    return label if compensation in (None, "none") else f"{label}, {compensation}"


def tau_histogram(tau: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distribution of staleness over integer bins, as fractions of the applied pushes.

    Args:
        tau: one τ per applied push and server (``staleness/tau``).

    Returns:
        ``(values, frequency)``: every integer from ``min(0, min τ)`` to ``max τ``, and
        the fraction of the rows with that τ (summing to 1; zero for values never seen),
        so that runs of different lengths compare. Both empty when ``tau`` is.
    """
    tau = np.asarray(tau, dtype=np.int64)
    if not tau.size:
        return np.zeros(0, dtype=np.int64), np.zeros(0)
    low = min(0, int(tau.min()))
    counts = np.bincount(tau - low)
    return np.arange(low, low + len(counts), dtype=np.int64), counts / tau.size


def ssp_bound(config: Mapping[str, Any], workers: int | None) -> int | None:
    """The largest τ SSP allows, ``(W - 1)(2 s + 1)`` (None: not ssp, or unknown)."""
    s = config.get("ps.staleness")
    if config.get("ps.mode") != "ssp" or not isinstance(s, int) or not workers:
        return None
    return max_staleness(workers, s)


def staleness_figure(runs: list[tuple[Any, str]]) -> Any:
    """Each run's τ histogram (integer bins, fractions of its applied pushes, log y), SSP's bound dashed;
    None when no run has ``staleness/`` rows."""
    stale = [(r, n) for r, n in runs if len(r.tables.get("staleness", {}).get("tau", ()))]
    if not stale:
        return None
    import matplotlib.pyplot as plt  # noqa: PLC0415 (the report's, at draw time only)
    from matplotlib.ticker import MaxNLocator  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(7, 4.5))
    smallest = 1.0
    for run, name in stale:
        values, frequency = tau_histogram(run.tables["staleness"]["tau"])
        label = f"{name}: {legend(run.config)}"
        bound = ssp_bound(run.config, run.workers)
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
    return fig


#: what ps declares
DECLARES = Declares(
    keys=KEYS,
    fit_keys=tuple(KEYS),
    tables={
        "staleness": Table(
            {"update": np.int64, "worker": np.int32, "server": np.int32, "tau": np.int64, "time": np.float64},
            cut_by="update",
        )
    },
    plots=(Plot("staleness", staleness_figure),),
    legend=legend,
    series={"pushes_per_s": "pushes per second", "busy_fraction": "busy fraction"},
    rate="pushes_per_s",
    step_name="push",
    renamed={f"parallel.{key.partition('.')[2]}": key for key in KEYS},
)


def sync_data_parallel(cfg: Any, world: int) -> tuple[dict[str, Any], int]:
    """The run ps in ``sync`` mode on ``world`` ranks is equivalent to: sync data parallel over
    its W workers on the same batches, a step per round of W pushes."""
    workers = world - cfg["ps.servers"]
    return {"parallel.strategy": "sync", "train.steps": cfg["train.steps"] // workers}, workers


def master_parameters(pieces: Mapping[str, Any], names: Sequence[str]) -> np.ndarray:
    """The master parameters in the model's order: the servers' shards (pieces ``shard k``) end to end."""
    shards = sorted((int(name.split()[1]), piece["params"]["shard"]) for name, piece in pieces.items())
    return np.concatenate([shard for _, shard in shards])


#: how the conformance suite runs ps: ``sync`` mode repeats itself and sync data parallel in
#: both worlds; ``async`` repeats itself only where arrival order is fixed (the simulator, costs
#: from a table)
CONFORMANCE = Conformance(
    {
        "sync": Case(
            {"ps.mode": "sync", "train.steps": 12, "checkpoint.every": 6},
            reference=sync_data_parallel,
            tolerance=1e-10,
        ),
        "async": Case({"ps.mode": "async"}, deterministic=("sim",), compute="table"),
    },
    min_ranks=2,
    parameters=master_parameters,
    timing=("staleness/time",),
)
