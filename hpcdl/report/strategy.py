"""What the report reads of a run's strategy: samples per step, the parameter servers' mode, τ histograms.

Runs of different strategies are compared at equal samples processed and at equal time,
never at equal steps (DESIGN.md): a ``ps`` step is one worker's push, a ``sync`` step
is every member's batch. These functions are pure (attributes and arrays in, data out),
so that what the plots draw is tested as data.
"""

from __future__ import annotations

import json
import tomllib
from typing import Any

import numpy as np

__all__ = [
    "samples_per_step",
    "samples_processed",
    "config_value",
    "workers",
    "roles",
    "micro_steps",
    "mode_label",
    "tau_histogram",
]


def samples_per_step(attrs: dict[str, Any]) -> int | None:
    """Training samples one metrics step stands for, from the ``placement`` attribute.

    For ``ps`` a step is one push of ``batch_size`` samples; for every other strategy
    it is ``width x micro_steps x batch_size``, the width being the number of distinct
    data-parallel members (``member >= 0``).

    Returns:
        None when the file has no placement (written before placements were stored) or
        it cannot be read.
    """
    text = attrs.get("placement")
    if not text:
        return None
    try:
        placement = json.loads(text)
        batch = int(placement["batch_size"])
        if placement.get("strategy", attrs.get("strategy")) == "ps":
            return batch
        width = len({int(r["member"]) for r in placement["ranks"] if int(r["member"]) >= 0})
        return width * int(placement.get("micro_steps", 1)) * batch
    except (ValueError, TypeError, KeyError):
        return None


def samples_processed(metrics: dict[str, np.ndarray], attrs: dict[str, Any]) -> np.ndarray | None:
    """Training samples processed up to and including each metrics row.

    The recorded ``metrics/samples`` where it has a value; older files (and rows a writer
    left at 0) get ``step x`` :func:`samples_per_step`.

    Returns:
        int64 array, one value per row; None when neither is known.
    """
    step = metrics.get("step")
    if step is None:
        return None
    per_step = samples_per_step(attrs)
    computed = None if per_step is None else np.asarray(step, dtype=np.int64) * per_step
    recorded = metrics.get("samples")
    if recorded is None:
        return computed
    recorded = np.asarray(recorded, dtype=np.int64)
    if computed is None:
        return recorded
    return np.where((recorded > 0) | (step <= 0), recorded, computed)


def config_value(attrs: dict[str, Any], key: str, default: Any = None) -> Any:
    """A setting of the run's config (the ``config`` attribute, TOML), such as ``parallel.mode``."""
    try:
        value: Any = tomllib.loads(str(attrs.get("config", "")))
    except tomllib.TOMLDecodeError:
        return default
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return default
        value = value[part]
    return value


def workers(attrs: dict[str, Any]) -> int | None:
    """The number of ranks whose role is ``worker`` in the ``placement`` attribute (None: unknown)."""
    try:
        ranks = json.loads(attrs.get("placement") or "null")["ranks"]
        return sum(1 for r in ranks if r["role"] == "worker") or None
    except (ValueError, TypeError, KeyError):
        return None


def roles(attrs: dict[str, Any]) -> list[str]:
    """Each rank's role in the ``placement`` attribute (``stage 0``, ``worker``, ...); empty when unknown."""
    try:
        return [str(r["role"]) for r in json.loads(attrs.get("placement") or "null")["ranks"]]
    except (ValueError, TypeError, KeyError):
        return []


def micro_steps(attrs: dict[str, Any]) -> int | None:
    """The placement's microbatches (or accumulated batches) per step; None when unknown."""
    try:
        m = json.loads(attrs.get("placement") or "null")["micro_steps"]
    except (ValueError, TypeError, KeyError):
        return None
    return m if isinstance(m, int) and m > 0 else None


def mode_label(attrs: dict[str, Any]) -> str:
    """How a run exchanges, for legends: ``async``, ``ssp s=1``, ``sync`` for ``ps`` runs.

    A ``ps`` run names its ``parallel.mode`` (with ``s`` for ``ssp``) and its
    ``parallel.compensation`` when not ``none`` (``async, dc``); any other run names its
    strategy.
    """
    strategy = attrs.get("strategy") or config_value(attrs, "parallel.strategy", "sync")
    if strategy != "ps":
        return str(strategy)
    mode = str(config_value(attrs, "parallel.mode", "async"))
    label = f"ssp s={config_value(attrs, 'parallel.staleness', '?')}" if mode == "ssp" else mode
    compensation = config_value(attrs, "parallel.compensation", "none")
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
