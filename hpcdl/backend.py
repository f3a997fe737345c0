"""Array-module choice: NumPy by default, CuPy when asked for and installed."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

from hpcdl.errors import ConfigError

__all__ = ["get_array_module", "array_module", "to_numpy", "is_gpu_array", "synchronize"]


def get_array_module(*arrays: Any) -> ModuleType:
    """Return ``cupy`` if any argument is a CuPy array, else ``numpy``.

    The same lines of layer code then run on both devices (Chainer's idiom).
    """
    for a in arrays:
        if is_gpu_array(a):
            import cupy  # noqa: PLC0415  (GPU-only branch)

            return cupy
    return np


def is_gpu_array(a: Any) -> bool:
    """True when ``a`` is a CuPy array (checked without importing CuPy)."""
    return type(a).__module__.startswith("cupy")


def array_module(device: str) -> ModuleType:
    """The array module for a config ``device`` (``"cpu"`` or ``"gpu"``).

    Raises:
        ConfigError: ``device`` is unknown, or ``"gpu"`` without CuPy installed.
    """
    if device == "cpu":
        return np
    if device == "gpu":
        try:
            import cupy  # noqa: PLC0415
        except ImportError:
            raise ConfigError(
                "device = 'gpu' needs CuPy: install it with `pip install .[gpu]` or set device = 'cpu'"
            ) from None
        return cupy
    raise ConfigError(f"device must be 'cpu' or 'gpu' (got {device!r})")


def to_numpy(a: Any) -> np.ndarray:
    """A NumPy view or copy of ``a`` (copies device arrays to the host)."""
    if is_gpu_array(a):
        return a.get()
    return np.asarray(a)


def synchronize(a: Any) -> None:
    """Wait until the stream producing ``a`` is done (no-op for NumPy).

    A GPU buffer must be ready before MPI reads it (mpi4py's CuPy demo).
    """
    if is_gpu_array(a):
        import cupy  # noqa: PLC0415

        cupy.cuda.get_current_stream().synchronize()
