"""Model builders: exact architectures, parameter counts, forward/backward shapes."""

from __future__ import annotations

import numpy as np
import pytest

from hpcdl.models import build_model
from hpcdl.nn import BasicBlock, BatchNorm2d, Bottleneck, Conv2d, Linear, ReLU, SoftmaxCrossEntropy
from hpcdl.rng import generator


def _build(name: str, shape: tuple[int, ...], classes: int = 10, **kw):
    return build_model(name, shape, classes, rng=generator(0, "init"), dropout_rng=generator(0, 0, "d"), **kw)


def _count(model) -> int:
    return sum(p.size for p in model.parameters())


def test_mlp32_is_exactly_the_papers_network() -> None:
    model = _build("mlp32", (1, 28, 28))
    linears = [layer for layer in model if isinstance(layer, Linear)]
    assert len(linears) == 32
    assert [lin.weight.shape for lin in linears] == [(512, 784)] + [(512, 512)] * 30 + [(10, 512)]
    kinds = [type(layer).__name__ for layer in model][1:]  # after Flatten
    assert kinds == ["Linear", "ReLU"] * 31 + ["Linear"]
    assert all(p.dtype == np.float32 for p in model.parameters())
    assert len(model.parameters()) == 64
    # He initialisation: weight std ~ sqrt(2 / fan_in); biases zero
    w = linears[5].weight.data
    assert w.std() == pytest.approx(np.sqrt(2 / 512), rel=0.02)
    assert not linears[5].bias.data.any()


def test_mlp_depth_and_width() -> None:
    model = _build("mlp", (1, 8, 8), depth=3, width=100)
    assert [p.shape for p in model.parameters()] == [(100, 64), (100,), (100, 100), (100,), (10, 100), (10,)]
    assert [p.name for p in model.parameters()][:2] == ["1.weight", "1.bias"]


def test_same_stream_same_weights() -> None:
    a, b = _build("mlp", (64,)), _build("mlp", (64,))
    for p, q in zip(a.parameters(), b.parameters()):
        np.testing.assert_array_equal(p.data, q.data)


def test_cnn_structure() -> None:
    model = _build("cnn", (1, 8, 8), channels=16)
    kinds = [type(layer).__name__ for layer in model]
    assert kinds == [
        "Conv2d",
        "BatchNorm2d",
        "ReLU",
        "Conv2d",
        "BatchNorm2d",
        "ReLU",
        "MaxPool2d",
        "Flatten",
        "Linear",
    ]
    assert model[0].weight.shape == (16, 1, 3, 3) and model[3].weight.shape == (32, 16, 3, 3)
    assert model[8].weight.shape == (10, 32 * 4 * 4)


def test_vgg16_has_16_weight_layers() -> None:
    model = _build("vgg16", (3, 32, 32), width_mult=0.125)
    convs = [layer for layer in model if isinstance(layer, Conv2d)]
    linears = [layer for layer in model if isinstance(layer, Linear)]
    assert len(convs) == 13 and len(linears) == 3
    assert [c.weight.shape[0] for c in convs] == [8, 8, 16, 16, 32, 32, 32, 64, 64, 64, 64, 64, 64]
    assert sum(isinstance(layer, BatchNorm2d) for layer in model) == 13


@pytest.mark.parametrize(
    ("name", "block", "count", "expected"),
    [("resnet18", BasicBlock, 8, 11_689_512), ("resnet50", Bottleneck, 16, 25_557_032)],
)
def test_resnet_matches_reference_parameter_count(name, block, count, expected) -> None:
    """At width 1 with the ImageNet stem, the counts of torchvision's ResNets (1,000 classes)."""
    model = _build(name, (3, 64, 64), classes=1000)
    assert sum(isinstance(layer, block) for layer in model) == count
    assert _count(model) == expected


@pytest.mark.parametrize(
    ("name", "shape", "kw"),
    [
        ("mlp", (1, 8, 8), {}),
        ("cnn", (1, 8, 8), {"channels": 4}),
        ("vgg16", (1, 8, 8), {"width_mult": 0.0625}),
        ("vgg16", (3, 5, 7), {"width_mult": 0.0625}),
        ("resnet18", (3, 8, 8), {"width_mult": 0.0625}),
        ("resnet50", (3, 8, 8), {"width_mult": 0.0625}),
        ("resnet18", (3, 1, 1), {"width_mult": 0.0625}),
    ],
)
def test_forward_backward_any_input_size(name, shape, kw) -> None:
    model = _build(name, shape, classes=7, **kw)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, *shape)).astype(np.float32)
    y = rng.integers(0, 7, 4)
    loss_fn = SoftmaxCrossEntropy()
    logits = model.forward(x)
    assert logits.shape == (4, 7) and logits.dtype == np.float32
    loss = loss_fn.forward(logits, y)
    assert np.isfinite(loss)
    model.backward(loss_fn.backward())
    assert all(np.isfinite(p.grad).all() for p in model.parameters())
    assert any(p.grad.any() for p in model.parameters())


def test_float64_models() -> None:
    model = _build("cnn", (1, 8, 8), channels=4, dtype=np.float64)
    assert all(p.dtype == np.float64 for p in model.parameters())
    assert model.forward(np.zeros((2, 1, 8, 8))).dtype == np.float64


def test_unknown_model_and_bad_shape() -> None:
    with pytest.raises(ValueError, match="unknown model 'alexnet'"):
        _build("alexnet", (1, 8, 8))
    with pytest.raises(ValueError, match=r"needs image inputs \(C, H, W\)"):
        _build("cnn", (64,))


def test_relu_count_between_linears() -> None:
    model = _build("mlp", (4,), depth=2, width=3)
    assert [type(layer) for layer in model][1:] == [Linear, ReLU, Linear]
