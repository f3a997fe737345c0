"""``model.winograd``: which 3x3 convolutions of a run multiply by Winograd, settled before it starts.

``Conv2d``'s own rule (Winograd when both channel counts are at least
:data:`~hpcdl.nn.conv.WINOGRAD_MIN_CHANNELS`) was measured on one machine, and does not even hold
across shapes there (:mod:`hpcdl.nn.convplan`). With ``model.winograd = "measure"`` (the default)
rank 0 times each eligible layer shape of the model at the run's batch both ways
(:func:`~hpcdl.nn.convplan.time_products`), once per machine: the times are cached in
``$XDG_CACHE_HOME/hpcdl/conv-times.json`` under the CPU, the BLAS (library, version, kernel,
threads) and NumPy, and a later run of those shapes times nothing. ``measure`` settles into
``model.winograd = "layers"`` and ``model.winograd_layers``, the layers where Winograd was
faster, which every rank's model follows, the run file records and a resume takes from the run
it continues (whatever the cache says by then), so that a resumed run computes as it began.
``layers`` can also be given by hand. ``rule`` keeps ``Conv2d``'s rule (and is what a run made
before this key continues with), ``always`` and ``never`` fix every eligible layer.

Timing stops after :data:`BUDGET` seconds (the other ranks wait meanwhile): shapes left, and
shapes that run out of memory, take the rule and are not cached, so that the next run times
them. On a GPU nothing is timed (the cache knows CPUs): the rule chooses. A cache that cannot be
read is timed afresh (one line); one that cannot be written costs a line, not the run.
"""

from __future__ import annotations

import datetime
import math
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from hpcdl.cachefile import cache_dir, entry_key, read_entries, update_entry
from hpcdl.comm.machine import blas, cpu_model
from hpcdl.config import DRIVER_KEYS
from hpcdl.errors import ConfigError, HpcdlError
from hpcdl.nn import Sequential
from hpcdl.nn.convplan import ConvShape, apply, layers, shapes, time_products

__all__ = [
    "MODES", "TIMES_FORMAT", "apply_config", "default_cache", "machine", "measure", "plan_model",
    "settle_winograd",
]  # fmt: skip

#: ``model.winograd``'s values
MODES = DRIVER_KEYS["model.winograd"].choices
#: version of the cache file's layout and of what its times mean: raise it when the convolution
#: kernels change, so that times of the old ones are not reused
TIMES_FORMAT = 1
#: interleaved repetitions per shape and product (the fastest is kept)
REPEAT = 5
#: seconds of timing after which a run times no further shape (it times one at least); the
#: shapes left take the rule, and the next run times them
BUDGET = 60.0
#: Winograd is chosen where its time is below this fraction of im2row's: a near tie is left to
#: im2row, whose results are the reference's bits (the same shape timed six times here moved by
#: up to 30% from one timing to the next, so a tie can come out either way)
MARGIN = 0.95
#: seconds per product and repetition
MIN_TIME = 0.01


def default_cache() -> Path:
    """``$XDG_CACHE_HOME/hpcdl/conv-times.json`` (``~/.cache`` when the variable is unset or empty)."""
    return cache_dir() / "conv-times.json"


def machine() -> dict[str, Any]:
    """What the times depend on besides the shape: the CPU, the BLAS and its threads, NumPy."""
    b = blas()
    return {
        "cpu": cpu_model(),
        "blas": f"{b['library']} {b['version']} {b['kernel']}".strip(),
        "blas_threads": b["threads"],
        "numpy": np.__version__,
    }


def apply_config(model: Sequential, cfg: Any) -> None:
    """Fix each eligible ``Conv2d`` of ``model`` as ``model.winograd`` says (``rule``, and
    ``measure`` before it is settled: ``Conv2d``'s rule)."""
    mode = cfg["model.winograd"]
    if mode == "layers":
        apply(model, cfg["model.winograd_layers"])
    elif mode in ("always", "never"):
        apply(model, _every_or_none(model, mode))


def settle_winograd(cfg: Any, inputs: Any, cache: Path | None = None) -> dict[str, Any]:
    """Rank 0: for ``model.winograd = "measure"``, ``{"model.winograd": "layers",
    "model.winograd_layers": [...]}``, from the cache or timed now (``{"model.winograd": "rule"}``
    on a GPU); on a resume, the mode (and layers) the run settled; {} for the other modes.

    Prints what it chose (and what it timed, and for how long) on stderr.

    Raises:
        ConfigError: ``model.winograd_layers`` set beside another mode than ``layers``, or naming
            what is not an eligible layer of the model.
    """
    mode = cfg["model.winograd"]
    if mode != "layers" and cfg["model.winograd_layers"]:
        raise ConfigError(
            f"model.winograd_layers names the layers of model.winograd = 'layers'; with {mode!r} "
            "leave it unset (or set model.winograd = 'layers')"
        )
    if mode == "layers":
        _check_names(cfg, inputs.model())
    if mode != "measure":
        return {}
    stored: Mapping[str, Any] | None = inputs.stored
    settled = stored.get("model.winograd", "measure") if stored is not None else "measure"
    if settled == "layers":  # a resume: as the run began
        kept = list(stored.get("model.winograd_layers", []))
        return {"model.winograd": "layers", "model.winograd_layers": kept}
    if settled != "measure":  # rule, always, never
        return {"model.winograd": settled}
    if cfg["device"] != "cpu":
        line = "model.winograd = 'measure' times on the CPU only: on a GPU Conv2d's rule chooses"
        print(f"hpcdl.train: {line}", file=sys.stderr, flush=True)
        return {"model.winograd": "rule"}
    chosen, _, lines = measure(
        inputs.model(), inputs.data().input_shape, cfg["data.batch_size"], cfg["dtype"], cache
    )
    for line in lines:
        print(f"hpcdl.train: {line}", file=sys.stderr, flush=True)
    return {"model.winograd": "layers", "model.winograd_layers": chosen}


def _check_names(cfg: Any, model: Sequential) -> None:
    """Refuse ``model.winograd_layers`` names that are not eligible layers of ``model``."""
    eligible = [layer.name for layer in layers(model)]
    wrong = [name for name in cfg["model.winograd_layers"] if name not in eligible]
    if wrong:
        raise ConfigError(
            f"model.winograd_layers names {wrong[0]!r}, not a 3x3 stride-1 convolution of model.name = "
            f"{cfg['model.name']!r}: those are {', '.join(eligible) or 'none'}"
        )


def measure(
    model: Sequential, sample_shape: tuple[int, ...], batch: int, dtype: Any, cache: Path | None = None
) -> tuple[list[str], int, list[str]]:
    """The layers of ``model`` where Winograd is faster (by :data:`MARGIN`) at ``batch`` samples of
    ``sample_shape`` (in model order), by the cached times of their shapes or times taken now (and
    cached); how many layers are eligible; and the lines to tell (what was timed, for how long,
    what was chosen)."""
    found = shapes(model, sample_shape, batch, np.dtype(dtype))
    if not found:
        return [], 0, []
    path = cache or default_cache()
    times, lines = _times(path, {s.key: s for s in found.values()})
    faster = {k: t["winograd"] < MARGIN * t["im2row"] for k, t in times.items()}
    rule = {layer.name: layer.winograd_by_rule for layer in layers(model)}
    chosen = [name for name, s in found.items() if faster.get(s.key, rule[name])]
    shown = ", ".join(chosen) if len(chosen) <= 4 else f"{', '.join(chosen[:3])}, …"
    lines.append(
        f"model.winograd = 'measure': Winograd on {len(chosen)} of {len(found)} eligible 3x3 layers"
        + (f" ({shown})" if chosen else "")
        + ", by their times on this machine"
    )
    return chosen, len(found), lines


def plan_model(  # noqa: PLR0917 (measure's arguments and the mode)
    model: Sequential,
    mode: str,
    sample_shape: tuple[int, ...],
    batch: int,
    dtype: Any,
    cache: Path | None = None,
) -> list[str]:
    """Fix each eligible ``Conv2d`` of ``model`` as ``mode`` (a ``model.winograd`` value) says,
    measuring where it is ``measure`` (:func:`measure`): what a run settles, for a model built
    outside a run (``bench step``). Returns the lines :func:`measure` tells."""
    if mode == "measure":
        chosen, _, lines = measure(model, sample_shape, batch, dtype, cache)
        apply(model, chosen)
        return lines
    if mode not in ("rule", "always", "never"):
        raise ValueError(f"plan_model: mode {mode!r} is not measure, rule, always or never")
    if mode != "rule":
        apply(model, _every_or_none(model, mode))
    return []


def _every_or_none(model: Sequential, mode: str) -> list[str]:
    """The layers ``always`` (every eligible one) or ``never`` (none) names."""
    return [layer.name for layer in layers(model)] if mode == "always" else []


def _times(path: Path, wanted: dict[str, ConvShape]) -> tuple[dict[str, dict[str, float]], list[str]]:
    """The two products' seconds for each shape in ``wanted``: cached, or timed now and cached
    (a shape that runs out of memory is left out); and the lines to tell."""
    here = machine()
    key = entry_key(here)
    entries, why = read_entries(path, TIMES_FORMAT, "a convolution timings cache")
    lines = [f"model.winograd: {path} {why}; timing again"] if why else []
    entry = entries.get(key)
    cached = _times_of(entry, here)
    times = {k: cached[k] for k in wanted if _usable(cached.get(k))}
    missing = [s for k, s in wanted.items() if k not in times]
    if not missing:
        return times, lines
    t0 = time.perf_counter()
    timed: dict[str, dict[str, float]] = {}
    for i, s in enumerate(missing):
        if i and time.perf_counter() - t0 > BUDGET:  # one shape at least: each run gets further
            lines.append(
                f"model.winograd: {len(missing) - i} layer shape{'s' * (len(missing) - i != 1)} not timed "
                f"within {BUDGET:g} s: Conv2d's rule chooses there (the next run times them)"
            )
            break
        try:
            timed[s.key] = time_products(s, repeat=REPEAT, min_time=MIN_TIME)
        except MemoryError:  # the run itself will tell, in its own words, if it cannot fit either
            lines.append(f"model.winograd: {s.key} not timed (out of memory): Conv2d's rule chooses there")
    seconds = time.perf_counter() - t0
    times.update(timed)
    if not timed:
        return times, lines
    date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")

    def merged(old: Any) -> dict[str, Any]:
        kept = _times_of(old, here)
        return {"machine": here, "times": {**kept, **timed}, "date": date}

    try:
        update_entry(path, key, merged, TIMES_FORMAT, what="the convolution timings cache")
        where = f"cached in {path}"
    except (OSError, HpcdlError) as err:
        where = f"not cached: {err}"
    lines.append(
        f"model.winograd: timed {len(timed)} layer shape{'s' * (len(timed) != 1)} both ways in "
        f"{seconds:.1f} s ({where})"
    )
    return times, lines


def _times_of(entry: Any, here: Mapping[str, Any]) -> dict[str, Any]:
    """A cache entry's times by shape, if it is one of this machine's (else none)."""
    mine = isinstance(entry, dict) and entry.get("machine") == dict(here)
    return entry["times"] if mine and isinstance(entry.get("times"), dict) else {}


def _usable(times: Any) -> bool:
    """Whether a cached shape's times are two positive numbers."""
    return isinstance(times, dict) and all(
        isinstance(times.get(k), int | float) and math.isfinite(times[k]) and times[k] > 0
        for k in ("im2row", "winograd")
    )
