"""Virtual time in integer ticks: picoseconds, so that the model's sums are exact.

With float seconds, a ring allreduce's ``2 (n - 1) (alpha + S / (n B))`` came out off by
1e-15 s; with integer ticks the analytic cases hold exactly.
"""

from __future__ import annotations

__all__ = ["TICKS_PER_SECOND", "seconds", "ticks"]

#: ticks in one virtual second (picoseconds)
TICKS_PER_SECOND = 10**12


def ticks(seconds: float) -> int:
    """``seconds`` as a whole number of ticks (rounded to nearest)."""
    return round(seconds * TICKS_PER_SECOND)


def seconds(t: int) -> float:
    """Ticks as seconds (a float, for clocks and reports)."""
    return t / TICKS_PER_SECOND
