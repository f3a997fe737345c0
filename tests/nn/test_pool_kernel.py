"""MaxPool2d's compiled passes (``hpcdl._ext.conv.maxpool``, ``maxpool_backward``) against its NumPy
passes, bit for bit: the same maxima, the first maximum's offset on ties and after NaNs, the
gradient on it (``0 + gy``), the padding's share dropped."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpcdl.nn import MaxPool2d, pool


def _both(layer: MaxPool2d, x: np.ndarray, gy_seed: int, monkeypatch: pytest.MonkeyPatch):
    """(y, argmax, gx) with the kernel, then with the NumPy passes."""
    out = []
    for kernel in (True, False):
        with monkeypatch.context() as m:
            if not kernel:
                m.setattr(pool, "_kernel_takes", lambda *a: False)
            y = layer.forward(x)
            argmax = layer._argmax.copy()
            gy = np.random.default_rng(gy_seed).standard_normal(y.shape).astype(x.dtype)
            gx = layer.backward(gy)
        out.append((y, argmax, gx))
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    n=st.integers(1, 2),
    c=st.integers(1, 3),
    h=st.integers(2, 9),
    w=st.integers(2, 9),
    k=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    s=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    pad=st.booleans(),
    dtype=st.sampled_from([np.float32, np.float64]),
    ties=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_the_compiled_max_pool_is_the_numpy_passes_bit_for_bit(
    n, c, h, w, k, s, pad, dtype, ties, seed, monkeypatch: pytest.MonkeyPatch
) -> None:
    kh, kw = k
    ph, pw = (kh // 2, kw // 2) if pad else (0, 0)
    if h + 2 * ph < kh or w + 2 * pw < kw:
        return
    rng = np.random.default_rng(seed)
    x = (
        rng.integers(-2, 3, (n, c, h, w)).astype(dtype)
        if ties
        else rng.standard_normal((n, c, h, w)).astype(dtype)
    )
    x.flat[rng.integers(0, x.size, 2)] = [np.nan, -np.inf]  # NaN and -inf keep or lose their windows alike
    layer = MaxPool2d(k, s, (ph, pw))
    (y1, a1, g1), (y2, a2, g2) = _both(layer, x, seed, monkeypatch)
    assert y1.tobytes() == y2.tobytes() and np.array_equal(a1, a2)
    assert g1.shape == g2.shape == x.shape and g1.tobytes() == g2.tobytes()


def test_overlapping_windows_take_the_numpy_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stride below the kernel: a pixel may take several windows' gradients, summed in kernel-offset
    order by the NumPy passes only (the compiled backward refuses such windows)."""
    from hpcdl._ext import conv

    layer = MaxPool2d(3, 2, 1)
    x = np.random.default_rng(0).standard_normal((2, 3, 8, 8)).astype(np.float32)
    (y1, _, g1), (y2, _, g2) = _both(layer, x, 1, monkeypatch)
    assert y1.tobytes() == y2.tobytes() and g1.tobytes() == g2.tobytes()
    with pytest.raises(ValueError, match="do not overlap"):
        conv.maxpool_backward(np.zeros((2, 3, 4, 4), np.float32), np.zeros((2, 3, 4, 4), np.int32),
                              np.zeros((2, 3, 8, 8), np.float32), 3, 3, 2, 2, 1, 1)  # fmt: skip
