"""The per-layer hook: observers called around each layer's forward and backward.

Observers live in a ``contextvars`` variable (docs/design.md, per-layer hook): each simulated rank
(greenlet) has its own, and nothing is module state. ``Sequential`` calls
``before``/``after`` for every child layer, phase ``"forward"`` or ``"backward"``, through
:func:`call`, as blocks (a residual block) do for the layers inside them.

**Nesting.** A model's top-level layers are at depth 0; the layers inside a block are one
deeper (:func:`depth` while they run). Every observer sees depth 0, so a profile or a cost
table charges each top-level layer once, a block included whole; an observer that sets
``nested = True`` sees the layers inside blocks too (K-FAC needs a ResNet's convolutions).

**Ops.** Work that is not a layer's forward or backward but should be charged like one (K-FAC's
factors, eigendecompositions and preconditioning) is announced with :func:`op`: every observer
that has ``before_op``/``after_op`` (:class:`OpObserver`) is called around it with the op's name
and its dimensions, whatever the depth (an op may run inside a layer's call: K-FAC collects its
factors from its observer). The names and dimensions in use:

* ``"eigh"``, ``(n,)``: a symmetric eigendecomposition of an ``n x n`` factor, in float64;
* ``"precondition"``, ``(d_out, d_in)``: a layer's preconditioned gradient, four matrix products
  ``Q_Gᵀ ∇W Q_A`` and ``Q_G V Q_Aᵀ`` with ``∇W`` of ``d_out x d_in``, in the model's dtype;
* ``"factor"``, ``(rows, d)``: one Kronecker factor ``aᵀ a`` of ``rows`` samples of width ``d``.

The profiler records them (and leaves them out of the time of the layer they run in); a cost
table charges them (:mod:`hpcdl.store.costs` says by which law of the dimensions).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from hpcdl.nn.layer import Layer

__all__ = [
    "LayerObserver",
    "LayerProfiler",
    "OpObserver",
    "call",
    "current_observers",
    "depth",
    "observe",
    "op",
]


class LayerObserver(Protocol):
    """Called before and after each layer's forward and backward."""

    def before(self, phase: str, layer: Layer, x: Any) -> None:
        """``phase`` is ``"forward"`` or ``"backward"``; ``x`` the layer's input (or output gradient)."""

    def after(self, phase: str, layer: Layer, y: Any) -> None:
        """``y`` is the layer's output (or input gradient; ``None`` when the layer skipped it)."""


class OpObserver(Protocol):
    """Called before and after each op announced with :func:`op`: a :class:`LayerObserver` that
    also has these methods (:func:`observe` takes layer observers)."""

    def before_op(self, op: str, dims: tuple[int, ...]) -> None:
        """``op`` is the op's name (``"eigh"``, ...), ``dims`` its dimensions."""

    def after_op(self, op: str, dims: tuple[int, ...]) -> None:
        """The op ended (not called when it raised)."""


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


@contextlib.contextmanager
def op(name: str, *dims: int) -> Iterator[None]:
    """Announce the ``with`` block as the op ``name`` of dimensions ``dims`` to the observers with
    ``before_op``/``after_op`` (module docstring); without such observers it costs a lookup.

    Args:
        name: the op (``"eigh"``, ``"precondition"``, ``"factor"``).
        dims: its dimensions, whole numbers.
    """
    seen = tuple(o for o in _observers.get() if hasattr(o, "before_op"))
    if not seen:
        yield
        return
    shape = tuple(int(d) for d in dims)
    for o in seen:
        o.before_op(name, shape)
    yield
    for o in reversed(seen):
        o.after_op(name, shape)


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
    """Records each layer's forward and backward time and output size, and each op's time.

    Times come from a monotonic counter (``time.perf_counter``): this measures
    real compute, which is what the pipeline planner and the simulator's
    cost tables need. Call :meth:`table` for one row per layer with the median
    over the recorded steps, :meth:`ops_table` for one row per op and dimensions. An op
    that runs inside a layer's call (K-FAC's factors) is left out of the layer's time, so
    that a cost table charges it once, as the op.
    """

    def __init__(self) -> None:
        self._start: dict[tuple[str, str], tuple[float, float]] = {}
        self._op_s = 0.0  # seconds of ops so far (taken out of the layers they ran in)
        self._op_start: list[float] = []
        self.op_times: dict[tuple[str, tuple[int, ...]], list[float]] = {}
        self.times: dict[tuple[str, str], list[float]] = {}
        self.out_bytes: dict[str, int] = {}
        self.out_shape: dict[str, tuple[int, ...]] = {}
        self.kind: dict[str, str] = {}
        self.order: list[str] = []

    def before(self, phase: str, layer: Layer, x: Any) -> None:
        self._start[(layer.name, phase)] = (time.perf_counter(), self._op_s)

    def after(self, phase: str, layer: Layer, y: Any) -> None:
        key = (layer.name, phase)
        t0, ops0 = self._start.pop(key)
        dt = time.perf_counter() - t0 - (self._op_s - ops0)
        self.times.setdefault(key, []).append(dt)
        if phase == "forward":
            if layer.name not in self.out_bytes:
                self.order.append(layer.name)
                self.kind[layer.name] = type(layer).__name__
            self.out_bytes[layer.name] = int(y.nbytes)
            self.out_shape[layer.name] = tuple(y.shape)

    def before_op(self, op: str, dims: tuple[int, ...]) -> None:
        self._op_start.append(time.perf_counter())

    def after_op(self, op: str, dims: tuple[int, ...]) -> None:
        dt = time.perf_counter() - self._op_start.pop()
        self._op_s += dt
        self.op_times.setdefault((op, dims), []).append(dt)

    def ops_table(self) -> list[dict[str, Any]]:
        """One row per op and dimensions, in the order first seen: ``op``, ``dims`` (a tuple),
        ``seconds`` (the median), ``calls``."""
        import statistics  # noqa: PLC0415

        return [
            {"op": op, "dims": dims, "seconds": statistics.median(times), "calls": len(times)}
            for (op, dims), times in self.op_times.items()
        ]

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
