"""``auto``: the allreduce algorithm for a message size and rank count, from a calibrated table.

An :class:`AutoTable` holds, per rank count, the size segments measured by
``python -m hpcdl.bench allreduce --calibrate --table FILE``: ``(below, algorithm)`` pairs in
increasing order, ``below`` the exclusive upper bound in bytes, ``None`` on the last (no
bound). A rank count that was not measured takes the nearest one that was (ties: the
smaller); one rank, or a table with no rank counts, takes :attr:`AutoTable.fallback`,
by default :data:`FALLBACK`: MPI's own allreduce below 512 KiB, the ring from there.

The table is stored as JSON (:meth:`AutoTable.to_dict`, the form checkpoints record):

.. code-block:: json

    {"format": 1, "note": "...",
     "fallback": [{"below": 524288, "algorithm": "mpi"}, {"below": null, "algorithm": "ring"}],
     "ranks": {"2": {"segments": [{"below": 524288, "algorithm": "mpi"},
                                  {"below": null, "algorithm": "ring"}],
                     "meta": {"date": "...", "mpi_library": "...", "host": "...", "...": "..."}}}}

The packaged default, ``auto_table.json`` beside this module, is read by
``load_table(None)``. A calibration turns benchmark rows into segments with
:func:`table_from_rows`: at each measured size the fastest median wins, except that the
previous (smaller) size's winner is kept while within ``tolerance`` (3%) of the fastest,
so that noise between near-equal algorithms does not flap the choice; where the winner
changes between two measured sizes, the boundary is their geometric mean.

Where a node algorithm (``"shm"``) was timed, a rank count also has ``"ordinary"`` segments
(:func:`ordinary_segments`: the same over the message algorithms only), which ``auto`` takes
for a buffer in ordinary memory, where ``shm`` cannot run; a rank count without them (a table
written before they were) takes MPI's own there.
"""

from __future__ import annotations

import bisect
import json
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from types import MappingProxyType
from typing import Any, NamedTuple

from hpcdl.atomic import write_text_atomic
from hpcdl.comm.contract import Communicator
from hpcdl.errors import ConfigError

__all__ = [
    "DEFAULT_THRESHOLD_BYTES",
    "FALLBACK",
    "FORMAT",
    "LARGE",
    "PACKAGED",
    "SMALL",
    "TOLERANCE",
    "AutoTable",
    "Segment",
    "format_bytes",
    "format_segments",
    "load_table",
    "load_table_bcast",
    "merge",
    "ordinary_segments",
    "save_table",
    "table_from_rows",
    "winners",
]

#: the fallback rule's threshold: below this many bytes, the small-message algorithm
DEFAULT_THRESHOLD_BYTES = 512 * 1024
#: latency-bound messages: the library's own (MPICH switches among its algorithms itself)
SMALL = "mpi"
#: bandwidth-bound messages: the ring (bandwidth-optimal at any rank count)
LARGE = "ring"
#: version of the JSON layout written by :meth:`AutoTable.to_dict`
FORMAT = 1
#: the packaged default table, a resource of this package
PACKAGED = "auto_table.json"
#: :func:`table_from_rows` keeps the previous size's winner while within this fraction of the fastest
TOLERANCE = 0.03
#: how to make a table, for error messages
_FIX = "re-run python -m hpcdl.bench allreduce --calibrate --table {path} (or fix the file)"


class Segment(NamedTuple):
    """Messages of fewer than ``below`` bytes (no bound: ``None``) not taken by an earlier segment."""

    below: int | None
    algorithm: str


def _threshold_rule(threshold_bytes: int) -> tuple[Segment, ...]:
    return (Segment(int(threshold_bytes), SMALL), Segment(None, LARGE))


#: the rule for one rank and for rank counts when the table has none: the pre-calibration
#: two-way rule (MPI's own below 512 KiB, the ring from there; measured at -n 2, MPICH 5.0.2,
#: 2026-11-22: MPI's fastest from 4 to 64 KB, ring and Rabenseifner from 1 MB)
FALLBACK: tuple[Segment, ...] = _threshold_rule(DEFAULT_THRESHOLD_BYTES)


@dataclass(frozen=True, repr=False)
class AutoTable:
    """Which allreduce algorithm ``auto`` runs, per rank count and message size (immutable).

    Args:
        segments: rank count -> its :class:`Segment` s, bounds increasing, the last unbounded.
        meta: rank count -> provenance of its segments (date, MPI library, host, repeat,
            sizes, ...; JSON values; missing: empty).
        fallback: the segments for one rank and for any rank count when ``segments`` is
            empty (default :data:`FALLBACK`).
        note: what the table is, in a sentence.
        ordinary: rank count -> the segments among the message algorithms only, for buffers
            in ordinary memory where ``segments`` picks a node algorithm (``"shm"``) that
            cannot run there; a rank count without them takes MPI's own there.

    Raises:
        ConfigError: an algorithm is unknown, or bounds do not increase, or the last
            segment has a bound; ``ordinary`` names a node algorithm or a rank count that
            ``segments`` lacks.
    """

    segments: Mapping[int, tuple[Segment, ...]] = field(default_factory=dict)
    meta: Mapping[int, Mapping[str, Any]] = field(default_factory=dict)
    fallback: tuple[Segment, ...] = FALLBACK
    note: str = ""
    ordinary: Mapping[int, tuple[Segment, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        segs = {}
        for ranks, ss in self.segments.items():
            if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
                raise ConfigError(f"rank counts must be positive integers (got {ranks!r})")
            segs[ranks] = _check_segments(ss, f"{ranks} ranks")
        unknown = sorted(set(self.meta) - set(segs))
        if unknown:
            raise ConfigError(f"provenance for rank counts without segments: {unknown}")
        object.__setattr__(self, "segments", MappingProxyType(dict(sorted(segs.items()))))
        meta = {
            r: MappingProxyType({str(k): _freeze(v) for k, v in self.meta.get(r, {}).items()}) for r in segs
        }
        object.__setattr__(self, "meta", MappingProxyType(meta))
        object.__setattr__(self, "fallback", _check_segments(self.fallback, "fallback"))
        object.__setattr__(self, "note", str(self.note))
        from hpcdl.comm.collectives.api import NODE_ALGORITHMS  # api imports this module

        ordinary = {}
        for ranks, ss in self.ordinary.items():
            if ranks not in segs:
                raise ConfigError(f"ordinary-memory segments for {ranks} ranks, which have no segments")
            ordinary[ranks] = _check_segments(ss, f"{ranks} ranks, ordinary memory")
            node = sorted({s.algorithm for s in ordinary[ranks]} & set(NODE_ALGORITHMS))
            if node:
                raise ConfigError(f"{ranks} ranks, ordinary memory: {node[0]!r} needs node memory")
        object.__setattr__(self, "ordinary", MappingProxyType(dict(sorted(ordinary.items()))))

    __hash__ = None  # type: ignore[assignment]  (mappings inside)

    def __repr__(self) -> str:
        ranks = ", ".join(f"{r}: {format_segments(ss)!r}" for r, ss in self.segments.items())
        return f"AutoTable(ranks={{{ranks}}}, fallback={format_segments(self.fallback)!r})"

    @classmethod
    def threshold(cls, threshold_bytes: int) -> AutoTable:
        """The two-way override: MPI's own below ``threshold_bytes``, the ring at and above, any ranks.

        Raises:
            ConfigError: ``threshold_bytes`` is negative.
        """
        if threshold_bytes < 0:
            raise ConfigError(f"the auto threshold must be at least 0 bytes (got {threshold_bytes})")
        rule = _threshold_rule(threshold_bytes) if threshold_bytes > 0 else (Segment(None, LARGE),)
        return cls(
            fallback=rule, note=f"two-way override: {SMALL} below {threshold_bytes} bytes, else {LARGE}"
        )

    def segments_for(self, ranks: int, node: bool = True) -> tuple[Segment, ...]:
        """The segments used at ``ranks``: its own, else the nearest measured count's (ties: the
        smaller). ``node=False``: for a buffer in ordinary memory, where a node algorithm
        cannot run: that count's ``ordinary`` segments, else these with MPI's own in its place."""
        if ranks <= 1 or not self.segments:
            found, chosen = self.fallback, None
        else:
            chosen = min(self.segments, key=lambda r: (abs(r - ranks), r))  # its own first: distance 0
            found = self.segments[chosen]
        if node:
            return found
        from hpcdl.comm.collectives.api import NODE_ALGORITHMS

        if chosen in self.ordinary:
            return self.ordinary[chosen]
        return tuple(Segment(b, SMALL if a in NODE_ALGORITHMS else a) for b, a in found)

    def choose(self, nbytes: int, ranks: int, node: bool = True) -> str:
        """The algorithm ``auto`` runs for a message of ``nbytes`` over ``ranks`` ranks (``node``:
        in node memory; else in ordinary memory, :meth:`segments_for`)."""
        for below, name in self.segments_for(ranks, node):
            if below is None or nbytes < below:
                return name
        raise AssertionError("the last segment is unbounded")  # checked in __post_init__

    def chooser(self, ranks: int, node: bool = True) -> Callable[[int], str]:
        """:meth:`choose` at a fixed rank count, as a fast function of ``nbytes`` (a bisection)."""
        segments = self.segments_for(ranks, node)
        bounds = [s.below for s in segments[:-1]]
        names = [s.algorithm for s in segments]
        return lambda nbytes: names[bisect.bisect_right(bounds, nbytes)]

    def to_dict(self) -> dict[str, Any]:
        """The table as JSON types (``json.dumps`` it; :meth:`from_dict` reads it back)."""
        return {
            "format": FORMAT,
            "note": self.note,
            "fallback": _segments_json(self.fallback),
            "ranks": {
                str(r): {
                    "segments": _segments_json(ss),
                    **({"ordinary": _segments_json(self.ordinary[r])} if r in self.ordinary else {}),
                    "meta": _thaw(self.meta.get(r, {})),
                }
                for r, ss in self.segments.items()
            },
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AutoTable:
        """The table of :meth:`to_dict`'s output.

        Raises:
            ConfigError: the layout, an algorithm or a bound is wrong (message without a file name).
        """
        if not isinstance(data, Mapping):
            raise ConfigError(f"expected a JSON object, got {type(data).__name__}")
        if "format" not in data:
            raise ConfigError(f'no "format" key (expected "format": {FORMAT})')
        if data["format"] != FORMAT:
            raise ConfigError(f"unsupported format {data['format']!r} (this hpcdl reads format {FORMAT})")
        ranks = data.get("ranks", {})
        if not isinstance(ranks, Mapping):
            raise ConfigError('"ranks" must be an object: rank count -> {"segments": [...], "meta": {...}}')
        segments, meta, ordinary = {}, {}, {}
        for key, entry in ranks.items():
            try:
                r = int(key)
            except ValueError:
                raise ConfigError(f'"ranks" keys are rank counts (got {key!r})') from None
            if not isinstance(entry, Mapping) or "segments" not in entry:
                raise ConfigError(f'ranks {key}: expected {{"segments": [...], "meta": {{...}}}}')
            segments[r] = _segments_from_json(entry["segments"], f"{key} ranks")
            if "ordinary" in entry:
                ordinary[r] = _segments_from_json(entry["ordinary"], f"{key} ranks, ordinary memory")
            m = entry.get("meta", {})
            if not isinstance(m, Mapping):
                raise ConfigError(f'ranks {key}: "meta" must be an object')
            meta[r] = m
        fallback = data.get("fallback")
        return cls(
            segments=segments,
            meta=meta,
            fallback=FALLBACK if fallback is None else _segments_from_json(fallback, "fallback"),
            note=str(data.get("note", "")),
            ordinary=ordinary,
        )


def format_segments(segments: Sequence[tuple[int | None, str]]) -> str:
    """Segments on one line: ``"mpi < 512K <= doubling < ~2.83M <= ring"`` (``~``: rounded)."""
    parts = [segments[0][1]]
    for (below, _), (_, name) in zip(segments, segments[1:]):
        parts.append(f"< {format_bytes(below)} <= {name}")
    return " ".join(parts)


def format_bytes(nbytes: int | None) -> str:
    """``512K``, ``64M`` when exact (binary units); else 3 significant digits after ``~``."""
    if nbytes is None:
        return "inf"
    for unit, scale in (("G", 1024**3), ("M", 1024**2), ("K", 1024)):
        if nbytes >= scale:
            return f"{nbytes // scale}{unit}" if nbytes % scale == 0 else f"~{nbytes / scale:.3g}{unit}"
    return str(nbytes)


def merge(
    table: AutoTable,
    ranks: int,
    segments: Sequence[tuple[int | None, str]],
    meta: Mapping[str, Any],
    ordinary: Sequence[tuple[int | None, str]] | None = None,
) -> AutoTable:
    """A copy of ``table`` with the segments (and provenance, and ordinary-memory segments:
    None, none) of ``ranks`` replaced."""
    new_segments = {**table.segments, ranks: tuple(Segment(*s) for s in segments)}
    new_meta = {**table.meta, ranks: meta}
    new_ordinary = {r: ss for r, ss in table.ordinary.items() if r != ranks}
    if ordinary is not None:
        new_ordinary[ranks] = tuple(Segment(*s) for s in ordinary)
    return AutoTable(new_segments, new_meta, table.fallback, table.note, new_ordinary)


def ordinary_segments(
    rows: Iterable[Mapping[str, Any]], tolerance: float = TOLERANCE
) -> tuple[Segment, ...] | None:
    """:func:`table_from_rows` over the message algorithms' rows only: the segments for buffers in
    ordinary memory; None when the rows have no node algorithm (the segments serve both)."""
    from hpcdl.comm.collectives.api import NODE_ALGORITHMS

    rows = list(rows)
    if not any(r["algorithm"] in NODE_ALGORITHMS for r in rows):
        return None
    return table_from_rows([r for r in rows if r["algorithm"] not in NODE_ALGORITHMS], tolerance)


def winners(rows: Iterable[Mapping[str, Any]], tolerance: float = TOLERANCE) -> list[tuple[int, str, float]]:
    """Per measured size, the algorithm a calibration picks, and its worst time over the fastest.

    Rows may come from several runs (a ``run`` field; rows without one are run 0). At each
    size, an algorithm's **score** is the largest, over the runs, of its time over that
    run's fastest: the algorithm with the lowest score is never far from the best in any
    run (one run: the fastest wins with score 1). On a shared or noisy machine the runs
    disagree; this minimax choice is the robust one. At each size (increasing) the lowest
    score wins, unless the previous size's winner was measured here too and its score is
    within ``tolerance`` of the lowest: then it stays (against flapping between near-equal
    algorithms). Rows of ``auto`` are ignored.

    Args:
        rows: :func:`~hpcdl.comm.collectives.timing.time_algorithms` rows of one rank count.
        tolerance: fraction by which the previous winner's score may exceed the lowest.

    Returns:
        ``(size_bytes, algorithm, score)`` per size.

    Raises:
        ValueError: no rows besides ``auto``, or rows of several rank counts.
    """
    runs: dict[tuple[int, int], dict[str, float]] = {}  # (size, run) -> algorithm -> time
    ranks = set()
    for r in rows:
        if r["algorithm"] == "auto":
            continue
        ranks.add(r["ranks"])
        runs.setdefault((int(r["size_bytes"]), int(r.get("run", 0))), {})[r["algorithm"]] = float(r["time_s"])
    if not runs:
        raise ValueError("no benchmark rows to calibrate from (auto's own rows do not count)")
    if len(ranks) > 1:
        raise ValueError(f"rows of one rank count expected (got {sorted(ranks)})")
    scores: dict[int, dict[str, float]] = {}
    for (size, _), times in runs.items():
        best = min(times.values())
        for name, t in times.items():
            ratio = t / best if best > 0 else 1.0
            per = scores.setdefault(size, {})
            per[name] = max(per.get(name, 0.0), ratio)
    out: list[tuple[int, str, float]] = []
    prev = None
    for size in sorted(scores):
        score = scores[size]
        lowest = min(score, key=score.__getitem__)
        name = prev if prev in score and score[prev] <= (1 + tolerance) * score[lowest] else lowest
        out.append((size, name, score[name]))
        prev = name
    return out


def table_from_rows(rows: Iterable[Mapping[str, Any]], tolerance: float = TOLERANCE) -> tuple[Segment, ...]:
    """The segments of one rank count from benchmark rows (see :func:`winners`).

    Where the winner changes between consecutive measured sizes ``a < b``, the new segment
    starts at their geometric mean ``ceil(sqrt(a b))`` (so ``a`` stays below it and ``b``
    is in); equal neighbours merge. Below the smallest size the first winner holds, above
    the largest the last.

    Raises:
        ValueError: see :func:`winners`.
    """
    picked = winners(rows, tolerance)
    segments: list[Segment] = []
    for (size, name, _), (next_size, next_name, _) in zip(picked, picked[1:]):
        if next_name != name:
            product = size * next_size
            root = math.isqrt(product)
            segments.append(Segment(root + (root * root < product), name))
    segments.append(Segment(None, picked[-1][1]))
    return tuple(segments)


def load_table(path: str | os.PathLike[str] | None) -> AutoTable:
    """The table in the JSON file ``path``; ``None`` or ``""``: the packaged default.

    Raises:
        ConfigError: the file is missing, not JSON, or not a valid table (one line naming
            the file, the problem and the fix).
    """
    if path is None or str(path) == "":
        name = f"packaged auto table hpcdl/comm/collectives/{PACKAGED}"
        fix = "reinstall hpcdl, or give exchange.auto_table / --table a calibrated file"
        try:
            text = resources.files(__package__).joinpath(PACKAGED).read_text(encoding="utf-8")
        except OSError as err:
            raise ConfigError(f"{name} cannot be read ({err.strerror or err}): {fix}") from None
    else:
        name = f"auto table {os.fspath(path)}"
        fix = _FIX.format(path=os.fspath(path))
        try:
            text = Path(path).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(
                f'{name} not found: give an existing file, or "" for the packaged table, or {fix}'
            ) from None
        except (OSError, UnicodeDecodeError) as err:
            raise ConfigError(
                f"{name} cannot be read ({getattr(err, 'strerror', None) or err}): {fix}"
            ) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{name} is not valid JSON ({err.msg}, line {err.lineno}): {fix}") from None
    try:
        return AutoTable.from_dict(data)
    except ConfigError as err:
        raise ConfigError(f"{name} is not a valid table: {err}; {fix}") from None


def save_table(table: AutoTable, path: str | os.PathLike[str]) -> None:
    """Write ``table`` as JSON to ``path`` atomically (a temporary file beside it, then a rename).

    Raises:
        FileError: the file cannot be written (a file already there is kept).
    """
    text = _dumps(table.to_dict()) + "\n"
    write_text_atomic(path, text, what="the auto table", fix="give a --table path in a writable directory")


def load_table_bcast(
    comm: Communicator, path: str | os.PathLike[str] | None, *, missing_ok: bool = False
) -> AutoTable:
    """:func:`load_table` on rank 0, the same table on every rank (collective).

    Every rank must choose alike, so only rank 0 reads (its file system may be the only
    one holding the file); an error is raised on every rank.

    Args:
        comm: the ranks that get the table.
        path: as for :func:`load_table`.
        missing_ok: a missing file (not ``None``) gives an empty table instead of an error.

    Raises:
        ConfigError: as :func:`load_table`, on every rank.
    """
    from hpcdl.comm.objects import on_root

    def read() -> dict[str, Any]:
        if missing_ok and path is not None and str(path) != "" and not Path(path).exists():
            return AutoTable().to_dict()
        return load_table(path).to_dict()

    return AutoTable.from_dict(on_root(comm, read))


# -- helpers ---------------------------------------------------------------------------------


def _check_segments(segments: Iterable[Any], where: str) -> tuple[Segment, ...]:
    from hpcdl.comm.collectives.api import ALGORITHMS, NODE_ALGORITHMS  # api imports this module

    known = (*ALGORITHMS, *NODE_ALGORITHMS)

    out = tuple(Segment(*s) for s in segments)
    if not out:
        raise ConfigError(f"{where}: no segments (the last one, with no bound, is required)")
    last = 0
    for i, (below, name) in enumerate(out):
        if name not in known:
            raise ConfigError(f"{where}: unknown algorithm {name!r} (known: {', '.join(known)})")
        if i == len(out) - 1:
            if below is not None:
                raise ConfigError(
                    f"{where}: the last segment must have no bound (below: null), not {below!r}"
                )
        elif isinstance(below, bool) or not isinstance(below, int) or below <= last:
            raise ConfigError(
                f"{where}: bounds must be integers increasing from above 0, then null for the last "
                f"(got {[s.below for s in out]})"
            )
        else:
            last = below
    return out


def _segments_json(segments: Sequence[Segment]) -> list[dict[str, Any]]:
    return [{"below": s.below, "algorithm": s.algorithm} for s in segments]


def _segments_from_json(items: Any, where: str) -> tuple[Segment, ...]:
    if not isinstance(items, list) or not all(isinstance(s, Mapping) and "algorithm" in s for s in items):
        raise ConfigError(
            f'{where}: segments must be a list of {{"below": bytes or null, "algorithm": name}}'
        )
    return _check_segments([(s.get("below"), s["algorithm"]) for s in items], where)


def _dumps(value: Any, indent: str = "") -> str:
    """JSON, one level per line, containers of scalars on one line (a segment, a size's medians)."""
    if not isinstance(value, dict | list) or not value:
        return json.dumps(value)
    items = value.values() if isinstance(value, dict) else value
    if not any(isinstance(v, dict | list) for v in items):
        return json.dumps(value)
    inner = indent + " "
    if isinstance(value, dict):
        body = [f"{inner}{json.dumps(str(k))}: {_dumps(v, inner)}" for k, v in value.items()]
        return "{\n" + ",\n".join(body) + f"\n{indent}}}"
    body = [f"{inner}{_dumps(v, inner)}" for v in value]
    return "[\n" + ",\n".join(body) + f"\n{indent}]"


def _freeze(value: Any) -> Any:
    if isinstance(value, Mapping):
        return MappingProxyType({str(k): _freeze(v) for k, v in value.items()})
    if isinstance(value, list | tuple):
        return tuple(_freeze(v) for v in value)
    return value


def _thaw(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _thaw(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [_thaw(v) for v in value]
    return value
