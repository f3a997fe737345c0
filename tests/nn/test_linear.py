"""``hpcdl.nn.linear``: gradients, values, dtypes, initialisation, skipped input gradient."""

from __future__ import annotations

import numpy as np
import pytest

from hpcdl.nn import Linear


def test_gradcheck(fd, rng):
    layer = Linear(5, 4, rng=rng, dtype=np.float64)
    layer.bias.data[...] = rng.standard_normal(4)
    fd.check_layer(layer, rng.standard_normal((3, 5)))


def test_gradcheck_without_bias(fd, rng):
    layer = Linear(5, 4, bias=False, rng=rng, dtype=np.float64)
    assert [n for n, _ in layer.named_parameters()] == ["weight"]
    fd.check_layer(layer, rng.standard_normal((3, 5)))


def test_forward_values(rng):
    layer = Linear(6, 3, rng=rng, dtype=np.float64)
    layer.bias.data[...] = [1.0, -2.0, 0.5]
    x = rng.standard_normal((4, 6))
    expected = np.einsum("ni,oi->no", x, layer.weight.data) + layer.bias.data
    np.testing.assert_allclose(layer.forward(x), expected, rtol=1e-12, atol=1e-12)


def test_grads_are_overwritten_not_accumulated(rng):
    layer = Linear(3, 2, rng=rng)
    x = rng.standard_normal((4, 3)).astype(np.float32)
    gy = rng.standard_normal((4, 2)).astype(np.float32)
    layer.forward(x)
    layer.backward(gy)
    first = layer.weight.grad.copy(), layer.bias.grad.copy()
    layer.forward(x)
    layer.backward(gy)
    np.testing.assert_array_equal(layer.weight.grad, first[0])
    np.testing.assert_array_equal(layer.bias.grad, first[1])


def test_needs_input_grad_false_skips_gx_but_keeps_param_grads(rng):
    a = Linear(3, 2, rng=np.random.default_rng(5))
    b = Linear(3, 2, rng=np.random.default_rng(5))
    b.needs_input_grad = False
    x = rng.standard_normal((4, 3)).astype(np.float32)
    gy = rng.standard_normal((4, 2)).astype(np.float32)
    a.forward(x)
    b.forward(x)
    assert a.backward(gy) is not None
    assert b.backward(gy) is None
    np.testing.assert_array_equal(a.weight.grad, b.weight.grad)
    np.testing.assert_array_equal(a.bias.grad, b.bias.grad)


def test_dtype_default_float32_and_float64_on_request(rng):
    f32 = Linear(4, 3)
    assert f32.weight.dtype == np.float32 and f32.bias.dtype == np.float32
    assert f32.forward(np.ones((2, 4), np.float32)).dtype == np.float32
    f64 = Linear(4, 3, dtype=np.float64)
    assert f64.weight.dtype == np.float64 and f64.weight.grad.dtype == np.float64
    assert f64.forward(np.ones((2, 4))).dtype == np.float64


def test_he_init_statistics_and_determinism():
    layer = Linear(400, 300, rng=np.random.default_rng(3))
    w = layer.weight.data
    assert w.shape == (300, 400)
    assert abs(w.std() / np.sqrt(2 / 400) - 1) < 0.02
    assert abs(w.mean()) < 0.01
    np.testing.assert_array_equal(layer.bias.data, 0)
    again = Linear(400, 300, rng=np.random.default_rng(3))
    np.testing.assert_array_equal(w, again.weight.data)
    # float32 and float64 layers from the same stream agree up to rounding.
    w64 = Linear(400, 300, rng=np.random.default_rng(3), dtype=np.float64).weight.data
    np.testing.assert_array_equal(w, w64.astype(np.float32))


def test_bad_input_shape_names_the_shapes():
    layer = Linear(4, 3)
    with pytest.raises(ValueError, match=r"\(2, 5\).*\(N, 4\)"):
        layer.forward(np.ones((2, 5), np.float32))


def test_matches_torch(rng):
    torch = pytest.importorskip("torch")
    layer = Linear(5, 4, rng=rng, dtype=np.float64)
    layer.bias.data[...] = rng.standard_normal(4)
    ref = torch.nn.Linear(5, 4).double()
    with torch.no_grad():
        ref.weight.copy_(torch.from_numpy(layer.weight.data))
        ref.bias.copy_(torch.from_numpy(layer.bias.data))
    x = rng.standard_normal((3, 5))
    gy = rng.standard_normal((3, 4))
    xt = torch.from_numpy(x.copy()).requires_grad_()
    yt = ref(xt)
    yt.backward(torch.from_numpy(gy))
    y = layer.forward(x)
    gx = layer.backward(gy)
    np.testing.assert_allclose(y, yt.detach().numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(gx, xt.grad.numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(layer.weight.grad, ref.weight.grad.numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(layer.bias.grad, ref.bias.grad.numpy(), rtol=1e-12, atol=1e-12)
