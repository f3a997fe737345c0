"""Model builders by name: ``build_model("mlp", ...)``."""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any

import numpy as np

from hpcdl.models.cnn import cnn
from hpcdl.models.mlp import mlp, mlp32
from hpcdl.models.resnet import resnet18, resnet50
from hpcdl.models.vgg import vgg16
from hpcdl.nn import Sequential

__all__ = ["MODELS", "build_model", "mlp", "mlp32", "cnn", "vgg16", "resnet18", "resnet50"]

MODELS = ("mlp", "mlp32", "cnn", "vgg16", "resnet18", "resnet50")


def build_model(
    name: str,
    input_shape: tuple[int, ...],
    num_classes: int,
    *,
    rng: np.random.Generator,
    dropout_rng: np.random.Generator | None = None,
    dtype: Any = np.float32,
    xp: ModuleType = np,
    depth: int = 3,
    width: int = 256,
    width_mult: float = 1.0,
    channels: int = 32,
    dropout: float = 0.0,
) -> Sequential:
    """Build the model ``name`` for inputs of ``input_shape`` (per sample, C,H,W or flat).

    Args:
        name: one of :data:`MODELS`.
        input_shape: shape of one sample.
        num_classes: outputs of the last layer.
        rng: the initialisation stream; all ranks pass the same one.
        dropout_rng: the per-rank dropout stream.
        dtype: float32 or float64.
        xp: numpy or cupy.
        depth, width, dropout: mlp options; channels, dropout: cnn; width_mult: cnn/vgg16/resnet.

    Raises:
        ValueError: unknown name, or an input shape the model cannot take.
    """
    common: dict[str, Any] = {"rng": rng, "dtype": dtype, "xp": xp}
    flat = int(math.prod(input_shape))
    if name == "mlp":
        return mlp(
            flat, num_classes, depth=depth, width=width, dropout=dropout, dropout_rng=dropout_rng, **common
        )
    if name == "mlp32":
        return mlp32(flat, num_classes, **common)
    if len(input_shape) != 3:
        raise ValueError(f"model {name!r} needs image inputs (C, H, W), got per-sample shape {input_shape}")
    image = (int(input_shape[0]), int(input_shape[1]), int(input_shape[2]))
    if name == "cnn":
        channels = max(1, round(channels * width_mult))
        return cnn(image, num_classes, channels=channels, dropout=dropout, dropout_rng=dropout_rng, **common)
    if name == "vgg16":
        return vgg16(image, num_classes, width_mult=width_mult, dropout_rng=dropout_rng, **common)
    if name == "resnet18":
        return resnet18(image, num_classes, width_mult=width_mult, **common)
    if name == "resnet50":
        return resnet50(image, num_classes, width_mult=width_mult, **common)
    raise ValueError(f"unknown model {name!r}; models: {', '.join(MODELS)}")
