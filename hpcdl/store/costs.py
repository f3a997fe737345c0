"""Per-layer cost tables: a layer's forward and backward seconds, read from a run file's
``profile/`` group or a TOML/CSV table.

The format is the run file's (:mod:`hpcdl.store.runfile` writes ``profile/``); its readers are
the simulator's cost-table compute model (:mod:`hpcdl.sim.compute`) and the pipeline's
time balance (:mod:`hpcdl.parallel.pipe_profile`), neither of which may import the other.
"""

from __future__ import annotations

import csv
import math
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcdl.errors import ConfigError

__all__ = ["CostTableError", "LayerCost", "load_cost_table"]


class CostTableError(ConfigError):
    """A cost table cannot be read, or has no row for a layer the model runs."""


@dataclass(frozen=True)
class LayerCost:
    """One layer's row of a cost table.

    Attributes:
        forward_s: seconds of one forward call at ``batch`` samples.
        backward_s: seconds of one backward call at ``batch`` samples.
        batch: the batch size the costs were measured at (``None``: do not scale by batch).
        kind: the layer's class name (``None``: not checked).
    """

    forward_s: float
    backward_s: float
    batch: int | None = None
    kind: str | None = None


def load_cost_table(path: str | Path) -> dict[str, LayerCost]:
    """Read a per-layer cost table: one :class:`LayerCost` per layer name.

    Formats (chosen by suffix; an unknown suffix is tried as HDF5):

    * **run file** (``.h5``/``.hdf5``): the ``profile/`` group a run with
      ``profile.layers = true`` writes (columns ``layer``, ``kind``, ``forward_s``,
      ``backward_s``, ``output_shape``; the batch is the first dimension of ``output_shape``).
    * **TOML** (``.toml``): an optional top-level ``batch``, then one ``[[layers]]`` table
      per layer with ``layer`` (the name), ``forward_s``, ``backward_s`` and optionally
      ``kind`` and ``batch`` (overrides the top-level one)::

          batch = 32
          [[layers]]
          layer = "0"
          forward_s = 1.4e-4
          backward_s = 1.6e-5

    * **CSV** (``.csv``): a header row naming at least ``layer``, ``forward_s``,
      ``backward_s``; optional ``kind``, ``batch`` or ``output_shape`` (``32x4x8x8``) give
      the kind and the batch; other columns are ignored, so the ``profile/`` group saved
      with pandas' ``to_csv`` reads as is.

    Layer names are the dotted names the per-layer profiler records (``layer.name``:
    ``"0"``, ``"3"``, ``"4.shortcut.0"``). Times are seconds per call, ``>= 0``; without a
    batch, costs are not scaled by the batch size.

    Raises:
        CostTableError: the file is missing, unreadable, empty, or a row is malformed.
    """
    p = Path(path)
    if not p.is_file():
        raise CostTableError(
            f"compute table {path} not found; give a run file made with profile.layers = true, "
            "or a TOML/CSV table (layer, forward_s, backward_s)"
        )
    suffix = p.suffix.lower()
    if suffix == ".toml":
        rows = _read_toml(p)
    elif suffix == ".csv":
        rows = _read_csv(p)
    else:
        rows = _read_runfile(p)
    if not rows:
        raise CostTableError(f"compute table {path} has no layer rows; add at least one")
    return rows


def _read_runfile(p: Path) -> dict[str, LayerCost]:
    import h5py

    if not h5py.is_hdf5(p):
        raise CostTableError(
            f"compute table {p} is not an HDF5 run file; use a .h5 run file, a .toml or a .csv table"
        )
    with h5py.File(p, "r") as h5:
        group = h5.get("profile")
        if not isinstance(group, h5py.Group) or "layer" not in group:
            raise CostTableError(
                f"compute table {p} has no per-layer profile (profile/ is missing or empty); "
                "rerun it with profile.layers = true"
            )
        missing = [c for c in ("layer", "forward_s", "backward_s") if c not in group]
        if missing:
            raise CostTableError(f"compute table {p}: profile/ lacks {', '.join(missing)}; rerun the profile")
        columns: dict[str, list[Any]] = {name: list(group[name][()]) for name in group}
    text = {k: [v.decode() if isinstance(v, bytes) else v for v in vs] for k, vs in columns.items()}
    records = [{k: vs[i] for k, vs in text.items()} for i in range(len(text["layer"]))]
    return _rows(p, records, lambda i: f"profile/ row {i}")


def _read_toml(p: Path) -> dict[str, LayerCost]:
    try:
        doc = tomllib.loads(p.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise CostTableError(f"compute table {p} is not valid TOML ({err})") from None
    layers = doc.get("layers")
    if not isinstance(layers, list) or not all(isinstance(r, dict) for r in layers):
        raise CostTableError(
            f"compute table {p} needs [[layers]] tables with layer, forward_s and backward_s"
        )
    batch = doc.get("batch")
    records = [{"batch": batch, **r} if batch is not None else r for r in layers]
    return _rows(p, records, lambda i: f"[[layers]] #{i + 1}")


def _read_csv(p: Path) -> dict[str, LayerCost]:
    try:
        with p.open(newline="") as f:
            reader = csv.DictReader(f)
            records = [dict(r) for r in reader]
            header = reader.fieldnames or []
    except (csv.Error, UnicodeDecodeError) as err:
        raise CostTableError(f"compute table {p} is not a readable CSV file ({err})") from None
    missing = [c for c in ("layer", "forward_s", "backward_s") if c not in header]
    if missing:
        raise CostTableError(
            f"compute table {p} lacks the column(s) {', '.join(missing)}; "
            "the header must name layer, forward_s, backward_s"
        )
    return _rows(p, records, lambda i: f"line {i + 2}")


def _rows(p: Path, records: list[dict[str, Any]], where: Callable[[int], str]) -> dict[str, LayerCost]:
    """Validate records (dicts) into rows by layer name; errors name the file and the row."""
    rows: dict[str, LayerCost] = {}
    for i, rec in enumerate(records):
        at = f"compute table {p}, {where(i)}"
        name = rec.get("layer")
        if name is None or str(name).strip() == "":
            raise CostTableError(f"{at}: the layer name is missing; give each row its layer name")
        name = str(name).strip()
        if name in rows:
            raise CostTableError(f"{at}: layer {name!r} appears twice; keep one row per layer")
        times = []
        for col in ("forward_s", "backward_s"):
            try:
                v = float(rec.get(col))  # type: ignore[arg-type]
            except (TypeError, ValueError):
                raise CostTableError(
                    f"{at}: {col} of layer {name!r} is {rec.get(col)!r}; give seconds as a number"
                ) from None
            if not math.isfinite(v) or v < 0:
                raise CostTableError(f"{at}: {col} of layer {name!r} is {v}; give a finite time >= 0")
            times.append(v)
        batch = _batch(at, name, rec)
        kind = rec.get("kind")
        kind = (str(kind).strip() or None) if kind is not None else None
        rows[name] = LayerCost(times[0], times[1], batch, kind)
    return rows


def _batch(at: str, name: str, rec: Mapping[str, Any]) -> int | None:
    """The row's batch: its ``batch`` field, else the first dimension of ``output_shape``."""
    raw = rec.get("batch")
    if raw is None or str(raw).strip() == "":
        shape = rec.get("output_shape")
        if shape is None or str(shape).strip() == "":
            return None
        raw = str(shape).strip().strip("()[]").replace(",", "x").split("x")[0]
    try:
        value = float(raw)
    except (TypeError, ValueError):
        value = float("nan")
    if not (math.isfinite(value) and value == int(value) and value >= 1):
        raise CostTableError(f"{at}: batch of layer {name!r} is {raw!r}; give a positive integer")
    return int(value)
