"""Layers with explicit forward and backward, on NumPy or CuPy."""

from __future__ import annotations

from hpcdl.nn.activation import ReLU
from hpcdl.nn.conv import Conv2d
from hpcdl.nn.dropout import Dropout
from hpcdl.nn.flatten import Flatten
from hpcdl.nn.hooks import LayerObserver, LayerProfiler, current_observers, observe
from hpcdl.nn.init import kaiming_normal
from hpcdl.nn.layer import Layer
from hpcdl.nn.linear import Linear
from hpcdl.nn.loss import MSELoss, SoftmaxCrossEntropy, accuracy
from hpcdl.nn.memory import Activations, MemoryProbe, cache_nbytes
from hpcdl.nn.norm import BatchNorm1d, BatchNorm2d
from hpcdl.nn.parameter import Parameter
from hpcdl.nn.pool import AvgPool2d, GlobalAvgPool2d, MaxPool2d
from hpcdl.nn.residual import BasicBlock, Bottleneck, ResidualBlock
from hpcdl.nn.sequential import Sequential

__all__ = [
    "Activations",
    "AvgPool2d",
    "BasicBlock",
    "BatchNorm1d",
    "BatchNorm2d",
    "Bottleneck",
    "Conv2d",
    "Dropout",
    "Flatten",
    "GlobalAvgPool2d",
    "Layer",
    "LayerObserver",
    "LayerProfiler",
    "Linear",
    "MSELoss",
    "MaxPool2d",
    "MemoryProbe",
    "Parameter",
    "ReLU",
    "ResidualBlock",
    "Sequential",
    "SoftmaxCrossEntropy",
    "accuracy",
    "cache_nbytes",
    "current_observers",
    "kaiming_normal",
    "observe",
]
