"""Multi-layer perceptrons, including ``mlp32`` of the pipeline papers."""

from __future__ import annotations

from types import ModuleType

import numpy as np

from hpcdl.nn import Dropout, Flatten, Layer, Linear, ReLU, Sequential

__all__ = ["mlp", "mlp32"]


def mlp(
    in_features: int,
    num_classes: int,
    *,
    depth: int = 3,
    width: int = 256,
    dropout: float = 0.0,
    rng: np.random.Generator,
    dropout_rng: np.random.Generator | None = None,
    dtype: type = np.float32,
    xp: ModuleType = np,
) -> Sequential:
    """``Flatten`` then ``depth`` Linear layers (in→width, …, width→classes) with ReLU between.

    He-initialised; ``dropout > 0`` puts a Dropout before the last Linear.
    """
    if depth < 1:
        raise ValueError(f"depth must be a positive integer ({depth} < 1)")
    sizes = [in_features] + [width] * (depth - 1) + [num_classes]
    layers: list[Layer] = [Flatten()]
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        if i == depth - 1 and dropout > 0:
            layers.append(Dropout(dropout, rng=dropout_rng))
        layers.append(Linear(fan_in, fan_out, rng=rng, dtype=dtype, xp=xp))
        if i < depth - 1:
            layers.append(ReLU())
    layers[1].needs_input_grad = False  # nothing upstream of the first Linear wants dx
    return Sequential(layers)


def mlp32(
    in_features: int = 784,
    num_classes: int = 10,
    *,
    rng: np.random.Generator,
    dtype: type = np.float32,
    xp: ModuleType = np,
    **_: object,
) -> Sequential:
    """Exactly 32 Linear layers — 784→512, thirty 512→512, 512→10 — with ReLU between."""
    return mlp(in_features, num_classes, depth=32, width=512, rng=rng, dtype=dtype, xp=xp)
