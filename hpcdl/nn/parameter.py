"""``Parameter``: a named array with its gradient."""

from __future__ import annotations

from typing import Any

from hpcdl.backend import get_array_module

__all__ = ["Parameter"]


class Parameter:
    """A trainable array ``data`` with a gradient ``grad`` of the same shape and dtype.

    ``grad`` is allocated with the parameter and **overwritten** by each backward
    pass (not accumulated): a strategy that accumulates several micro-steps adds
    ``grad`` into its own buffer. ``name`` is the dotted path inside the model
    (``"3.weight"``), set when the parameter is reached through a container.
    """

    __slots__ = ("data", "grad", "name")

    def __init__(self, data: Any, name: str = "") -> None:
        xp = get_array_module(data)
        self.data = data
        self.grad = xp.zeros_like(data)
        self.name = name

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def size(self) -> int:
        return int(self.data.size)

    @property
    def dtype(self) -> Any:
        return self.data.dtype

    def __repr__(self) -> str:
        return f"Parameter(name={self.name!r}, shape={self.shape}, dtype={self.dtype})"
