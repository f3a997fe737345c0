"""One call's state: a forward's cache saved and put back gives that forward's backward.

A pipeline stage runs microbatches k and k + 1 forward before k's backward; with
``save_cache``/``load_cache`` each backward must be exactly the one forward-then-backward
gives (float64, bit for bit), and every attribute a forward sets must be in the class's
``_cache`` (else a later layer would silently share state across microbatches).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from hpcdl.nn import (
    AvgPool2d,
    BasicBlock,
    BatchNorm1d,
    BatchNorm2d,
    Bottleneck,
    Conv2d,
    Dropout,
    Flatten,
    GlobalAvgPool2d,
    Layer,
    Linear,
    MaxPool2d,
    ReLU,
    Sequential,
)

F64 = {"dtype": np.float64}

#: name -> (a fresh layer from a seed, the input shape)
LAYERS: dict[str, tuple[Callable[[np.random.Generator], Layer], tuple[int, ...]]] = {
    "linear": (lambda r: Linear(5, 3, rng=r, **F64), (4, 5)),
    "relu": (lambda r: ReLU(inplace=False), (4, 5)),
    "relu-inplace": (lambda r: ReLU(), (4, 5)),
    "conv": (lambda r: Conv2d(2, 3, 3, stride=1, padding=1, rng=r, **F64), (2, 2, 5, 4)),
    "conv-winograd": (lambda r: Conv2d(2, 3, 3, padding=1, rng=r, winograd=True, **F64), (2, 2, 5, 4)),
    "batchnorm1d": (lambda r: BatchNorm1d(5, **F64), (6, 5)),
    "batchnorm2d": (lambda r: BatchNorm2d(2, **F64), (3, 2, 4, 4)),
    "maxpool": (lambda r: MaxPool2d(2), (2, 2, 4, 4)),
    "avgpool": (lambda r: AvgPool2d(2), (2, 2, 4, 4)),
    "globalavgpool": (lambda r: GlobalAvgPool2d(), (2, 3, 4, 4)),
    "flatten": (lambda r: Flatten(), (2, 3, 2, 2)),
    "dropout": (lambda r: Dropout(0.5, rng=np.random.default_rng(7)), (4, 5)),
    "basicblock": (lambda r: BasicBlock(2, 4, 2, rng=r, **F64), (2, 2, 6, 6)),
    "bottleneck": (lambda r: Bottleneck(8, 2, 1, rng=r, **F64), (2, 8, 4, 4)),
    "mlp": (
        lambda r: Sequential(
            [
                Flatten(),
                Linear(12, 6, rng=r, **F64),
                ReLU(),
                Dropout(0.3, rng=np.random.default_rng(3)),
                Linear(6, 2, rng=r, **F64),
            ]
        ),
        (3, 3, 2, 2),
    ),  # fmt: skip
}


def _grads(layer: Layer) -> list[np.ndarray]:
    return [p.grad.copy() for p in layer.parameters()]


def _pass(layer: Layer, x: np.ndarray, gy: np.ndarray) -> tuple[Any, Any, list[np.ndarray]]:
    y = layer.forward(x.copy())
    gx = layer.backward(gy.copy())
    return y, gx, _grads(layer)


@pytest.mark.parametrize("name", LAYERS)
def test_a_saved_cache_gives_that_forwards_backward(name: str) -> None:
    make, shape = LAYERS[name]
    rng = np.random.default_rng(0)
    x1, x2 = rng.standard_normal(shape), rng.standard_normal(shape)
    alone = make(np.random.default_rng(1))
    y1 = alone.forward(x1.copy())
    g1, g2 = rng.standard_normal(y1.shape), rng.standard_normal(y1.shape)
    alone = make(np.random.default_rng(1))  # afresh: the same weights and dropout stream
    want1 = _pass(alone, x1, g1)
    want2 = _pass(alone, x2, g2)

    staged = make(np.random.default_rng(1))
    out1 = staged.forward(x1.copy())
    first = staged.save_cache()
    out2 = staged.forward(x2.copy())  # microbatch 2 forward before microbatch 1's backward
    second = staged.save_cache()
    staged.load_cache(first)
    gx1 = staged.backward(g1.copy())
    got1 = _grads(staged)
    staged.load_cache(second)
    gx2 = staged.backward(g2.copy())
    got2 = _grads(staged)
    for (y, gx, grads), (out, got_gx, got) in ((want1, (out1, gx1, got1)), (want2, (out2, gx2, got2))):
        np.testing.assert_array_equal(out, y)
        if gx is not None:
            np.testing.assert_array_equal(got_gx, gx)
        for a, b in zip(got, grads, strict=True):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name", LAYERS)
def test_every_attribute_a_forward_sets_is_in_the_cache(name: str) -> None:
    make, shape = LAYERS[name]
    model = make(np.random.default_rng(1))
    layers = [model]
    for layer in layers:  # every layer of the tree
        layers.extend(layer.children())
    before = [dict(vars(layer)) for layer in layers]
    model.forward(np.random.default_rng(0).standard_normal(shape))
    for layer, old in zip(layers, before, strict=True):
        changed = {k for k, v in vars(layer).items() if k not in old or v is not old[k]}
        changed -= {"training"}
        assert changed <= set(type(layer)._cache), (type(layer).__name__, changed - set(type(layer)._cache))
