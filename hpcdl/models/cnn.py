"""A small convolutional network for small images (the ``digits-cnn`` preset)."""

from __future__ import annotations

from types import ModuleType

import numpy as np

from hpcdl.nn import BatchNorm2d, Conv2d, Dropout, Flatten, Layer, Linear, MaxPool2d, ReLU, Sequential

__all__ = ["cnn"]


def cnn(
    input_shape: tuple[int, int, int],
    num_classes: int,
    *,
    channels: int = 32,
    dropout: float = 0.0,
    rng: np.random.Generator,
    dropout_rng: np.random.Generator | None = None,
    dtype: type = np.float32,
    xp: ModuleType = np,
) -> Sequential:
    """conv3x3(c)-BN-ReLU, conv3x3(2c)-BN-ReLU, max-pool 2, [dropout], linear head.

    Padding 1 keeps H×W through the convolutions; the pool halves it (8×8 → 4×4).

    Raises:
        ValueError: the images are smaller than 2×2 (the pool would leave nothing).
    """
    c_in, h, w = input_shape
    if h < 2 or w < 2:
        raise ValueError(f"cnn needs images of at least 2x2 for its 2x2 max-pool (got {h}x{w})")
    c1, c2 = channels, 2 * channels
    layers: list[Layer] = [
        Conv2d(c_in, c1, 3, padding=1, bias=False, rng=rng, dtype=dtype, xp=xp),
        BatchNorm2d(c1, dtype=dtype, xp=xp),
        ReLU(),
        Conv2d(c1, c2, 3, padding=1, bias=False, rng=rng, dtype=dtype, xp=xp),
        BatchNorm2d(c2, dtype=dtype, xp=xp),
        ReLU(),
        MaxPool2d(2),
        Flatten(),
    ]
    if dropout > 0:
        layers.append(Dropout(dropout, rng=dropout_rng))
    layers.append(Linear(c2 * (h // 2) * (w // 2), num_classes, rng=rng, dtype=dtype, xp=xp))
    layers[0].needs_input_grad = False
    return Sequential(layers)
