"""Which 3x3 convolutions multiply by Winograd: both products timed on this machine, per shape.

Winograd F(2x2, 3x3) (:mod:`hpcdl.nn.winograd`) needs 2.25 times fewer multiplications than
im2row, and adds transforms that read and write the data several times more. Whether it pays
depends on the layer's shape and on the machine: its BLAS kernel, its caches, its memory. On an
AMD EPYC with OpenBLAS (one thread, a batch of 16) a forward and backward by Winograd took 0.64
times im2row's time at 32 channels of 32x32, 1.02 times at 64 channels of 8x8 and 1.09 times at
256 channels of 4x4: no threshold on the channel count alone
(:data:`~hpcdl.nn.conv.WINOGRAD_MIN_CHANNELS`, ``Conv2d``'s default rule) holds across shapes,
let alone across machines.

So a model's eligible layers can be timed where they run, one shape at a time: :func:`shapes`
finds each eligible ``Conv2d``'s input shape (one forward of one sample, in evaluation mode),
:func:`time_products` times a forward and backward of a layer of that shape both ways, and
:func:`apply` fixes each layer's ``winograd`` by the result. The driver caches the times per
machine and records the choice in the run's config (``model.winograd = "measure"``,
:mod:`hpcdl.driver.convplan`).

The two products differ in the last bits, so which one a layer uses is part of a run's
trajectory: a choice is made once and then kept, never re-decided under a running job.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from hpcdl.backend import get_array_module, synchronize
from hpcdl.nn.conv import Conv2d
from hpcdl.nn.hooks import observe
from hpcdl.nn.layer import Layer

__all__ = ["ConvShape", "apply", "layers", "shapes", "time_products"]


@dataclass(frozen=True)
class ConvShape:
    """The problem one eligible layer solves each step: what its time depends on.

    Attributes:
        batch: samples per forward.
        in_channels, out_channels: C and O.
        height, width: the input's H and W.
        padding: zero padding on each side (the same on both axes).
        dtype: the input's dtype name (``float32``).
        input_grad: whether backward forms the input gradient (not a model's first layer's).
    """

    batch: int
    in_channels: int
    out_channels: int
    height: int
    width: int
    padding: int
    dtype: str
    input_grad: bool = True

    @property
    def key(self) -> str:
        """A readable, unique name: ``n16 c64 o64 32x32 p1 float32`` (``... no-input-grad``)."""
        return (
            f"n{self.batch} c{self.in_channels} o{self.out_channels} {self.height}x{self.width} "
            f"p{self.padding} {self.dtype}" + ("" if self.input_grad else " no-input-grad")
        )


def layers(model: Layer) -> Iterator[Conv2d]:
    """The model's ``Conv2d`` layers that Winograd can compute (3x3, stride 1), depth first."""
    if isinstance(model, Conv2d) and model.winograd_eligible:
        yield model
    for child in model.children():
        yield from layers(child)


class _Inputs:
    """A nested observer that records the input shape each eligible ``Conv2d`` sees."""

    nested = True

    def __init__(self) -> None:
        self.seen: dict[str, tuple[tuple[int, ...], str]] = {}

    def before(self, phase: str, layer: Any, x: Any) -> None:
        if phase == "forward" and isinstance(layer, Conv2d) and layer.winograd_eligible:
            self.seen[layer.name] = (tuple(x.shape), str(x.dtype))

    def after(self, phase: str, layer: Any, y: Any) -> None:
        pass


def shapes(
    model: Layer, sample_shape: tuple[int, ...], batch: int, dtype: Any = np.float32
) -> dict[str, ConvShape]:
    """Each eligible ``Conv2d`` of ``model`` by name, with the shape it sees at ``batch`` samples.

    One forward of one zero sample finds the input shapes, in evaluation mode (no dropout
    drawn, BatchNorm's statistics untouched); the model's mode is put back. Layers that the
    forward does not reach are left out.

    Args:
        model: the model (its layers named: a ``Sequential``).
        sample_shape: one sample's shape, (C, H, W).
        batch: the samples of a step's forward.
        dtype: the inputs' dtype.
    """
    if next(layers(model), None) is None:
        return {}
    xp = _array_module(model)
    observer = _Inputs()
    mode = model.training
    model.eval()
    try:
        with observe(observer):
            model.forward(xp.zeros((1, *sample_shape), dtype=dtype))
    finally:
        model.train(mode)
    found: dict[str, ConvShape] = {}
    for layer in layers(model):
        if layer.name in observer.seen:
            (_, c, h, w), dt = observer.seen[layer.name]
            found[layer.name] = ConvShape(
                batch, c, layer.out_channels, h, w, layer.padding[0], dt, layer.needs_input_grad
            )
    return found


def time_products(
    shape: ConvShape, *, repeat: int = 3, min_time: float = 0.01, xp: Any = np
) -> dict[str, float]:
    """Seconds of a forward and backward of a layer of ``shape`` by each product:
    ``{"im2row": s, "winograd": s}``, on the device of the array module ``xp`` (the clock is read
    after the device has finished: :func:`hpcdl.backend.synchronize`).

    Both layers are built, warmed by one call, and then timed in ``repeat`` interleaved
    repetitions of as many calls as last ``min_time`` seconds (at least one); each product's
    fastest repetition per call is kept (noise on a shared machine only ever adds time).
    """
    rng = np.random.default_rng(0)
    x = xp.asarray(rng.standard_normal((shape.batch, shape.in_channels, shape.height, shape.width)))
    x = x.astype(shape.dtype)
    made = {
        name: Conv2d(
            shape.in_channels, shape.out_channels, 3, padding=shape.padding, rng=np.random.default_rng(0),
            dtype=shape.dtype, xp=xp, winograd=flag,
        )  # fmt: skip
        for name, flag in (("im2row", False), ("winograd", True))
    }
    for layer in made.values():
        layer.needs_input_grad = shape.input_grad
    gy = None
    calls: dict[str, int] = {}
    for name, layer in made.items():
        synchronize(x)
        t0 = time.perf_counter()
        y = layer.forward(x)
        gy = xp.ones_like(y) if gy is None else gy
        layer.backward(gy)
        synchronize(y)
        once = time.perf_counter() - t0
        calls[name] = max(1, int(min_time / once) if once > 0 else 1)
    best = dict.fromkeys(made, float("inf"))
    for _ in range(repeat):
        for name, layer in made.items():
            t0 = time.perf_counter()
            for _ in range(calls[name]):
                layer.forward(x)
                layer.backward(gy)
            synchronize(x)
            best[name] = min(best[name], (time.perf_counter() - t0) / calls[name])
    return best


def apply(model: Layer, winograd: Collection[str]) -> None:
    """Fix ``winograd`` on every eligible ``Conv2d`` of ``model``: ``True`` on the layers named
    in ``winograd``, ``False`` on the others."""
    for layer in layers(model):
        layer.winograd = layer.name in winograd


def _array_module(model: Layer) -> Any:
    """The array module of the model's parameters (NumPy for a model without any)."""
    params = model.parameters()
    return get_array_module(params[0].data) if params else np
