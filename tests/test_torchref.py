"""``torch_twin``: PyTorch's twin computes what hpcdl's network computes, step after step.

Each network runs in float64 on both sides from the same weights: the outputs, the loss,
every parameter's gradient (by name), the parameters and BatchNorm's running statistics
after SGD-with-momentum steps, and an evaluation-mode forward on those statistics agree.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from hpcdl.bench.torchref import torch_twin
from hpcdl.errors import ConfigError
from hpcdl.models import build_model
from hpcdl.nn import (
    AvgPool2d,
    BatchNorm1d,
    Conv2d,
    Dropout,
    Flatten,
    Layer,
    Linear,
    ReLU,
    Sequential,
    SoftmaxCrossEntropy,
)
from hpcdl.nn.conv import out_size
from hpcdl.optim import SGD
from hpcdl.rng import generator

torch = pytest.importorskip("torch")

LR, MOMENTUM, STEPS, BATCH, CLASSES = 0.05, 0.9, 2, 4, 10


def _layers(layer: Layer) -> Iterator[Layer]:
    """``layer`` and every layer inside it."""
    yield layer
    for child in layer.children():
        yield from _layers(child)


def _odd_layers(shape: tuple[int, ...], rng: np.random.Generator) -> Sequential:
    """What no bundled model has: a biased strided Conv2d, AvgPool2d, BatchNorm1d, an unbiased Linear."""
    c, h, w = shape
    conv = Conv2d(c, 4, 3, stride=2, padding=(1, 0), bias=True, rng=rng, dtype=np.float64)
    conv.bias.data[...] = rng.standard_normal(4)  # zeros would not tell a bias from none
    h, w = out_size(h, 3, 2, 1), out_size(w, 3, 2, 0)  # the convolution's output
    pooled = 4 * out_size(h, 3, 2, 1) * out_size(w, 3, 2, 1)  # the pool's, flattened
    return Sequential(
        [
            conv,
            AvgPool2d(3, stride=2, padding=1),
            Flatten(),
            BatchNorm1d(pooled, eps=1e-3, momentum=0.3, dtype=np.float64),
            ReLU(),
            Linear(pooled, CLASSES, bias=False, rng=rng, dtype=np.float64),
        ]
    )


def _build(name: str, shape: tuple[int, ...], options: dict[str, Any]) -> Sequential:
    rng = generator(0, "init")
    if name == "odd-layers":
        return _odd_layers(shape, rng)
    model = build_model(name, shape, CLASSES, rng=rng, dropout_rng=generator(0, "dropout"), dtype=np.float64,
                        **options)  # fmt: skip
    for layer in _layers(model):
        if isinstance(layer, Dropout):  # PyTorch draws its own masks: both sides skip dropout
            layer.eval()
    return model


def _close(ours: Any, theirs: Any, what: str) -> None:
    theirs = theirs.detach().numpy() if hasattr(theirs, "detach") else np.asarray(theirs)
    scale = max(1.0, float(np.max(np.abs(theirs), initial=0.0)))
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-9 * scale, err_msg=what)


CASES = {
    "mlp32": ("mlp32", (1, 28, 28), {}),
    "cnn": ("cnn", (1, 8, 8), {}),  # bench step's digits-cnn network
    "cnn-dropout": ("cnn", (1, 8, 8), {"channels": 4, "dropout": 0.25}),
    "resnet18": ("resnet18", (3, 16, 16), {"width_mult": 0.25}),  # every stride and shortcut
    "resnet50": ("resnet50", (3, 16, 16), {"width_mult": 0.125}),
    "vgg16": ("vgg16", (3, 16, 16), {"width_mult": 0.125}),
    "odd-layers": ("odd-layers", (2, 9, 7), {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_twin_agrees_in_float64(case: str) -> None:
    name, shape, options = CASES[case]
    model = _build(name, shape, options)
    net = torch_twin(model, "--vs torch")
    assert [n for n, _ in net.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert all(p.dtype == torch.float64 for p in net.parameters())
    ours_params = dict(model.named_parameters())
    opt = SGD(model.parameters(), LR, momentum=MOMENTUM)
    topt = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)
    loss_fn = SoftmaxCrossEntropy()
    data = np.random.default_rng(1)
    for step in range(STEPS):  # the second step's update is the first to use the momentum
        x = data.standard_normal((BATCH, *shape))
        y = data.integers(0, CLASSES, BATCH)
        out = model.forward(x.copy()).copy()
        loss = loss_fn.forward(out, y)
        model.backward(loss_fn.backward())
        topt.zero_grad()
        tout = net(torch.from_numpy(x))
        tloss = torch.nn.functional.cross_entropy(tout, torch.from_numpy(y))
        tloss.backward()
        _close(out, tout, f"step {step}: output")
        _close(loss, tloss, f"step {step}: loss")
        for pname, p in net.named_parameters():
            _close(ours_params[pname].grad, p.grad, f"step {step}: gradient of {pname}")
        opt.step()
        topt.step()
        for pname, p in net.named_parameters():
            _close(ours_params[pname].data, p, f"after step {step}: {pname}")
    theirs = {k: v for k, v in net.state_dict().items() if not k.endswith("num_batches_tracked")}
    ours = model.state_dict()
    assert sorted(theirs) == sorted(ours)
    for key, value in ours.items():  # BatchNorm's running statistics: eps and momentum carried over
        _close(value, theirs[key], f"after {STEPS} steps: {key}")
    model.eval()
    net.eval()
    x = data.standard_normal((BATCH, *shape))
    with torch.no_grad():
        _close(model.forward(x.copy()), net(torch.from_numpy(x)), "evaluation-mode output")


def test_twin_copies_float32_weights_exactly_and_keeps_a_stages_names() -> None:
    model = build_model("cnn", (1, 8, 8), CLASSES, rng=generator(0, "init"), channels=4)
    stage = model[3:]  # a pipeline stage: the names are the whole model's
    net = torch_twin(stage, "--vs torch")
    theirs = net.state_dict()
    for key, value in stage.state_dict().items():
        assert theirs[key].dtype == torch.float32
        np.testing.assert_array_equal(theirs[key].numpy(), value, err_msg=key)
    assert [n for n, _ in net.named_parameters()] == ["3.weight", "4.weight", "4.bias", "8.weight", "8.bias"]


def test_dropout_twin_has_its_p_and_its_mode() -> None:
    model = build_model("cnn", (1, 8, 8), CLASSES, rng=generator(0, "init"), channels=4, dropout=0.25)
    drop = torch_twin(model, "--vs torch")[8]
    assert isinstance(drop, torch.nn.Dropout) and drop.p == 0.25 and drop.training
    model.eval()
    net = torch_twin(model, "--vs torch")
    assert not any(m.training for m in net.modules())  # BatchNorm on running statistics too


class _Scale(Layer):
    def forward(self, x: Any) -> Any:
        return 2 * x


class _Linear(Linear):
    """A subclass may compute otherwise: it gets no twin from its base class."""


@pytest.mark.parametrize("odd", [_Scale(), _Linear(4, 4)], ids=["layer", "subclass"])
def test_a_layer_without_twin_is_refused_in_one_line(odd: Layer) -> None:
    model = Sequential([Linear(4, 4), ReLU(), odd])
    refused = rf"^--vs torch: layer '2' is a {type(odd).__name__}, .*Conv2d"
    with pytest.raises(ConfigError, match=refused) as e:
        torch_twin(model, "--vs torch")
    assert "\n" not in str(e.value)
