"""``hpcdl.nn.pool``: gradients, naive-loop references, padding semantics, dtypes."""

from __future__ import annotations

import numpy as np
import pytest

from hpcdl.nn import AvgPool2d, GlobalAvgPool2d, MaxPool2d


def naive_pool(x, kernel, stride, padding, reduce, pad_value):
    """Direct loops over every output pixel."""
    n, c, h, w = x.shape
    (kh, kw), (sh, sw), (ph, pw) = kernel, stride, padding
    xp = np.full((n, c, h + 2 * ph, w + 2 * pw), pad_value)
    xp[:, :, ph : ph + h, pw : pw + w] = x
    ho, wo = (h + 2 * ph - kh) // sh + 1, (w + 2 * pw - kw) // sw + 1
    y = np.empty((n, c, ho, wo))
    for i in range(ho):
        for j in range(wo):
            y[:, :, i, j] = reduce(xp[:, :, i * sh : i * sh + kh, j * sw : j * sw + kw], axis=(2, 3))
    return y


GEOMETRIES = [
    # (kernel, stride, padding, H, W)
    (2, None, 0, 4, 6),  # the usual non-overlapping pool
    (3, 2, 1, 7, 6),  # overlapping windows, stride != kernel, padding
    ((3, 2), (1, 2), (1, 0), 5, 6),  # non-square everything
    (3, 1, 0, 5, 5),  # stride 1
]


@pytest.mark.parametrize(("k", "s", "p", "h", "w"), GEOMETRIES)
def test_maxpool_gradcheck(fd, rng, k, s, p, h, w):
    fd.check_layer(MaxPool2d(k, s, p), fd.distinct(rng, (2, 3, h, w)))


@pytest.mark.parametrize(("k", "s", "p", "h", "w"), GEOMETRIES)
def test_avgpool_gradcheck(fd, rng, k, s, p, h, w):
    fd.check_layer(AvgPool2d(k, s, p), rng.standard_normal((2, 3, h, w)))


def test_global_avgpool_gradcheck(fd, rng):
    fd.check_layer(GlobalAvgPool2d(), rng.standard_normal((3, 4, 3, 5)))


@pytest.mark.parametrize(("k", "s", "p", "h", "w"), GEOMETRIES)
def test_forward_matches_naive_loops(rng, k, s, p, h, w):
    x = rng.standard_normal((2, 3, h, w))
    mx, av = MaxPool2d(k, s, p), AvgPool2d(k, s, p)
    geo = (mx.kernel_size, mx.stride, mx.padding)
    np.testing.assert_array_equal(mx.forward(x), naive_pool(x, *geo, np.max, -np.inf))
    # AvgPool counts the zero padding in the mean (PyTorch's count_include_pad=True).
    np.testing.assert_allclose(av.forward(x), naive_pool(x, *geo, np.mean, 0.0), rtol=1e-12, atol=1e-15)


def test_maxpool_routes_gradient_to_the_maximum():
    x = np.array([[[[1.0, 5.0], [3.0, 2.0]]]])
    pool = MaxPool2d(2)
    np.testing.assert_array_equal(pool.forward(x), [[[[5.0]]]])
    np.testing.assert_array_equal(pool.backward(np.array([[[[7.0]]]])), [[[[0.0, 7.0], [0.0, 0.0]]]])


def test_global_avgpool_shape_and_values(rng):
    x = rng.standard_normal((2, 3, 4, 5))
    pool = GlobalAvgPool2d()
    y = pool.forward(x)
    assert y.shape == (2, 3)
    np.testing.assert_allclose(y, x.reshape(2, 3, -1).mean(-1), rtol=1e-12)
    gx = pool.backward(np.ones((2, 3)))
    assert gx.shape == x.shape and gx.flags.writeable
    np.testing.assert_allclose(gx, 1 / 20)


@pytest.mark.parametrize("layer", [MaxPool2d(2), AvgPool2d(3, 2, 1), GlobalAvgPool2d()])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_preserves_dtype(layer, dtype):
    x = np.arange(2 * 3 * 6 * 6, dtype=dtype).reshape(2, 3, 6, 6)
    y = layer.forward(x)
    assert y.dtype == dtype
    assert layer.backward(np.ones_like(y)).dtype == dtype


def test_bad_arguments():
    with pytest.raises(ValueError, match="at most half"):
        MaxPool2d(2, padding=2)
    with pytest.raises(ValueError, match="stride"):
        AvgPool2d(2, stride=0)


@pytest.mark.parametrize(("k", "s", "p", "h", "w"), GEOMETRIES)
def test_matches_torch(fd, rng, k, s, p, h, w):
    torch = pytest.importorskip("torch")
    f = torch.nn.functional
    x = fd.distinct(rng, (2, 3, h, w))
    for ours, ref in ((MaxPool2d(k, s, p), f.max_pool2d), (AvgPool2d(k, s, p), f.avg_pool2d)):
        y = ours.forward(x)
        gy = rng.standard_normal(y.shape)
        gx = ours.backward(gy)
        xt = torch.from_numpy(x.copy()).requires_grad_()
        yt = ref(xt, ours.kernel_size, ours.stride, ours.padding)
        yt.backward(torch.from_numpy(gy))
        np.testing.assert_allclose(y, yt.detach().numpy(), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(gx, xt.grad.numpy(), rtol=1e-12, atol=1e-12)


def test_maxpool_ties_go_to_the_first_maximum():
    pool = MaxPool2d(2)
    y = pool.forward(np.full((1, 1, 2, 2), 3.0))
    np.testing.assert_array_equal(y, [[[[3.0]]]])
    np.testing.assert_array_equal(pool.backward(np.ones((1, 1, 1, 1))), [[[[1.0, 0.0], [0.0, 0.0]]]])
