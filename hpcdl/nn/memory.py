"""How much memory a model's layers take in a training step, measured on two and three samples.

A run that cannot fit is refused before its first step (:mod:`hpcdl.driver.memory`), so the
sizes here are found without allocating a real batch: :class:`MemoryProbe` runs *dry steps* —
a forward, the loss and a backward of two samples and of three (zeros; after one measured
warm-up step, whose one-off allocations are not the model's), in a context of their own
(no per-layer observer of the caller runs: not a profiler, not the simulator's compute
model) — and measures

* what the forward's caches keep for the backward: the arrays' bytes
  (:func:`cache_nbytes`, what a pipeline stage records as ``activation_bytes``);
* the most allocated at once, between each two layer boundaries (the per-layer hook marks
  them), with :mod:`tracemalloc`, which NumPy reports its buffers to: the caches, the
  outputs, and the temporaries inside a layer (im2col's columns, the gradients).

Each quantity is a line ``fixed + n x per_sample`` in the batch n, through the two- and
three-sample measurements; a peak is the highest of its segments' lines at n
(:func:`at`), so that a peak that moves from a late layer (parameter-sized temporaries) to
an early one (activation-sized) as the batch grows is found. Host memory (NumPy) only: a
GPU's arrays are not seen by :mod:`tracemalloc`.
"""

from __future__ import annotations

import contextvars
import tracemalloc
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np

from hpcdl.nn.hooks import observe
from hpcdl.nn.layer import Layer
from hpcdl.nn.loss import SoftmaxCrossEntropy
from hpcdl.nn.sequential import Sequential

__all__ = ["Activations", "Line", "MemoryProbe", "at", "cache_nbytes"]

#: ``(fixed, per_sample)`` bytes: ``fixed + n * per_sample`` at a batch of n samples
Line = tuple[int, int]
#: the batches of the dry steps (BatchNorm in training needs two values per channel)
SAMPLES = (2, 3)


def at(lines: Sequence[Line], n: int) -> int:
    """The highest of ``lines`` at a batch of ``n`` samples (0 for none)."""
    return max((fixed + n * per for fixed, per in lines), default=0)


def cache_nbytes(cache: Any) -> int:
    """Bytes of the arrays a forward's cache holds (:meth:`Layer.save_cache`; each buffer once:
    views count as their base)."""
    seen: dict[int, int] = {}

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, list | tuple):
            for v in value:
                walk(v)
        elif hasattr(value, "nbytes") and hasattr(value, "shape"):
            base = value.base if getattr(value, "base", None) is not None else value
            seen[id(base)] = int(base.nbytes)

    walk(cache)
    return sum(seen.values())


@dataclass(frozen=True)
class Activations:
    """The activation memory of some layers in a training step, as lines in the batch n (bytes).

    Attributes:
        held: what one forward's caches keep until its backward (a pipeline stage keeps this
            per microbatch in flight).
        forward: the most allocated at once during a forward (the input included): what an
            evaluation of n samples takes.
        step: the most allocated at once during the forward, the loss (when the layers end
            the model) and the backward.
        input_bytes: one sample's input to the layers.
        output_bytes: one sample's output.
    """

    held: Line
    forward: tuple[Line, ...]
    step: tuple[Line, ...]
    input_bytes: int
    output_bytes: int


class MemoryProbe:
    """A model's memory by slices of its top-level layers (a pipeline stage is such a slice).

    Measures on the model it is given (build one of its own: the dry steps change BatchNorm
    statistics and draw dropout masks); the layers' caches are put back as they were.

    Args:
        model: the whole model.
        input_shape: one sample's shape.
        dtype: the samples' dtype (the config's).
        xp: the array module (NumPy: :mod:`tracemalloc` sees host memory only).
    """

    def __init__(
        self, model: Sequential, input_shape: Sequence[int], dtype: Any, xp: ModuleType = np
    ) -> None:
        self.model, self.dtype, self.xp = model, np.dtype(dtype), xp
        self.shapes: list[tuple[int, ...]] = [tuple(input_shape)]  # into each top-level layer, and out
        self._measured: dict[tuple[int, int], Activations] = {}
        self._measured[(0, len(model))] = self._measure(0, len(model))

    @property
    def layers(self) -> int:
        """The model's top-level layers."""
        return len(self.model)

    def parameters(self, a: int = 0, b: int | None = None) -> tuple[int, int]:
        """Bytes of the parameters of top-level layers ``a .. b-1``, and of the largest one."""
        sizes = [int(p.data.nbytes) for layer in self.model.layers[a:b] for p in layer.parameters()]
        return sum(sizes), max(sizes, default=0)

    def activations(self, a: int = 0, b: int | None = None) -> Activations:
        """The activations of top-level layers ``a .. b-1`` (the loss too when they end the model)."""
        key = (a, len(self.model) if b is None else b)
        if key not in self._measured:
            self._measured[key] = self._measure(*key)
        return self._measured[key]

    def _measure(self, a: int, b: int) -> Activations:
        part = self.model[a:b]
        first = [layer.needs_input_grad for layer in part]
        if a > 0:  # a stage after the first sends its input gradient back
            for layer in part:
                layer.needs_input_grad = True
        try:
            ends = b == len(self.model)
            # the first step's one-off allocations (lazy imports, caches) are not the model's
            _, one, two = (contextvars.Context().run(self._dry_step, part, a, n, ends) for n in (2, *SAMPLES))
        finally:
            for layer, needs in zip(part, first):
                layer.needs_input_grad = needs
        itemsize = self.dtype.itemsize
        return Activations(
            held=_line(one.held, two.held),
            forward=_envelope([_line(p, q) for p, q in zip(one.forward, two.forward, strict=True)]),
            step=_envelope([_line(p, q) for p, q in zip(one.step, two.step, strict=True)]),
            input_bytes=int(np.prod(self.shapes[a])) * itemsize,
            output_bytes=int(np.prod(self.shapes[b])) * itemsize if b < len(self.shapes) else 0,
        )

    def _dry_step(self, part: Sequential, a: int, n: int, loss: bool) -> _Trace:
        """One forward, loss and backward of ``n`` zero samples through ``part``, traced."""
        xp, tracing = self.xp, tracemalloc.is_tracing()
        if not tracing:
            tracemalloc.start()
        saved, training = part.save_cache(), part.training
        part.train()
        marks = _Marks({id(layer): a + i for i, layer in enumerate(part)}, self.shapes)
        try:
            with observe(marks):
                x = xp.zeros((n, *self.shapes[a]), dtype=self.dtype)  # a received or gathered batch
                y = part.forward(x)
                trace = _Trace(held=cache_nbytes(part.save_cache()), forward=marks.segments("forward"))
                if loss:
                    fn = SoftmaxCrossEntropy()
                    fn.forward(y, xp.zeros(n, dtype=np.int64))
                    gy = fn.backward()
                else:
                    gy = xp.ones_like(y)  # the gradient the next stage sends back
                marks.mark("backward")
                part.backward(gy)
                marks.mark("backward")
            trace.step = marks.segments()
            return trace
        finally:
            part.load_cache(saved)
            part.train(training)
            if not tracing:
                tracemalloc.stop()


@dataclass
class _Trace:
    """One dry step's measurements: bytes held by the caches, the segments' peaks."""

    held: int
    forward: list[int]
    step: list[int] = field(default_factory=list)


class _Marks:
    """A per-layer observer marking the layer boundaries: the peak of each segment between two
    marks (above the memory traced when it began), and each top-level layer's input shape."""

    def __init__(self, top: dict[int, int], shapes: list[tuple[int, ...]]) -> None:
        self.top, self.shapes = top, shapes
        tracemalloc.reset_peak()
        self.base = tracemalloc.get_traced_memory()[0]
        self.points: list[tuple[str, int]] = []

    def mark(self, phase: str) -> None:
        """End the current segment (of ``phase``) and start the next."""
        self.points.append((phase, tracemalloc.get_traced_memory()[1] - self.base))
        tracemalloc.reset_peak()

    def segments(self, phase: str | None = None) -> list[int]:
        """The segments' peaks so far (of ``phase`` only, when given)."""
        return [peak for p, peak in self.points if phase is None or p == phase]

    def before(self, phase: str, layer: Layer, x: Any) -> None:
        self.mark(phase)

    def after(self, phase: str, layer: Layer, y: Any) -> None:
        self.mark(phase)
        index = self.top.get(id(layer))
        if phase == "forward" and index is not None:
            shape = tuple(y.shape[1:])
            if index + 1 < len(self.shapes):
                self.shapes[index + 1] = shape
            else:
                self.shapes.append(shape)


def _line(one: int, two: int) -> Line:
    """The line through the measurements at :data:`SAMPLES` (never below 0)."""
    per = max(0, (two - one) // (SAMPLES[1] - SAMPLES[0]))
    return max(0, one - SAMPLES[0] * per), per


def _envelope(lines: list[Line]) -> tuple[Line, ...]:
    """The lines that are highest somewhere (no other is as high in both fixed and per-sample bytes)."""
    kept = sorted(set(lines), key=lambda line: (-line[1], -line[0]))
    out: list[Line] = []
    for fixed, per in kept:
        if all(fixed > f for f, _ in out):
            out.append((fixed, per))
    return tuple(out)
