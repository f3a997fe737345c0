"""Layers with explicit forward and backward, on NumPy or CuPy."""

from __future__ import annotations

from hpcdl.nn.hooks import LayerObserver, LayerProfiler, current_observers, observe
from hpcdl.nn.layer import Layer
from hpcdl.nn.parameter import Parameter
from hpcdl.nn.sequential import Sequential

__all__ = [
    "Layer",
    "LayerObserver",
    "LayerProfiler",
    "Parameter",
    "Sequential",
    "current_observers",
    "observe",
]
