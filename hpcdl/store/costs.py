"""Per-layer cost tables: a layer's forward and backward seconds, read from a run file's
``profile/`` group or a TOML/CSV table; and the optional rows of *ops* (K-FAC's factors,
eigendecompositions and preconditioning: :func:`hpcdl.nn.hooks.op`), measured at some sizes and
interpolated in between (:class:`OpCosts`).

The format is the run file's (:mod:`hpcdl.store.runfile` writes ``profile/``); its readers are
the simulator's cost-table compute model (:mod:`hpcdl.sim.compute`) and the pipeline's
time balance (:mod:`hpcdl.parallel.pipe_profile`), neither of which may import the other.
"""

from __future__ import annotations

import bisect
import csv
import math
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcdl.errors import ConfigError

__all__ = [
    "OPS",
    "CostTableError",
    "LayerCost",
    "OpCost",
    "OpCosts",
    "load_cost_table",
    "load_op_costs",
    "op_work",
]


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
        rows = _read_csv(p)[0]
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
        # columns only: profile/ops/ is a group of its own (load_op_costs)
        columns: dict[str, list[Any]] = {
            name: list(group[name][()]) for name in group if isinstance(group[name], h5py.Dataset)
        }
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


def _read_csv(p: Path) -> tuple[dict[str, LayerCost], list[dict[str, Any]]]:
    """The layer rows, and the records of op rows (a non-empty ``op`` column)."""
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
    lines = [i + 2 for i, r in enumerate(records) if not str(r.get("op") or "").strip()]
    layers = [r for r in records if not str(r.get("op") or "").strip()]
    ops = [{**r, "_line": i + 2} for i, r in enumerate(records) if str(r.get("op") or "").strip()]
    return _rows(p, layers, lambda i: f"line {lines[i]}"), ops


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


# -- ops ----------------------------------------------------------------------------------------

#: the ops a table may cost, each with its dimensions' names and the law its cost follows
OPS: dict[str, tuple[tuple[str, ...], str]] = {
    "eigh": (("n",), "n^3"),
    "precondition": (("d_out", "d_in"), "d_out * d_in * (d_out + d_in)"),
    "factor": (("rows", "d"), "rows * d^2"),
}


def op_work(op: str, dims: tuple[int, ...]) -> float:
    """The work of ``op`` at ``dims`` by its law (:data:`OPS`): ``n³`` for ``eigh``, ``d_out · d_in ·
    (d_out + d_in)`` for ``precondition`` (four matrix products), ``rows · d²`` for ``factor``.

    Raises:
        KeyError: an op not in :data:`OPS`.
    """
    if op == "eigh":
        return float(dims[0]) ** 3
    if op == "precondition":
        return float(dims[0]) * dims[1] * (dims[0] + dims[1])
    if op == "factor":
        return float(dims[0]) * dims[1] ** 2
    raise KeyError(op)


@dataclass(frozen=True)
class OpCost:
    """One op row of a cost table: ``op`` at ``dims`` took ``seconds`` per call."""

    op: str
    dims: tuple[int, ...]
    seconds: float


class OpCosts:
    """An op's seconds at any dimensions, from the rows measured at some.

    Each op's rows are placed by their work (:func:`op_work`). At a measured work the row's
    seconds are returned as they are (rows of equal work: their mean); between two measured
    works the seconds are interpolated linearly in log(work)-log(seconds) (linearly when one
    of them is 0 s); outside the measured range they follow the law from the nearest row,
    ``seconds = s_nearest · work / work_nearest``.

    Args:
        rows: the measured rows.
    """

    def __init__(self, rows: Iterable[OpCost] = ()) -> None:
        self.rows = list(rows)
        by_work: dict[str, dict[float, list[float]]] = {}
        for r in self.rows:
            by_work.setdefault(r.op, {}).setdefault(op_work(r.op, r.dims), []).append(r.seconds)
        self._points = {
            op: ([w for w in sorted(ws)], [sum(ws[w]) / len(ws[w]) for w in sorted(ws)])
            for op, ws in by_work.items()
        }

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def ops(self) -> list[str]:
        """The ops with rows."""
        return sorted(self._points)

    def seconds(self, op: str, dims: tuple[int, ...]) -> float | None:
        """Seconds of one call of ``op`` at ``dims`` (None: the table has no row for ``op``)."""
        points = self._points.get(op)
        if points is None:
            return None
        works, secs = points
        w = op_work(op, dims)
        i = bisect.bisect_left(works, w)
        if i < len(works) and works[i] == w:
            return secs[i]
        if i == 0:
            return secs[0] * w / works[0]
        if i == len(works):
            return secs[-1] * w / works[-1]
        (w0, w1), (s0, s1) = works[i - 1 : i + 1], secs[i - 1 : i + 1]
        if s0 > 0 and s1 > 0:
            f = math.log(w / w0) / math.log(w1 / w0)
            return math.exp(math.log(s0) + f * math.log(s1 / s0))
        return s0 + (s1 - s0) * (w - w0) / (w1 - w0)


def load_op_costs(path: str | Path) -> OpCosts:
    """Read a cost table's op rows (none: an empty :class:`OpCosts`).

    Formats, beside the layer rows of :func:`load_cost_table`:

    * **run file**: ``profile/ops/`` (columns ``op``, ``dims``, ``seconds``, ``calls``), which a
      run with ``profile.layers = true`` writes when it ran ops (K-FAC);
    * **TOML**: one ``[[ops]]`` table per row with ``op``, ``dims`` (a whole number, a list, or
      text ``"64x1025"``) and ``seconds``::

          [[ops]]
          op = "eigh"
          dims = 1025
          seconds = 0.6

    * **CSV**: rows with a non-empty ``op`` column are op rows, their ``dims`` (``64x1025``)
      and ``seconds`` columns read; their layer columns are left empty.

    Ops and their dimensions are :data:`OPS`'s.

    Raises:
        CostTableError: the file is missing or unreadable, or an op row is malformed (an op
            not in :data:`OPS`, dimensions of the wrong count, seconds not a time, a row twice).
    """
    p = Path(path)
    if not p.is_file():
        raise CostTableError(f"compute table {path} not found")
    suffix = p.suffix.lower()
    if suffix == ".toml":
        try:
            doc = tomllib.loads(p.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
            raise CostTableError(f"compute table {p} is not valid TOML ({err})") from None
        raw = doc.get("ops", [])
        if not isinstance(raw, list) or not all(isinstance(r, dict) for r in raw):
            raise CostTableError(f"compute table {p}: ops must be [[ops]] tables with op, dims and seconds")
        return _op_rows(p, raw, lambda i: f"[[ops]] #{i + 1}")
    if suffix == ".csv":
        records = _read_csv(p)[1]
        return _op_rows(p, records, lambda i: f"line {records[i]['_line']}")
    import h5py

    with h5py.File(p, "r") as h5:
        group = h5.get("profile/ops")
        if not isinstance(group, h5py.Group) or "op" not in group:
            return OpCosts()
        columns = {name: list(group[name][()]) for name in group}
    text = {k: [v.decode() if isinstance(v, bytes) else v for v in vs] for k, vs in columns.items()}
    records = [{k: vs[i] for k, vs in text.items()} for i in range(len(text["op"]))]
    return _op_rows(p, records, lambda i: f"profile/ops row {i}")


def _op_rows(p: Path, records: list[dict[str, Any]], where: Callable[[int], str]) -> OpCosts:
    """Validate op records into :class:`OpCosts`; errors name the file and the row."""
    rows: list[OpCost] = []
    seen: set[tuple[str, tuple[int, ...]]] = set()
    for i, rec in enumerate(records):
        at = f"compute table {p}, {where(i)}"
        op = str(rec.get("op") or "").strip()
        if op not in OPS:
            raise CostTableError(f"{at}: op {op!r} is not one of {', '.join(OPS)}")
        names = OPS[op][0]
        dims = _dims(rec.get("dims"))
        if dims is None or len(dims) != len(names):
            raise CostTableError(
                f"{at}: dims of op {op!r} are {rec.get('dims')!r}; give {len(names)} whole number(s) "
                f"{'x'.join(names)}"
            )
        try:
            sec = float(rec.get("seconds"))  # type: ignore[arg-type]
        except (TypeError, ValueError):
            sec = float("nan")
        if not (math.isfinite(sec) and sec >= 0):
            raise CostTableError(
                f"{at}: seconds of op {op!r} is {rec.get('seconds')!r}; give a finite time >= 0"
            )
        if (op, dims) in seen:
            raise CostTableError(
                f"{at}: op {op!r} at dims {'x'.join(map(str, dims))} appears twice; keep one row each"
            )
        seen.add((op, dims))
        rows.append(OpCost(op, dims, sec))
    return OpCosts(rows)


def _dims(raw: Any) -> tuple[int, ...] | None:
    """Dimensions from a whole number, a list of them, or text ``"64x1025"`` (None: malformed)."""
    if isinstance(raw, bool):
        return None
    if isinstance(raw, int):
        items: list[Any] = [raw]
    elif isinstance(raw, list | tuple):
        items = list(raw)
    elif isinstance(raw, str) and raw.strip():
        items = raw.strip().strip("()[]").replace(",", "x").split("x")
    else:
        return None
    try:
        values = [float(v) for v in items]
    except (TypeError, ValueError):
        return None
    if not values or not all(math.isfinite(v) and v == int(v) and v >= 1 for v in values):
        return None
    return tuple(int(v) for v in values)
