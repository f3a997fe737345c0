"""ResNet-18 and ResNet-50 (He et al., 2016) with a width multiplier, for any input size."""

from __future__ import annotations

from types import ModuleType

import numpy as np

from hpcdl.nn import (
    BasicBlock,
    BatchNorm2d,
    Bottleneck,
    Conv2d,
    GlobalAvgPool2d,
    Layer,
    Linear,
    MaxPool2d,
    ReLU,
    Sequential,
)

__all__ = ["resnet18", "resnet50"]


def _resnet(
    block: str,
    counts: tuple[int, ...],
    input_shape: tuple[int, int, int],
    num_classes: int,
    width_mult: float,
    rng: np.random.Generator,
    dtype: type,
    xp: ModuleType,
) -> Sequential:
    c_in, h, w = input_shape
    base = max(1, round(64 * width_mult))
    layers: list[Layer] = []
    if min(h, w) >= 64:  # ImageNet stem: 7x7/2 convolution and 3x3/2 max-pool
        layers += [
            Conv2d(c_in, base, 7, stride=2, padding=3, bias=False, rng=rng, dtype=dtype, xp=xp),
            BatchNorm2d(base, dtype=dtype, xp=xp),
            ReLU(),
            MaxPool2d(3, stride=2, padding=1),
        ]
        h, w = (h + 1) // 2, (w + 1) // 2
        h, w = (h + 1) // 2, (w + 1) // 2
    else:  # small-image stem (CIFAR ResNets): one 3x3/1 convolution
        layers += [
            Conv2d(c_in, base, 3, padding=1, bias=False, rng=rng, dtype=dtype, xp=xp),
            BatchNorm2d(base, dtype=dtype, xp=xp),
            ReLU(),
        ]
    c = base
    for stage, count in enumerate(counts):
        mid = base * 2**stage
        for i in range(count):
            # downsample at the first block of stages 2-4, while the map is larger than 1x1
            stride = 2 if stage > 0 and i == 0 and min(h, w) >= 2 else 1
            if stride == 2:
                h, w = (h + 1) // 2, (w + 1) // 2
            if block == "basic":
                layers.append(BasicBlock(c, mid, stride, rng=rng, dtype=dtype, xp=xp))
                c = mid
            else:
                layers.append(Bottleneck(c, mid, stride, rng=rng, dtype=dtype, xp=xp))
                c = mid * 4
    layers += [GlobalAvgPool2d(), Linear(c, num_classes, rng=rng, dtype=dtype, xp=xp)]
    layers[0].needs_input_grad = False
    return Sequential(layers)


def resnet18(
    input_shape: tuple[int, int, int],
    num_classes: int,
    *,
    width_mult: float = 1.0,
    rng: np.random.Generator,
    dtype: type = np.float32,
    xp: ModuleType = np,
    **_: object,
) -> Sequential:
    """ResNet-18: BasicBlocks [2, 2, 2, 2], widths 64·m … 512·m."""
    return _resnet("basic", (2, 2, 2, 2), input_shape, num_classes, width_mult, rng, dtype, xp)


def resnet50(
    input_shape: tuple[int, int, int],
    num_classes: int,
    *,
    width_mult: float = 1.0,
    rng: np.random.Generator,
    dtype: type = np.float32,
    xp: ModuleType = np,
    **_: object,
) -> Sequential:
    """ResNet-50: Bottlenecks [3, 4, 6, 3], widths 64·m … 512·m, expansion 4."""
    return _resnet("bottleneck", (3, 4, 6, 3), input_shape, num_classes, width_mult, rng, dtype, xp)
