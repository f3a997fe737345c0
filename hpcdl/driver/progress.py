"""Progress output of long commands: a tqdm bar when interactive, plain lines in batch jobs."""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable
from typing import Any, TextIO

from hpcdl.comm import wtime
from hpcdl.driver.figures import RATE_UNIT, rate_phrase, rate_text, wall_text

__all__ = ["Progress", "choose_mode", "SCHEDULER_VARS"]

#: environment variables that batch schedulers set inside a job
SCHEDULER_VARS = ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "COBALT_JOBID", "FLUX_JOB_ID", "JOB_ID")
#: the bar without tqdm's own steps/s: the throughput shown is the run's samples/s (its postfix)
_BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]"


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
    """Step progress on rank 0: :meth:`update` after steps, ``close()`` at the end.

    Lines (``lines``) are printed when a multiple of ``every`` steps has passed since the
    previous update, at the last step, and — when ``every_s > 0`` — whenever ``every_s``
    seconds of ``clock`` have passed since the previous line, so that a run whose
    ``every`` steps take minutes still shows it is alive. The bar (``bar``) is redrawn at
    each update (tqdm's own rate limit), its elapsed time on ``clock`` too. Other ranks
    get a silent instance, so the loop needs no rank test.

    Args:
        mode: ``bar``, ``lines`` or ``none``.
        total: the run's steps.
        every: steps between lines (``train.log_every``).
        active: whether this rank shows progress (rank 0).
        stream: where to write (default: standard error).
        every_s: seconds between lines at the latest (``train.log_every_s``; 0: by steps only).
        start: the steps already done (a resumed run).
        clock: seconds (:func:`hpcdl.comm.wtime`: virtual time in the simulator).
    """

    def __init__(
        self,
        mode: str,
        total: int,
        every: int,
        active: bool,
        stream: TextIO | None = None,
        every_s: float = 0.0,
        start: int = 0,
        clock: Callable[[], float] = wtime,
    ) -> None:
        self.mode = mode if active else "none"
        self.total = total
        self.every = every
        self.every_s = every_s
        self.stream = stream or sys.stderr
        self._clock = clock
        self._last = start  # the step of the previous update
        self._printed_at = clock()  # when the previous line was printed
        self._bar: Any = None
        if self.mode == "bar":
            from tqdm import tqdm

            class _Bar(tqdm):  # type: ignore[misc, type-arg]
                monitor_interval = 0  # no monitor thread: it would compare its own clock with ours

            bar = _Bar(total=total, initial=start, unit="step", file=self.stream, dynamic_ncols=True,
                       leave=True, bar_format=_BAR_FORMAT)  # fmt: skip
            bar._time = clock  # tqdm's clock (an attribute of tqdm >= 4.0): elapsed as the run counts it
            bar.start_t = bar.last_print_t = clock()
            self._bar = bar

    def update(
        self, step: int, loss: float = math.nan, samples_per_s: float = math.nan, time_s: float = math.nan
    ) -> None:
        """Report that ``step`` (1-based) is done: its loss, the run's samples/s up to it and the
        run's time when it ended (:mod:`hpcdl.driver.figures`; ``metrics/time``).

        A strategy whose ranks meet every few steps reports at its meetings: a line due at a
        step between two updates is printed at the second.
        """
        since, self._last = self._last, step
        if self.mode == "bar":
            self._bar.set_postfix({"loss": _fmt(loss), RATE_UNIT: rate_text(samples_per_s)}, refresh=False)
            self._bar.update(step - self._bar.n)
            return
        if self.mode != "lines":
            return
        now = self._clock()
        due = step // self.every > since // self.every or step == self.total
        if due or (self.every_s > 0 and now - self._printed_at >= self.every_s):
            self._printed_at = now
            time = wall_text(time_s)
            figures = f"{rate_phrase(samples_per_s)}  time {time}{' s' * (time != 'n/a')}"
            print(f"step {step}/{self.total}  loss {_fmt(loss)}  {figures}", file=self.stream, flush=True)

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
    if not math.isfinite(v):  # NaN, inf: nothing measured
        return "n/a"
    return f"{v:.4g}"
