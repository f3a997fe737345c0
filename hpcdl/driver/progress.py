"""Progress output of long commands: a tqdm bar when interactive, plain lines in batch jobs."""

from __future__ import annotations

import math
import os
import sys
from typing import Any, TextIO

__all__ = ["Progress", "choose_mode", "SCHEDULER_VARS"]

#: environment variables that batch schedulers set inside a job
SCHEDULER_VARS = ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "COBALT_JOBID", "FLUX_JOB_ID", "JOB_ID")


def choose_mode(requested: str, stream: TextIO | None = None) -> str:
    """``bar``, ``lines`` or ``none`` for ``--progress requested`` (``auto`` decides).

    ``auto`` gives plain lines inside a batch job (a scheduler's variable is
    set) or under CI, and a bar otherwise: on a terminal, or under mpiexec,
    which forwards the ranks' output through pipes even when it runs in one.
    """
    if requested != "auto":
        return requested
    if any(v in os.environ for v in SCHEDULER_VARS) or os.environ.get("CI"):
        return "lines"
    under_mpiexec = "PMI_RANK" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ
    stream = stream or sys.stderr
    return "bar" if under_mpiexec or stream.isatty() else "lines"


class Progress:
    """Step progress on rank 0: ``update(step, **fields)`` each step, ``close()`` at the end.

    Other ranks get a silent instance, so the loop needs no rank test.
    """

    def __init__(self, mode: str, total: int, every: int, active: bool, stream: TextIO | None = None) -> None:
        self.mode = mode if active else "none"
        self.total = total
        self.every = every
        self.stream = stream or sys.stderr
        self._bar: Any = None
        if self.mode == "bar":
            from tqdm import tqdm

            self._bar = tqdm(total=total, unit="step", file=self.stream, dynamic_ncols=True, leave=True)

    def update(self, step: int, since: int | None = None, **fields: float) -> None:
        """Report that ``step`` (1-based) is done, with named values (loss, samples/s, ...).

        ``since``: the step reported before (the previous meeting of a strategy whose ranks
        meet every few steps); a line is printed when a multiple of the interval lies in
        ``(since, step]`` (default: ``step - 1``, the previous step).
        """
        since = step - 1 if since is None else since
        if self.mode == "bar":
            self._bar.set_postfix({k: _fmt(v) for k, v in fields.items()}, refresh=False)
            self._bar.update(step - self._bar.n)
        elif self.mode == "lines" and (step // self.every > since // self.every or step == self.total):
            text = "  ".join(f"{k} {_fmt(v)}" for k, v in fields.items())
            print(f"step {step}/{self.total}  {text}", file=self.stream, flush=True)

    def write(self, line: str) -> None:
        """Print a line without breaking the bar."""
        if self.mode == "bar":
            self._bar.write(line, file=self.stream)
        elif self.mode == "lines":
            print(line, file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _fmt(v: float) -> str:
    if isinstance(v, int):
        return str(v)
    if not math.isfinite(v):  # NaN, inf: no time measured
        return "n/a"
    return f"{v:.4g}" if abs(v) < 1000 else f"{v:.0f}"
