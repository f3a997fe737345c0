"""The per-layer hook: observers called around each layer's forward and backward.

Observers live in a ``contextvars`` variable (docs/design.md, per-layer hook): each simulated rank
(greenlet) has its own, and nothing is module state. ``Sequential`` calls
``before``/``after`` for every child layer, phase ``"forward"`` or ``"backward"``, through
:func:`call`, as blocks (a residual block) do for the layers inside them.

**Nesting.** A model's top-level layers are at depth 0; the layers inside a block are one
deeper (:func:`depth` while they run). Every observer sees depth 0, so a profile or a cost
table charges each top-level layer once, a block included whole; an observer that sets
``nested = True`` sees the layers inside blocks too (K-FAC needs a ResNet's convolutions).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from hpcdl.nn.layer import Layer

__all__ = ["LayerObserver", "call", "current_observers", "depth", "observe", "LayerProfiler"]


class LayerObserver(Protocol):
    """Called before and after each layer's forward and backward."""

    def before(self, phase: str, layer: Layer, x: Any) -> None:
        """``phase`` is ``"forward"`` or ``"backward"``; ``x`` the layer's input (or output gradient)."""

    def after(self, phase: str, layer: Layer, y: Any) -> None:
        """``y`` is the layer's output (or input gradient; ``None`` when the layer skipped it)."""


_observers: ContextVar[tuple[LayerObserver, ...]] = ContextVar("hpcdl_layer_observers", default=())
_depth: ContextVar[int] = ContextVar("hpcdl_layer_depth", default=0)


def depth() -> int:
    """The nesting depth of the layer whose call is observed (0: a top-level layer of the model)."""
    return _depth.get() - 1


def call(layer: Layer, phase: str, x: Any) -> Any:
    """``layer.forward(x)`` (phase ``"forward"``) or ``layer.backward(x)``, with the observers that
    see its depth around it (every observer at depth 0, those with ``nested = True`` below)."""
    observers = _observers.get()
    if not observers:
        return layer.forward(x) if phase == "forward" else layer.backward(x)
    level = _depth.get()
    seen = observers if level == 0 else tuple(o for o in observers if getattr(o, "nested", False))
    token = _depth.set(level + 1)
    try:
        for o in seen:
            o.before(phase, layer, x)
        y = layer.forward(x) if phase == "forward" else layer.backward(x)
        for o in reversed(seen):
            o.after(phase, layer, y)
    finally:
        _depth.reset(token)
    return y


def current_observers() -> tuple[LayerObserver, ...]:
    """The observers active in this context, outermost first."""
    return _observers.get()


@contextlib.contextmanager
def observe(observer: LayerObserver) -> Iterator[LayerObserver]:
    """Activate ``observer`` for the ``with`` block (observers nest)."""
    token = _observers.set(_observers.get() + (observer,))
    try:
        yield observer
    finally:
        _observers.reset(token)


class LayerProfiler:
    """Records each layer's forward and backward time and output size.

    Times come from a monotonic counter (``time.perf_counter``): this measures
    real compute, which is what the pipeline planner and the simulator's
    cost tables need. Call :meth:`table` for one row per layer with the median
    over the recorded steps.
    """

    def __init__(self) -> None:
        self._start: dict[tuple[str, str], float] = {}
        self.times: dict[tuple[str, str], list[float]] = {}
        self.out_bytes: dict[str, int] = {}
        self.out_shape: dict[str, tuple[int, ...]] = {}
        self.kind: dict[str, str] = {}
        self.order: list[str] = []

    def before(self, phase: str, layer: Layer, x: Any) -> None:
        self._start[(layer.name, phase)] = time.perf_counter()

    def after(self, phase: str, layer: Layer, y: Any) -> None:
        key = (layer.name, phase)
        dt = time.perf_counter() - self._start.pop(key)
        self.times.setdefault(key, []).append(dt)
        if phase == "forward":
            if layer.name not in self.out_bytes:
                self.order.append(layer.name)
                self.kind[layer.name] = type(layer).__name__
            self.out_bytes[layer.name] = int(y.nbytes)
            self.out_shape[layer.name] = tuple(y.shape)

    def table(self) -> list[dict[str, Any]]:
        """One row per layer in forward order: ``layer``, ``kind``, ``forward_s``,
        ``backward_s`` (medians), ``calls``, ``output_bytes``, ``output_shape``."""
        import statistics  # noqa: PLC0415

        rows = []
        for name in self.order:
            fwd = self.times.get((name, "forward"), [])
            bwd = self.times.get((name, "backward"), [])
            rows.append(
                {
                    "layer": name,
                    "kind": self.kind[name],
                    "forward_s": statistics.median(fwd) if fwd else 0.0,
                    "backward_s": statistics.median(bwd) if bwd else 0.0,
                    "calls": len(fwd),
                    "output_bytes": self.out_bytes[name],
                    "output_shape": self.out_shape[name],
                }
            )
        return rows
