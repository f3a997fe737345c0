"""Small helpers shared by the layer modules (internal)."""

from __future__ import annotations

from typing import Any

__all__ = ["is_writeable", "pair"]


def pair(v: int | tuple[int, int] | list[int], what: str) -> tuple[int, int]:
    """``(v, v)`` for an int, the pair itself for a pair of ints.

    Raises:
        ValueError: ``v`` is neither an int nor a pair of ints.
    """
    if isinstance(v, int):
        return (v, v)
    t = tuple(v)
    if len(t) != 2 or not all(isinstance(i, int) for i in t):
        raise ValueError(f"{what} must be an int or a pair of ints (got {v!r})")
    return (t[0], t[1])


def is_writeable(a: Any) -> bool:
    """Whether ``a`` may be written in place (CuPy arrays always may)."""
    flags = getattr(a, "flags", None)
    return bool(getattr(flags, "writeable", True))
