"""``Sequential``: layers in order, sliceable into pipeline stages."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from hpcdl.nn.hooks import call, current_observers
from hpcdl.nn.layer import Layer

__all__ = ["Sequential"]


class Sequential(Layer):
    """Runs its layers in order; ``backward`` runs them in reverse.

    Each child is named by its position (``"0"``, ``"1"``, …) or by the names
    given, and its parameters by ``"<child>.<param>"``. ``model[a:b]`` returns a
    ``Sequential`` sharing those layers and keeping their names: a pipeline
    stage. The per-layer observers (:mod:`hpcdl.nn.hooks`) are called around
    every child's forward and backward.
    """

    def __init__(self, layers: Iterable[Layer], names: Sequence[str] | None = None) -> None:
        super().__init__()
        self.layers: list[Layer] = list(layers)
        child_names = [str(i) for i in range(len(self.layers))] if names is None else list(names)
        if len(child_names) != len(self.layers) or len(set(child_names)) != len(child_names):
            raise ValueError(f"names must be {len(self.layers)} distinct strings (got {child_names})")
        self._children = tuple(child_names)
        self.assign_names()

    def children(self) -> list[Layer]:
        return list(self.layers)

    def assign_names(self, prefix: str = "") -> None:
        self.name = prefix.rstrip(".") or "model"
        for child_name, child in zip(self._children, self.layers, strict=True):
            child.assign_names(f"{prefix}{child_name}.")

    def forward(self, x: Any) -> Any:
        if current_observers():
            for layer in self.layers:
                x = call(layer, "forward", x)
            return x
        for layer in self.layers:
            x = layer.forward(x)
        return x

    def backward(self, gy: Any) -> Any:
        if current_observers():
            for layer in reversed(self.layers):
                gy = call(layer, "backward", gy)
            return gy
        for layer in reversed(self.layers):
            gy = layer.backward(gy)
        return gy

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self) -> Iterator[Layer]:
        return iter(self.layers)

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            stage = Sequential.__new__(Sequential)
            Layer.__init__(stage)
            stage.layers = self.layers[index]
            stage._children = self._children[index]
            stage.name = self.name
            stage.training = self.training
            return stage
        return self.layers[index]

    def extra_repr(self) -> str:
        inner = "\n".join(f"  ({n}): {layer!r}" for n, layer in zip(self._children, self.layers, strict=True))
        return f"\n{inner}\n" if inner else ""
