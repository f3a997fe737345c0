"""A run's two headline figures, defined once: its wall time and its throughput (samples/s).

* **wall** (``wall_s``): the run's time from the start of training (once the data is
  loaded, the model built and the run file opened) to its end, evaluations and
  checkpoints included, the segments of a resumed run added up; on rank 0's clock.
* **samples/s** (``samples_per_s``): training throughput, the samples processed (every
  rank's: ``metrics/samples``) over the *training time* they took, which is the wall
  time less the evaluations and checkpoints that held training up (a parameter server's
  evaluations hold no worker up: they count as training), up to the meeting after the
  last step counted.

The driver's :class:`~hpcdl.driver.loop.Trainer` measures both (``elapsed``,
``train_time``); the progress lines and bar, the summary line, the run file's
attributes and the report's table print them with the functions here. A step's own
rate, the ``metrics/samples_per_s`` column (the global batch over the slowest rank's
``step_time``), is another quantity: it leaves out the time between steps.

Clocks are :func:`hpcdl.comm.wtime`: wall time under MPI, virtual time in the
simulator, where both figures are those of the simulated machine.
"""

from __future__ import annotations

import math

__all__ = ["samples_per_s", "rate_text", "wall_text", "rate_phrase", "wall_phrase", "RATE_UNIT"]

#: how throughput is labelled wherever it is printed
RATE_UNIT = "samples/s"


def samples_per_s(samples: float, train_s: float) -> float:
    """Throughput: ``samples`` processed over the training time ``train_s`` (NaN when no time passed)."""
    return samples / train_s if train_s > 0 else math.nan


def rate_text(value: float | None) -> str:
    """A throughput as printed everywhere: whole samples/s, three digits below 100, ``n/a`` if unknown."""
    if value is None or not math.isfinite(value):
        return "n/a"
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"


def wall_text(value: float | None) -> str:
    """A wall time as printed everywhere: seconds to a tenth, ``n/a`` if unknown."""
    if value is None or not math.isfinite(value):
        return "n/a"
    return f"{value:.1f}"


def rate_phrase(value: float | None) -> str:
    """``12280 samples/s`` (``samples/s n/a`` when unknown): the summary line's and the progress lines'."""
    text = rate_text(value)
    return f"{RATE_UNIT} n/a" if text == "n/a" else f"{text} {RATE_UNIT}"


def wall_phrase(value: float | None) -> str:
    """``wall 14.6 s`` (``wall n/a`` when unknown): the summary line's and the progress lines'."""
    text = wall_text(value)
    return "wall n/a" if text == "n/a" else f"wall {text} s"
