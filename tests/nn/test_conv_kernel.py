"""``hpcdl._ext.conv`` against the array-module reference, and ``Conv2d`` on both paths.

The kernels' ``im2row`` is the reference ``im2col(pad2d(x)).T`` bit for bit; ``row2im`` adds
each pixel's contributions in the reference ``col2im``'s order (kernel offsets ascending),
so it too is equal bit for bit, not merely close. ``Conv2d`` then gives the same bits on
the kernel path and on the reference path (the CuPy path, forced here on NumPy).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

from hpcdl.nn import Conv2d
from hpcdl.nn import conv as conv_module
from hpcdl.nn.conv import col2im, im2col, im2row, out_size, pad2d, row2im

kernel = pytest.importorskip("hpcdl._ext.conv", reason="the kernels are not built: pip install -e .")
pytest.importorskip("hypothesis", reason="hypothesis is in the test extra: pip install -e '.[test]'")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

EXAMPLES = int(os.environ.get("HPCDL_FUZZ_EXAMPLES", "300"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
DTYPES = (np.float32, np.float64)
BITS = {np.dtype(np.float32): np.uint32, np.dtype(np.float64): np.uint64}


def assert_bits(a: np.ndarray, b: np.ndarray) -> None:
    """Equal bit for bit (signed zeros included), same shape and dtype."""
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    np.testing.assert_array_equal(a.view(BITS[a.dtype]), b.view(BITS[b.dtype]))


def reference_rows(x: np.ndarray, k: tuple, s: tuple, p: tuple) -> np.ndarray:
    """``im2col`` of the padded input, transposed: (N*Ho*Wo, C*kh*kw)."""
    ho, wo = out_size(x.shape[2], k[0], s[0], p[0]), out_size(x.shape[3], k[1], s[1], p[1])
    return np.ascontiguousarray(im2col(pad2d(x, *p), k, s, (ho, wo)).T)


def reference_grad(rows: np.ndarray, shape: tuple, k: tuple, s: tuple, p: tuple) -> np.ndarray:
    """``col2im`` onto the padded input, then its unpadded part."""
    n, c, h, w = shape
    g = col2im(np.ascontiguousarray(rows.T), (n, c, h + 2 * p[0], w + 2 * p[1]), k, s)
    return np.ascontiguousarray(g[:, :, p[0] : p[0] + h, p[1] : p[1] + w])


@st.composite
def geometries(draw: st.DrawFn) -> dict[str, Any]:
    """A batch, kernel, stride and padding whose windows fit (padding up to the kernel's size)."""
    kh, kw = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    ph, pw = draw(st.integers(0, kh)), draw(st.integers(0, kw))
    h = draw(st.integers(max(1, kh - 2 * ph), 12))
    w = draw(st.integers(max(1, kw - 2 * pw), 12))
    return {
        "shape": (draw(st.integers(1, 3)), draw(st.integers(1, 20)), h, w),
        "k": (kh, kw),
        "s": (draw(st.integers(1, 3)), draw(st.integers(1, 3))),
        "p": (ph, pw),
        "dtype": draw(st.sampled_from(DTYPES)),
        "seed": draw(st.integers(0, 2**32 - 1)),
    }


def _check_kernels(shape: tuple, k: tuple, s: tuple, p: tuple, dtype: Any, seed: int) -> None:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(dtype)
    x.flat[:: max(1, x.size // 3)] = -0.0  # signed zeros must survive the copies
    want = reference_rows(x, k, s, p)
    rows = np.full(want.shape, np.nan, dtype=dtype)  # every element must be written
    kernel.im2row(x, rows, *k, *s, *p)
    assert_bits(rows, want)
    g = rng.standard_normal(want.shape).astype(dtype)
    gx = np.full(shape, np.nan, dtype=dtype)
    kernel.row2im(g, gx, *k, *s, *p)
    assert_bits(gx, reference_grad(g, shape, k, s, p))


@FUZZ
@given(geometries())
def test_kernels_equal_the_reference_bit_for_bit(geo: dict[str, Any]) -> None:
    _check_kernels(geo["shape"], geo["k"], geo["s"], geo["p"], geo["dtype"], geo["seed"])


# the paths random small shapes rarely reach: 3x3 windows on 32x32 maps (channels 4 KiB apart,
# channel tiles capped at 8; the four-wide rows and their last-channel and right-edge cases),
# tiles of many channels on small maps with a remainder, 1x1 strided, ResNet's and VGG's stems
LARGE = [
    # (N, C, H, W), kernel, stride, padding
    ((2, 20, 32, 32), (3, 3), (1, 1), (1, 1)),
    ((1, 9, 32, 31), (3, 3), (2, 2), (1, 1)),
    ((2, 70, 4, 4), (3, 3), (1, 1), (1, 1)),
    ((1, 33, 8, 8), (3, 3), (1, 1), (0, 0)),
    ((2, 17, 16, 16), (1, 1), (2, 2), (0, 0)),
    ((2, 24, 7, 7), (1, 1), (1, 1), (0, 0)),
    ((1, 3, 40, 40), (7, 7), (2, 2), (3, 3)),
    ((2, 5, 6, 6), (3, 3), (1, 1), (2, 2)),
    ((1, 4, 10, 5), (3, 3), (3, 1), (1, 0)),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("shape", "k", "s", "p"), LARGE)
def test_kernels_equal_the_reference_on_larger_maps(shape, k, s, p, dtype) -> None:
    _check_kernels(shape, k, s, p, dtype, seed=5)


def test_kernels_check_their_shapes() -> None:
    x = np.zeros((2, 3, 5, 5), np.float32)
    with pytest.raises(ValueError, match=r"expected \(N\*Ho\*Wo, C\*kh\*kw\) = \(50, 27\)"):
        kernel.im2row(x, np.zeros((50, 26), np.float32), 3, 3, 1, 1, 1, 1)
    with pytest.raises(ValueError, match="smaller than the kernel 7x7"):
        kernel.im2row(x, np.zeros((2, 147), np.float32), 7, 7, 2, 2, 0, 0)
    with pytest.raises(ValueError, match="stride must be >= 1"):
        kernel.row2im(np.zeros((50, 27), np.float32), x, 3, 3, 0, 1, 1, 1)
    with pytest.raises(ValueError, match="Buffer dtype mismatch"):
        kernel.im2row(x, np.zeros((50, 27), np.float64), 3, 3, 1, 1, 1, 1)


def test_rows_to_nchw_transposes_each_sample() -> None:
    src = np.random.default_rng(0).standard_normal((3, 50, 37)).astype(np.float32)
    out = np.empty((3, 37, 50), np.float32)
    kernel.rows_to_nchw(src, out)
    assert_bits(out, np.ascontiguousarray(src.transpose(0, 2, 1)))
    with pytest.raises(ValueError, match="not the transpose"):
        kernel.rows_to_nchw(src, np.empty((3, 50, 37), np.float32))


# -- the public functions: the kernel where it applies, the reference elsewhere ----------------


@pytest.fixture
def reference_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """``hpcdl.nn.conv`` as without the compiled kernels (its CuPy and other-dtype path)."""
    monkeypatch.setattr(conv_module, "_kernel", None)


def test_im2row_and_row2im_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 7, 6)).astype(np.float32)
    geo = ((3, 2), (2, 1), (1, 1))
    rows = im2row(x, *geo)
    g = rng.standard_normal(rows.shape).astype(np.float32)
    gx = row2im(g, x.shape, *geo)
    assert_bits(rows, reference_rows(x, *geo))
    assert_bits(gx, reference_grad(g, x.shape, *geo))
    # a strided view, float16 and the reference path give the same values
    wide = np.zeros((2, 3, 7, 12), np.float32)
    wide[..., ::2] = x
    assert_bits(im2row(wide[..., ::2], *geo), rows)
    np.testing.assert_array_equal(im2row(x.astype(np.float16), *geo), rows.astype(np.float16))
    monkeypatch.setattr(conv_module, "_kernel", None)
    assert_bits(im2row(x, *geo), rows)
    assert_bits(row2im(g, x.shape, *geo), gx)


def test_out_arguments_are_written_and_returned() -> None:
    x = np.random.default_rng(4).standard_normal((2, 2, 5, 5))
    out = np.empty((2 * 25, 18))
    assert im2row(x, (3, 3), (1, 1), (1, 1), out=out) is out
    gx = np.empty_like(x)
    assert row2im(out, x.shape, (3, 3), (1, 1), (1, 1), out=gx) is gx


# -- Conv2d: the same bits on both paths, chunked or not -----------------------------------------

CASES = [
    # (C, O, kernel, stride, padding, N, H, W, bias)
    (3, 4, (3, 2), 2, 1, 5, 6, 7, True),
    (2, 3, 3, 1, 1, 4, 8, 8, False),
    (5, 6, 1, 2, 0, 3, 9, 8, True),
    (16, 8, 3, 1, 1, 3, 32, 32, False),
]


def _run(layer: Conv2d, x: np.ndarray, gy: np.ndarray) -> list[np.ndarray]:
    y = layer.forward(x)
    gx = layer.backward(gy)
    return [y, gx, layer.weight.grad.copy()] + ([layer.bias.grad.copy()] if layer.bias is not None else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk_rows", [1024, 7])
@pytest.mark.parametrize(("c", "o", "k", "s", "p", "n", "h", "w", "bias"), CASES)
def test_conv_gives_the_same_bits_on_both_paths(monkeypatch, dtype, chunk_rows, c, o, k, s, p, n, h, w, bias):
    monkeypatch.setattr(conv_module, "CHUNK_ROWS", chunk_rows)  # 7: a chunk per sample
    rng = np.random.default_rng(6)
    x = rng.standard_normal((n, c, h, w)).astype(dtype)

    def make() -> Conv2d:
        layer = Conv2d(c, o, k, s, p, bias=bias, rng=np.random.default_rng(2), dtype=dtype)
        if bias:
            layer.bias.data[...] = np.random.default_rng(8).standard_normal(o)
        return layer

    fast = make()
    gy = rng.standard_normal(fast.forward(x).shape).astype(dtype)
    got = _run(fast, x, gy)
    monkeypatch.setattr(conv_module, "_kernel", None)
    want = _run(make(), x, gy)
    for a, b in zip(got, want, strict=True):
        assert_bits(a, b)


def test_chunks_agree_with_one_product(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunking changes only the rows each product covers: float64 agrees to rounding."""
    rng = np.random.default_rng(9)
    x = rng.standard_normal((5, 3, 6, 6))
    results = []
    for rows in (7, 10_000):
        monkeypatch.setattr(conv_module, "CHUNK_ROWS", rows)
        layer = Conv2d(3, 4, 3, 1, 1, rng=np.random.default_rng(2), dtype=np.float64)
        results.append(_run(layer, x, np.ones((5, 4, 6, 6))))
    for a, b in zip(*results, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-13)


def test_gradcheck_over_several_chunks(fd, rng, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(conv_module, "CHUNK_ROWS", 5)
    layer = Conv2d(2, 3, 3, stride=1, padding=1, rng=rng, dtype=np.float64)
    layer.bias.data[...] = rng.standard_normal(3)
    fd.check_layer(layer, rng.standard_normal((3, 2, 4, 5)))


def test_gradcheck_on_the_reference_path(fd, rng, reference_only) -> None:
    layer = Conv2d(2, 3, (3, 2), stride=2, padding=1, rng=rng, dtype=np.float64)
    fd.check_layer(layer, rng.standard_normal((2, 2, 5, 6)))


# -- the column matrix: reused only when nothing else holds it -----------------------------------


def test_forward_reuses_its_matrix_only_when_nothing_else_holds_it() -> None:
    rng = np.random.default_rng(10)
    layer = Conv2d(2, 3, 3, padding=1, rng=rng)
    x1, x2 = (rng.standard_normal((2, 2, 6, 6)).astype(np.float32) for _ in range(2))
    layer.forward(x1)
    first = layer._cols
    first_id, first_copy = id(first), first.copy()
    del first
    layer.forward(x2)
    assert id(layer._cols) == first_id  # refilled in place: no new allocation

    saved = layer.save_cache()  # a pipeline keeps this forward's cache for its backward
    kept = saved["_cols"].copy()
    layer.forward(x1)
    assert layer._cols is not saved["_cols"]
    np.testing.assert_array_equal(saved["_cols"], kept)  # the saved cache is untouched
    np.testing.assert_array_equal(layer._cols, first_copy)

    view = layer._cols[:3]  # a view holds the matrix too
    layer.forward(x2)
    np.testing.assert_array_equal(view, first_copy[:3])

    layer.forward(rng.standard_normal((3, 2, 6, 6)).astype(np.float32))  # another batch: a new matrix
    assert layer._cols.shape == (3 * 36, 18)
