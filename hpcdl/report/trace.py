"""A run file's timeline (``trace/``) as Chrome trace JSON, which Perfetto and chrome://tracing open.

Each event of ``trace/`` (rank, kind, start, end, microbatch; seconds since the run began)
becomes a complete event (``"ph": "X"``) with ``ts`` and ``dur`` in microseconds, on the
track ``tid`` = its rank within the process ``pid`` = the run's index among the files
given. Metadata events name each process after its run file and each track ``rank R``.
Format: the Trace Event Format's JSON object form, ``{"traceEvents": [...]}``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from hpcdl.atomic import write_text_atomic

__all__ = ["chrome_trace", "write_chrome_trace"]


def _events(path: Path, pid: int) -> list[dict[str, Any]]:
    with h5py.File(path, "r", locking=False) as h5:
        group = h5.get("trace")
        if group is None or "start" not in group:
            return []
        n = min(len(group[k]) for k in ("rank", "kind", "start", "end", "microbatch"))
        rank, start, end = group["rank"][:n], group["start"][:n], group["end"][:n]
        micro = group["microbatch"][:n]
        kinds = [k.decode() if isinstance(k, bytes) else str(k) for k in group["kind"][:n]]
    events = []
    for r, kind, t0, t1, k in zip(rank.tolist(), kinds, start.tolist(), end.tolist(), micro.tolist()):
        events.append({
            "name": kind if k < 0 else f"{kind} {k}", "cat": kind, "ph": "X", "pid": pid, "tid": r,
            "ts": t0 * 1e6, "dur": max(0.0, t1 - t0) * 1e6, "args": {"microbatch": k},
        })  # fmt: skip
    return events


def chrome_trace(paths: Sequence[str | Path]) -> dict[str, Any]:
    """The trace events of the run files ``paths`` in the Trace Event Format (JSON object form).

    Runs without ``trace/`` events add none (no event at all when none of them has any).
    """
    events: list[dict[str, Any]] = []
    for pid, path in enumerate(map(Path, paths)):
        own = _events(path, pid)
        if not own:
            continue
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": path.stem}})
        for rank in sorted({e["tid"] for e in own}):
            events.append(
                {"name": "thread_name", "ph": "M", "pid": pid, "tid": rank, "args": {"name": f"rank {rank}"}}
            )
        events.extend(sorted(own, key=lambda e: (e["tid"], e["ts"])))
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(paths: Sequence[str | Path], out: str | Path) -> int:
    """Write :func:`chrome_trace` of ``paths`` to ``out`` (atomically); the number of events.

    Nothing is written when the runs have no ``trace/`` events (0): an earlier ``out``
    stays as it was.

    Raises:
        FileError: ``out`` cannot be written.
    """
    trace = chrome_trace(paths)
    if not trace["traceEvents"]:
        return 0
    text = json.dumps(trace, default=lambda v: v.item() if isinstance(v, np.generic) else str(v))
    write_text_atomic(out, text, what="the trace", fix="choose another path for --trace")
    return sum(1 for e in trace["traceEvents"] if e["ph"] == "X")
