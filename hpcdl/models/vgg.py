"""VGG-16 (Simonyan & Zisserman, 2015) with BatchNorm and a width multiplier, for any input size."""

from __future__ import annotations

from types import ModuleType

import numpy as np

from hpcdl.nn import (
    BatchNorm2d,
    Conv2d,
    Dropout,
    GlobalAvgPool2d,
    Layer,
    Linear,
    MaxPool2d,
    ReLU,
    Sequential,
)

__all__ = ["vgg16"]

#: configuration "D": 13 convolutions in 5 blocks, "M" is a 2x2 max-pool
_VGG16 = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")


def _scaled(c: int, width_mult: float) -> int:
    return max(1, round(c * width_mult))


def vgg16(
    input_shape: tuple[int, int, int],
    num_classes: int,
    *,
    width_mult: float = 1.0,
    rng: np.random.Generator,
    dropout_rng: np.random.Generator | None = None,
    dtype: type = np.float32,
    xp: ModuleType = np,
) -> Sequential:
    """13 conv3x3-BN-ReLU layers and 3 fully connected ones (16 weight layers).

    A max-pool is skipped once the feature map is 1×1, and a global average
    pool feeds the classifier, so any input size works (8×8 digits, 32×32
    CIFAR, 224×224 ImageNet). Channel counts and the 4096-wide classifier are
    multiplied by ``width_mult``.
    """
    c, h, w = input_shape
    layers: list[Layer] = []
    for v in _VGG16:
        if v == "M":
            if min(h, w) >= 2:
                layers.append(MaxPool2d(2))
                h, w = h // 2, w // 2
            continue
        out = _scaled(int(v), width_mult)
        layers += [
            Conv2d(c, out, 3, padding=1, bias=False, rng=rng, dtype=dtype, xp=xp),
            BatchNorm2d(out, dtype=dtype, xp=xp),
            ReLU(),
        ]
        c = out
    hidden = _scaled(4096, width_mult)
    layers += [
        GlobalAvgPool2d(),
        Linear(c, hidden, rng=rng, dtype=dtype, xp=xp),
        ReLU(),
        Dropout(0.5, rng=dropout_rng),
        Linear(hidden, hidden, rng=rng, dtype=dtype, xp=xp),
        ReLU(),
        Dropout(0.5, rng=dropout_rng),
        Linear(hidden, num_classes, rng=rng, dtype=dtype, xp=xp),
    ]
    layers[0].needs_input_grad = False
    return Sequential(layers)
