"""``hpcdl.nn.loss``: gradients, values against direct formulas, stability, accuracy."""

from __future__ import annotations

import numpy as np
import pytest

from hpcdl.nn import MSELoss, SoftmaxCrossEntropy, accuracy


def test_cross_entropy_gradcheck(fd, rng):
    fd.check_loss(SoftmaxCrossEntropy(), rng.standard_normal((5, 4)) * 3, rng.integers(0, 4, 5))


def test_mse_gradcheck(fd, rng):
    fd.check_loss(MSELoss(), rng.standard_normal((4, 3)), rng.standard_normal((4, 3)))


def test_cross_entropy_value(rng):
    logits = rng.standard_normal((6, 5))
    labels = rng.integers(0, 5, 6)
    ref = np.mean([np.log(np.sum(np.exp(row))) - row[k] for row, k in zip(logits, labels, strict=True)])
    assert SoftmaxCrossEntropy().forward(logits, labels) == pytest.approx(ref, rel=1e-12)


def test_cross_entropy_is_stable_for_huge_logits():
    loss = SoftmaxCrossEntropy()
    logits = np.array([[1000.0, 0.0], [-1000.0, 0.0]], np.float32)
    value = loss.forward(logits, np.array([0, 0]))
    assert value == pytest.approx(500.0)
    g = loss.backward()
    assert np.all(np.isfinite(g)) and g.dtype == np.float32
    np.testing.assert_allclose(g, [[0, 0], [-0.5, 0.5]], atol=1e-7)


def test_cross_entropy_backward_does_not_change_with_repeats(rng):
    loss = SoftmaxCrossEntropy()
    loss.forward(rng.standard_normal((3, 4)), np.array([0, 1, 2]))
    np.testing.assert_array_equal(loss.backward(), loss.backward())


def test_mse_value(rng):
    pred, target = rng.standard_normal((4, 3)), rng.standard_normal((4, 3))
    assert MSELoss().forward(pred, target) == pytest.approx(np.mean((pred - target) ** 2), rel=1e-12)


def test_shape_errors():
    with pytest.raises(ValueError, match=r"\(3,\)"):
        SoftmaxCrossEntropy().forward(np.zeros((2, 4)), np.zeros(3, int))
    with pytest.raises(ValueError, match="differ"):
        MSELoss().forward(np.zeros((2, 4)), np.zeros((2, 3)))
    with pytest.raises(RuntimeError, match="before forward"):
        SoftmaxCrossEntropy().backward()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gradient_dtype(dtype):
    ce = SoftmaxCrossEntropy()
    ce.forward(np.zeros((2, 3), dtype), np.array([0, 2]))
    assert ce.backward().dtype == dtype
    mse = MSELoss()
    mse.forward(np.zeros((2, 3), dtype), np.ones((2, 3), dtype))
    assert mse.backward().dtype == dtype


def test_accuracy():
    logits = np.array([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7], [0.6, 0.4]])
    assert accuracy(logits, np.array([1, 0, 0, 0])) == pytest.approx(0.75)


def test_matches_torch(rng):
    torch = pytest.importorskip("torch")
    logits = rng.standard_normal((5, 4)) * 3
    labels = rng.integers(0, 4, 5)
    ce = SoftmaxCrossEntropy()
    value = ce.forward(logits, labels)
    lt = torch.from_numpy(logits.copy()).requires_grad_()
    ref = torch.nn.functional.cross_entropy(lt, torch.from_numpy(labels))
    ref.backward()
    assert value == pytest.approx(ref.item(), rel=1e-12)
    np.testing.assert_allclose(ce.backward(), lt.grad.numpy(), rtol=1e-12, atol=1e-15)
