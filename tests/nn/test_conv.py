"""``hpcdl.nn.conv``: gradients, a naive-loop reference, geometry, dtypes."""

from __future__ import annotations

import numpy as np
import pytest

from hpcdl.nn import Conv2d


def naive_conv(x, w, b, stride, padding):
    """Direct loops over every output pixel (independent of im2col)."""
    n, c, h, wd = x.shape
    o, _, kh, kw = w.shape
    (sh, sw), (ph, pw) = stride, padding
    xp = np.zeros((n, c, h + 2 * ph, wd + 2 * pw))
    xp[:, :, ph : ph + h, pw : pw + wd] = x
    ho, wo = (h + 2 * ph - kh) // sh + 1, (wd + 2 * pw - kw) // sw + 1
    y = np.zeros((n, o, ho, wo))
    for i in range(ho):
        for j in range(wo):
            patch = xp[:, :, i * sh : i * sh + kh, j * sw : j * sw + kw]  # N, C, kh, kw
            y[:, :, i, j] = np.einsum("nckl,ockl->no", patch, w)
    return y + (0 if b is None else b[None, :, None, None])


CASES = [
    # (C, O, kernel, stride, padding, H, W)
    (3, 4, (3, 2), 2, 1, 6, 7),
    (2, 3, 3, 1, 0, 5, 5),
    (2, 2, (2, 3), (1, 2), (0, 1), 5, 6),
    (3, 2, 1, 2, 0, 5, 4),
]


@pytest.mark.parametrize(("c", "o", "k", "s", "p", "h", "w"), CASES)
def test_gradcheck(fd, rng, c, o, k, s, p, h, w):
    layer = Conv2d(c, o, k, s, p, rng=rng, dtype=np.float64)
    layer.bias.data[...] = rng.standard_normal(o)
    fd.check_layer(layer, rng.standard_normal((2, c, h, w)))


def test_gradcheck_without_bias(fd, rng):
    layer = Conv2d(2, 3, (3, 2), stride=2, padding=1, bias=False, rng=rng, dtype=np.float64)
    assert [n for n, _ in layer.named_parameters()] == ["weight"]
    fd.check_layer(layer, rng.standard_normal((2, 2, 5, 6)))


@pytest.mark.parametrize(("c", "o", "k", "s", "p", "h", "w"), CASES)
def test_forward_matches_naive_loops(rng, c, o, k, s, p, h, w):
    layer = Conv2d(c, o, k, s, p, rng=rng, dtype=np.float64)
    layer.bias.data[...] = rng.standard_normal(o)
    x = rng.standard_normal((2, c, h, w))
    y = layer.forward(x)
    ref = naive_conv(x, layer.weight.data, layer.bias.data, layer.stride, layer.padding)
    assert y.shape == ref.shape
    assert y.flags.c_contiguous
    np.testing.assert_allclose(y, ref, rtol=1e-12, atol=1e-12)


def test_needs_input_grad_false(rng):
    layer = Conv2d(2, 3, 3, padding=1, rng=rng)
    layer.needs_input_grad = False
    y = layer.forward(rng.standard_normal((2, 2, 4, 4)).astype(np.float32))
    assert layer.backward(np.ones_like(y)) is None
    assert np.any(layer.weight.grad != 0)


def test_dtypes_and_init():
    layer = Conv2d(3, 8, 3)
    assert layer.weight.shape == (8, 3, 3, 3) and layer.weight.dtype == np.float32
    y = layer.forward(np.ones((1, 3, 5, 5), np.float32))
    assert y.dtype == np.float32 and y.shape == (1, 8, 3, 3)
    assert layer.backward(np.ones_like(y)).dtype == np.float32
    big = Conv2d(64, 64, 3, rng=np.random.default_rng(0))
    assert abs(big.weight.data.std() / np.sqrt(2 / (64 * 9)) - 1) < 0.02
    assert Conv2d(3, 8, 3, dtype=np.float64).weight.dtype == np.float64


def test_bad_arguments():
    with pytest.raises(ValueError, match="kernel_size"):
        Conv2d(1, 1, (1, 2, 3))
    with pytest.raises(ValueError, match="stride"):
        Conv2d(1, 1, 3, stride=0)
    with pytest.raises(ValueError, match=r"\(1, 2, 5, 5\)"):
        Conv2d(3, 1, 3).forward(np.ones((1, 2, 5, 5), np.float32))


@pytest.mark.parametrize(("c", "o", "k", "s", "p", "h", "w"), CASES)
def test_matches_torch(rng, c, o, k, s, p, h, w):
    torch = pytest.importorskip("torch")
    layer = Conv2d(c, o, k, s, p, rng=rng, dtype=np.float64)
    layer.bias.data[...] = rng.standard_normal(o)
    x = rng.standard_normal((2, c, h, w))
    y = layer.forward(x)
    gy = rng.standard_normal(y.shape)
    gx = layer.backward(gy)
    wt = torch.from_numpy(layer.weight.data.copy()).requires_grad_()
    bt = torch.from_numpy(layer.bias.data.copy()).requires_grad_()
    xt = torch.from_numpy(x).requires_grad_()
    yt = torch.nn.functional.conv2d(xt, wt, bt, stride=layer.stride, padding=layer.padding)
    yt.backward(torch.from_numpy(gy))
    np.testing.assert_allclose(y, yt.detach().numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(gx, xt.grad.numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(layer.weight.grad, wt.grad.numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(layer.bias.grad, bt.grad.numpy(), rtol=1e-10, atol=1e-12)
