"""``hpcdl.nn.winograd`` and ``Conv2d``'s Winograd path: against im2row, finite differences, the reference.

Winograd's products add in another order than im2row's, so float32 results agree to rounding
(a few ulps of the output's scale), not bit for bit; float64 gradients are checked against
finite differences. The compiled transforms equal the array-module reference bit for bit.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from test_conv import naive_conv  # the direct loops (tests/nn is on the path: no __init__.py)

from hpcdl.nn import Conv2d, winograd
from hpcdl.nn import conv as conv_module
from hpcdl.nn.winograd import conv3x3, filter_transform, input_transform, output_transform, planes, tiles

#: (N, C, O, H, W, padding): odd and even sizes, 1x1 and 2x2 outputs, batch 1 and more
SHAPES = [
    (1, 3, 5, 7, 6, 1),
    (2, 4, 2, 8, 8, 1),
    (3, 1, 1, 5, 5, 1),
    (2, 6, 3, 1, 1, 1),
    (1, 2, 4, 4, 3, 0),
    (2, 3, 3, 3, 5, 2),
    (4, 16, 8, 9, 9, 1),
]
BITS = {np.dtype(np.float32): np.uint32, np.dtype(np.float64): np.uint64}


def pair(n: int, c: int, o: int, p: int, bias: bool, dtype: Any, seed: int = 1) -> tuple[Conv2d, Conv2d]:
    """The same layer on the im2row path and on Winograd's (equal weights, a random bias)."""
    layers = []
    for wino in (False, True):
        layer = Conv2d(
            c, o, 3, padding=p, bias=bias, rng=np.random.default_rng(seed), dtype=dtype, winograd=wino
        )
        if bias:
            layer.bias.data[...] = np.random.default_rng(seed + 1).standard_normal(o)
        layers.append(layer)
    return layers[0], layers[1]


def close(a: np.ndarray, b: np.ndarray, scale: float) -> None:
    """Equal to float32 rounding: relative to the largest magnitude the sums pass through."""
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * scale)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(("n", "c", "o", "h", "w", "p"), SHAPES)
def test_forward_and_gradients_match_im2row_in_float32(rng, n, c, o, h, w, p, bias):
    ref, wino = pair(n, c, o, p, bias, np.float32)
    x = rng.standard_normal((n, c, h, w)).astype(np.float32)
    y_ref, y = ref.forward(x), wino.forward(x)
    assert wino.uses_winograd() and not ref.uses_winograd()
    assert y.flags.c_contiguous
    close(y, y_ref, np.abs(x).max() * np.abs(ref.weight.data).sum(axis=(1, 2, 3)).max() + 1)
    gy = rng.standard_normal(y.shape).astype(np.float32)
    gx_ref, gx = ref.backward(gy), wino.backward(gy)
    assert gx.dtype == np.float32 and gx.flags.c_contiguous
    close(gx, gx_ref, np.abs(gy).max() * np.abs(ref.weight.data).sum(axis=(0, 2, 3)).max())
    close(wino.weight.grad, ref.weight.grad, np.abs(gy).sum() * np.abs(x).max() / o)
    if bias:
        close(wino.bias.grad, ref.bias.grad, np.abs(gy).sum() / o)


@pytest.mark.parametrize(("n", "c", "o", "h", "w", "p"), SHAPES)
def test_float64_matches_im2row_and_the_naive_loops(rng, n, c, o, h, w, p):
    ref, wino = pair(n, c, o, p, True, np.float64)
    x = rng.standard_normal((n, c, h, w))
    y = wino.forward(x)
    np.testing.assert_allclose(y, ref.forward(x), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(y, naive_conv(x, wino.weight.data, wino.bias.data, (1, 1), (p, p)), atol=1e-12)
    gy = rng.standard_normal(y.shape)
    np.testing.assert_allclose(wino.backward(gy), ref.backward(gy), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(wino.weight.grad, ref.weight.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(("n", "c", "o", "h", "w", "p"), [s for s in SHAPES if s[1] * s[2] <= 24])
def test_gradcheck(fd, rng, n, c, o, h, w, p, bias):
    _, layer = pair(n, c, o, p, bias, np.float64)
    fd.check_layer(layer, rng.standard_normal((n, c, h, w)))


def test_chunks_give_the_whole_batchs_result(rng):
    x = rng.standard_normal((5, 3, 6, 7))
    u = filter_transform(rng.standard_normal((4, 3, 3, 3)))
    whole = conv3x3(x, u, 1)
    for step in (1, 2, 3, 5, 8):
        np.testing.assert_array_equal(conv3x3(x, u, 1, samples_per_chunk=step), whole)
    gx = conv3x3(whole, u, 1, rotated=True)
    np.testing.assert_array_equal(conv3x3(whole, u, 1, rotated=True, samples_per_chunk=2), gx)


def test_rotated_filters_are_a_permutation_of_the_transform(rng):
    w = rng.standard_normal((4, 3, 3, 3))
    rotated = filter_transform(np.ascontiguousarray(w[:, :, ::-1, ::-1].transpose(1, 0, 2, 3)))  # 16, C, O
    u = filter_transform(w)  # 16, O, C
    for k in range(16):
        np.testing.assert_array_equal(rotated[k], u[winograd.ROTATED[k]].T)


def test_a_layer_with_many_samples_goes_in_chunks_and_agrees(rng):
    # 3x3 outputs are 4 tiles a sample: CHUNK_TILES (64) makes chunks of 16 of the 40 samples
    ref, wino = pair(40, 64, 64, 1, True, np.float64)
    x = rng.standard_normal((40, 64, 3, 3))
    assert wino._winograd_chunk(np, 40, 3, 3) == 16
    np.testing.assert_allclose(wino.forward(x), ref.forward(x), rtol=1e-11, atol=1e-11)
    gy = rng.standard_normal((40, 64, 3, 3))
    np.testing.assert_allclose(wino.backward(gy), ref.backward(gy), rtol=1e-11, atol=1e-11)
    np.testing.assert_allclose(wino.weight.grad, ref.weight.grad, rtol=1e-11, atol=1e-11)
    np.testing.assert_allclose(wino.bias.grad, ref.bias.grad, rtol=1e-11, atol=1e-11)


kernel = pytest.importorskip("hpcdl._ext.winograd", reason="the kernels are not built: pip install -e .")


def assert_bits(a: np.ndarray, b: np.ndarray) -> None:
    """Equal bit for bit (signed zeros included), same shape and dtype."""
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    np.testing.assert_array_equal(a.view(BITS[a.dtype]), b.view(BITS[b.dtype]))


@pytest.fixture
def reference(monkeypatch: pytest.MonkeyPatch):
    """A function that runs its argument with the compiled transforms switched off."""

    def run(f, *args, **kwargs):
        with monkeypatch.context() as m:
            m.setattr(winograd, "_kernel", None)
            return f(*args, **kwargs)

    return run


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(("n", "c", "o", "h", "w", "p"), SHAPES)
def test_compiled_transforms_are_the_reference_bit_for_bit(rng, reference, dtype, n, c, o, h, w, p):
    x = rng.standard_normal((n, c, h, w)).astype(dtype)
    ho, wo = h + 2 * p - 2, w + 2 * p - 2
    th, tw = tiles(ho, wo)
    assert_bits(np.ascontiguousarray(input_transform(x, p, th, tw)), reference(input_transform, x, p, th, tw))
    g = rng.standard_normal((o, c, 3, 3)).astype(dtype)
    assert_bits(np.ascontiguousarray(filter_transform(g)), reference(filter_transform, g))
    m = planes(np, o, n * th * tw, dtype)
    m[...] = rng.standard_normal(m.shape)
    b = rng.standard_normal(o).astype(dtype)
    for bias in (None, b):
        assert_bits(output_transform(m, n, ho, wo, bias), reference(output_transform, m, n, ho, wo, bias))


@pytest.mark.parametrize(("n", "c", "o", "h", "w", "p"), SHAPES)
def test_a_layer_gives_the_same_bits_without_the_compiled_transforms(rng, reference, n, c, o, h, w, p):
    _, layer = pair(n, c, o, p, True, np.float32)
    x = rng.standard_normal((n, c, h, w)).astype(np.float32)
    gy = rng.standard_normal((n, o, h + 2 * p - 2, w + 2 * p - 2)).astype(np.float32)
    y, gx = layer.forward(x), layer.backward(gy)
    assert_bits(reference(layer.forward, x), y)
    assert_bits(reference(layer.backward, gy), gx)


def test_the_kernels_refuse_wrong_shapes():
    x = np.zeros((2, 3, 4, 4), np.float32)
    with pytest.raises(ValueError, match="expected"):
        kernel.input_transform(x, np.zeros((16, 3, 7), np.float32), 1, 2, 2)
    with pytest.raises(ValueError, match="do not cover"):
        kernel.input_transform(x, np.zeros((16, 3, 2), np.float32), 1, 1, 1)
    with pytest.raises(ValueError, match="not C-contiguous"):
        kernel.input_transform(x, np.zeros((16, 3, 16), np.float32)[:, :, ::2], 1, 2, 2)
    with pytest.raises(ValueError, match="expected"):
        kernel.output_transform(np.zeros((16, 3, 5), np.float32), x, np.zeros(0, np.float32), False)


def test_which_layers_use_winograd_by_default():
    big = conv_module.WINOGRAD_MIN_CHANNELS
    assert Conv2d(big, big, 3, padding=1).uses_winograd()
    assert not Conv2d(big - 1, big, 3, padding=1).uses_winograd()  # too few channels to pay
    assert not Conv2d(big, big, 3, stride=2, padding=1).uses_winograd()
    assert not Conv2d(big, big, 1).uses_winograd()
    assert not Conv2d(big, big, 3, padding=(1, 0)).uses_winograd()
    assert not Conv2d(big, big, 3, padding=3).uses_winograd()
    assert not Conv2d(big, big, 3, padding=1, winograd=False).uses_winograd()
    assert Conv2d(2, 2, 3, winograd=True).uses_winograd()


def test_winograd_on_a_layer_it_cannot_compute_is_refused():
    with pytest.raises(ValueError, match="stride 1"):
        Conv2d(64, 64, 3, stride=2, padding=1, winograd=True)
    layer = Conv2d(64, 64, 5, padding=2)
    layer.winograd = True
    with pytest.raises(ValueError, match="3x3 kernel"):
        layer.forward(np.zeros((1, 64, 4, 4), np.float32))


def test_switching_paths_between_steps(rng):
    ref, layer = pair(2, 3, 4, 1, True, np.float64)
    x, gy = rng.standard_normal((2, 3, 5, 5)), rng.standard_normal((2, 4, 5, 5))
    want = (ref.forward(x), ref.backward(gy), ref.weight.grad.copy())
    for wino in (True, False, True):
        layer.winograd = wino
        got = (layer.forward(x), layer.backward(gy), layer.weight.grad)
        for a, b in zip(got, want, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
