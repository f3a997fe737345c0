"""Per-step metrics from every rank into rank 0's run file, gathered every few steps."""

from __future__ import annotations

from typing import Any

import numpy as np

from hpcdl.comm import Communicator
from hpcdl.store import RunFile

__all__ = ["RunLog"]


class RunLog:
    """Collects one metrics row per step (rank 0) and each rank's timings (all ranks).

    Every ``flush_every`` steps, :meth:`flush` gathers the ranks' compute and
    communication times to rank 0 (one small ``gather``: a collective, called by
    every rank at the same step), which appends them with its metrics rows and
    flushes the file. Waiting time is estimated per step as a rank's
    communication time minus the smallest over the ranks: the part of the
    exchange spent waiting for slower ranks rather than moving data.
    """

    def __init__(self, comm: Communicator, runfile: RunFile | None, flush_every: int) -> None:
        self.comm = comm
        self.runfile = runfile  # only rank 0 has one
        self.flush_every = max(1, flush_every)
        self._rows: list[dict[str, Any]] = []
        self._times: list[tuple[float, float]] = []

    def record(self, row: dict[str, Any], compute_s: float, comm_s: float) -> None:
        """Add this step's row (kept on rank 0) and this rank's timings; flush when due."""
        if self.runfile is not None:
            self._rows.append(row)
        self._times.append((compute_s, comm_s))
        if len(self._times) >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        """Gather and write what is buffered (collective)."""
        mine = np.array(self._times, dtype=np.float64).reshape(-1, 2)
        every = self.comm.gather(mine, root=0)
        self._times = []
        if self.runfile is None:
            return
        times = np.stack(every, axis=1)  # steps, ranks, 2
        compute, comm_t = times[..., 0], times[..., 1]
        wait = comm_t - comm_t.min(axis=1, keepdims=True)
        self.runfile.append_metrics(self._rows)
        self.runfile.append_ranks({"compute_time": compute, "comm_time": comm_t, "wait_time": wait})
        self.runfile.flush()
        self._rows = []

    def close(self, status: str, **attrs: Any) -> None:
        """Flush (collective), then set the final attributes and close the file (rank 0)."""
        self.flush()
        if self.runfile is not None:
            self.runfile.set_attrs(status=status, **attrs)
            self.runfile.close()
            self.runfile = None

    def abandon(self, status: str) -> None:
        """After a failure on this rank: mark the file and close it, without collectives.

        Rows still buffered are dropped (their per-rank timings cannot be gathered);
        what was flushed stays.
        """
        if self.runfile is not None:
            self.runfile.set_attrs(status=status)
            self.runfile.close()
            self.runfile = None
