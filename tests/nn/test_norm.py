"""``hpcdl.nn.norm``: gradients in training and evaluation mode, running statistics, dtypes."""

from __future__ import annotations

import numpy as np
import pytest

from hpcdl.nn import BatchNorm1d, BatchNorm2d


def _randomise(bn, rng):
    """Non-trivial gamma, beta and running statistics."""
    c = bn.num_features
    bn.weight.data[...] = rng.uniform(0.5, 1.5, c)
    bn.bias.data[...] = rng.standard_normal(c)
    bn.running_mean[...] = rng.standard_normal(c)
    bn.running_var[...] = rng.uniform(0.5, 2.0, c)
    return bn


@pytest.mark.parametrize("training", [True, False])
def test_gradcheck_2d(fd, rng, training):
    bn = _randomise(BatchNorm2d(3, dtype=np.float64), rng).train(training)
    fd.check_layer(bn, rng.standard_normal((4, 3, 2, 3)) * 2 + 1)


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("shape", [(6, 4), (3, 4, 2)])
def test_gradcheck_1d(fd, rng, training, shape):
    bn = _randomise(BatchNorm1d(4, dtype=np.float64), rng).train(training)
    fd.check_layer(bn, rng.standard_normal(shape) * 2 + 1)


def test_training_forward_and_running_stats(rng):
    bn = _randomise(BatchNorm2d(3, eps=1e-3, momentum=0.2, dtype=np.float64), rng)
    rm0, rv0 = bn.running_mean.copy(), bn.running_var.copy()
    x = rng.standard_normal((4, 3, 2, 5)) * 3 + 2
    y = bn.forward(x)
    mean = x.mean(axis=(0, 2, 3))
    var = x.var(axis=(0, 2, 3))
    ref = (x - mean[:, None, None]) / np.sqrt(var[:, None, None] + 1e-3)
    ref = ref * bn.weight.data[:, None, None] + bn.bias.data[:, None, None]
    np.testing.assert_allclose(y, ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(bn.running_mean, 0.8 * rm0 + 0.2 * mean, rtol=1e-12)
    unbiased = x.var(axis=(0, 2, 3), ddof=1)
    np.testing.assert_allclose(bn.running_var, 0.8 * rv0 + 0.2 * unbiased, rtol=1e-12)


def test_eval_uses_running_stats_and_leaves_them(rng):
    bn = _randomise(BatchNorm1d(4, dtype=np.float64), rng).eval()
    rm0, rv0 = bn.running_mean.copy(), bn.running_var.copy()
    x = rng.standard_normal((5, 4))
    y = bn.forward(x)
    ref = (x - rm0) / np.sqrt(rv0 + bn.eps) * bn.weight.data + bn.bias.data
    np.testing.assert_allclose(y, ref, rtol=1e-12)
    np.testing.assert_array_equal(bn.running_mean, rm0)
    np.testing.assert_array_equal(bn.running_var, rv0)


def test_state_names_like_pytorch():
    bn = BatchNorm2d(3)
    assert [n for n, _ in bn.named_parameters()] == ["weight", "bias"]
    assert [n for n, _ in bn.named_buffers()] == ["running_mean", "running_var"]
    np.testing.assert_array_equal(bn.weight.data, 1)
    np.testing.assert_array_equal(bn.bias.data, 0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_dtype(dtype):
    bn = BatchNorm2d(2) if dtype == np.float32 else BatchNorm2d(2, dtype=dtype)
    assert bn.weight.dtype == dtype and bn.running_var.dtype == dtype
    y = bn.forward(np.arange(24, dtype=dtype).reshape(2, 2, 2, 3))
    assert y.dtype == dtype and bn.running_mean.dtype == dtype
    assert bn.backward(np.ones_like(y)).dtype == dtype


def test_one_value_per_channel_is_an_error():
    with pytest.raises(ValueError, match="more than one value"):
        BatchNorm1d(3).forward(np.ones((1, 3), np.float32))
    # ... but fine in evaluation mode.
    assert BatchNorm1d(3).eval().forward(np.ones((1, 3), np.float32)).shape == (1, 3)


@pytest.mark.parametrize("training", [True, False])
def test_matches_torch(rng, training):
    torch = pytest.importorskip("torch")
    bn = _randomise(BatchNorm2d(3, momentum=0.3, dtype=np.float64), rng).train(training)
    ref = torch.nn.BatchNorm2d(3, momentum=0.3).double().train(training)
    with torch.no_grad():
        ref.weight.copy_(torch.from_numpy(bn.weight.data))
        ref.bias.copy_(torch.from_numpy(bn.bias.data))
        ref.running_mean.copy_(torch.from_numpy(bn.running_mean))
        ref.running_var.copy_(torch.from_numpy(bn.running_var))
    x = rng.standard_normal((4, 3, 3, 2))
    y = bn.forward(x)
    gy = rng.standard_normal(y.shape)
    gx = bn.backward(gy)
    xt = torch.from_numpy(x.copy()).requires_grad_()
    yt = ref(xt)
    yt.backward(torch.from_numpy(gy))
    np.testing.assert_allclose(y, yt.detach().numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(gx, xt.grad.numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(bn.weight.grad, ref.weight.grad.numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(bn.bias.grad, ref.bias.grad.numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(bn.running_mean, ref.running_mean.numpy(), rtol=1e-12)
    np.testing.assert_allclose(bn.running_var, ref.running_var.numpy(), rtol=1e-12)
