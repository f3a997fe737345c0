"""What the report reads of a run's strategy: samples per step, its label, what it declares.

Runs of different strategies are compared at equal samples processed and at equal time,
never at equal steps (docs/design.md, training semantics): a ``ps`` step is one worker's push, a ``sync`` step
is every member's batch — the placement the file stores says which. What a strategy
draws and how it labels its runs, it declares (:mod:`hpcdl.components`); the report
never names a strategy. These functions are pure (attributes and arrays in, data out),
so that what the plots draw is tested as data.
"""

from __future__ import annotations

import json
import tomllib
import warnings
from typing import Any

import numpy as np

from hpcdl.components import Declares, declared
from hpcdl.config import stored_values
from hpcdl.errors import ConfigError

__all__ = [
    "samples_per_step",
    "samples_processed",
    "config_value",
    "workers",
    "roles",
    "micro_steps",
    "mode_label",
    "run_config",
    "runs_free",
    "strategy_declares",
]


def samples_per_step(attrs: dict[str, Any]) -> int | None:
    """Training samples one metrics step stands for, from the ``placement`` attribute.

    A step is ``step_batches x batch_size`` where the placement has step batches (a
    parameter server's step is one push: 1), else ``width x micro_steps x batch_size``,
    the width being the number of distinct data-parallel members (``member >= 0``).

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
        if int(placement.get("step_batches", 0)) > 0:
            return int(placement["step_batches"]) * batch
        if "step_batches" not in placement and runs_free(attrs):  # placements before step_batches
            return batch  # (hpcdl of 2026-11-24): a free-running strategy's step was one push
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
    """A setting of the run's config (the ``config`` attribute, TOML), such as ``ps.mode``."""
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


def runs_free(attrs: dict[str, Any]) -> bool:
    """The run's strategy runs free (its steps are pushes), as far as this hpcdl knows it."""
    from hpcdl.parallel import strategy_class  # noqa: PLC0415 (the registry's classes, on demand)

    name = run_config(attrs).get("parallel.strategy") or attrs.get("strategy") or "sync"
    try:
        return bool(strategy_class(str(name)).runs_free)
    except ConfigError:
        return False


def run_config(attrs: dict[str, Any]) -> dict[str, Any]:
    """The run's config values by dotted key, under their names now (``parallel.mode`` is
    ``ps.mode``); empty when the file has none or it is damaged."""
    try:
        return stored_values(str(attrs.get("config", "")))
    except ConfigError:
        return {}


def strategy_declares(attrs: dict[str, Any]) -> Declares:
    """What the run's strategy declares (its plots, its legend); nothing when it is unknown here
    (an outside ``module:Class`` that cannot be imported, say)."""
    name = run_config(attrs).get("parallel.strategy") or attrs.get("strategy") or "sync"
    try:
        return declared(str(name))
    except ConfigError:
        return Declares()


def mode_label(attrs: dict[str, Any]) -> str:
    """How a run trains, for legends: its strategy's declared label (a ``ps`` run's mode:
    ``async``, ``ssp s=1``, ``async, dc``), else the strategy's name."""
    legend = strategy_declares(attrs).legend
    if legend is not None:
        return legend(run_config(attrs))
    return str(attrs.get("strategy") or run_config(attrs).get("parallel.strategy", "sync"))


def __getattr__(name: str) -> Any:
    if name == "tau_histogram":  # moved: the parameter server's own (hpcdl.parallel.ps_schema)
        from hpcdl.parallel import ps_schema  # noqa: PLC0415

        warnings.warn("tau_histogram is hpcdl.parallel.ps_schema.tau_histogram now", DeprecationWarning,
                      stacklevel=2)  # fmt: skip
        return ps_schema.tau_histogram
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
