"""``hpcdl.nn.sequential``: gradients of a small model, stages, state, modes."""

from __future__ import annotations

import numpy as np
import pytest

from hpcdl.nn import (
    AvgPool2d,
    BasicBlock,
    BatchNorm1d,
    BatchNorm2d,
    Conv2d,
    Dropout,
    Flatten,
    GlobalAvgPool2d,
    Linear,
    MaxPool2d,
    ReLU,
    Sequential,
    SoftmaxCrossEntropy,
)


def small_cnn(seed: int = 0, dtype=np.float64, p: float = 0.2) -> Sequential:
    """Every layer kind in one model (no bias before a BatchNorm: its gradient is exactly zero)."""
    rng = np.random.default_rng(seed)
    return Sequential(
        [
            Conv2d(2, 3, 3, padding=1, bias=False, rng=rng, dtype=dtype),
            BatchNorm2d(3, dtype=dtype),
            ReLU(),
            MaxPool2d(2),
            Flatten(),
            Linear(3 * 3 * 3, 5, bias=False, rng=rng, dtype=dtype),
            BatchNorm1d(5, dtype=dtype),
            ReLU(),
            Dropout(p, rng=np.random.default_rng(seed + 1)),
            Linear(5, 4, rng=rng, dtype=dtype),
        ]
    )


def resnet_like(seed: int = 0, dtype=np.float64) -> Sequential:
    rng = np.random.default_rng(seed)
    return Sequential(
        [
            Conv2d(2, 3, 3, padding=1, bias=False, rng=rng, dtype=dtype),
            BatchNorm2d(3, dtype=dtype),
            ReLU(),
            BasicBlock(3, 4, 2, rng=rng, dtype=dtype),
            AvgPool2d(2, 1),
            GlobalAvgPool2d(),
            Linear(4, 3, rng=rng, dtype=dtype),
        ]
    )


def test_small_sequential_gradcheck(fd, rng):
    model = small_cnn()
    drop = model[8]

    def same_mask() -> None:
        drop.rng = np.random.default_rng(3)

    fd.check_layer(model, fd.distinct(rng, (4, 2, 6, 6), gap=0.01), before_forward=same_mask)


def test_resnet_like_gradcheck(fd, rng):
    fd.check_layer(resnet_like(), rng.standard_normal((2, 2, 6, 6)))


def test_slice_keeps_names_and_shares_parameters():
    model = small_cnn()
    stage = model[5:8]
    assert isinstance(stage, Sequential) and len(stage) == 3
    assert stage[0] is model[5]
    assert [n for n, _ in stage.named_parameters()] == ["5.weight", "6.weight", "6.bias"]
    assert [n for n, _ in stage.named_buffers()] == ["6.running_mean", "6.running_var"]
    whole = dict(model.named_parameters())
    for name, p in stage.named_parameters():
        assert whole[name] is p and p.name == name
    assert [layer.name for layer in stage] == ["5", "6", "7"]


def test_stage_by_stage_equals_whole_model(rng):
    x = rng.standard_normal((4, 2, 6, 6))
    labels = np.array([0, 1, 2, 3])
    runs = []
    for cuts in ([0, 10], [0, 3, 6, 10], [0, 1, 9, 10]):
        model = small_cnn(p=0.0)
        stages = [model[a:b] for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
        h = x.copy()
        for s in stages:
            h = s.forward(h)
        loss = SoftmaxCrossEntropy()
        value = loss.forward(h, labels)
        g = loss.backward()
        for s in reversed(stages):
            g = s.backward(g)
        runs.append((value, g, {n: p.grad.copy() for n, p in model.named_parameters()}))
    value0, gx0, grads0 = runs[0]
    for value, gx, grads in runs[1:]:
        assert value == value0
        np.testing.assert_array_equal(gx, gx0)
        for name, g in grads0.items():
            np.testing.assert_array_equal(grads[name], g, err_msg=name)


def test_state_dict_round_trip_with_buffers(rng):
    src = small_cnn(seed=0, dtype=np.float32)
    for _ in range(2):  # move the running statistics away from their start
        src.forward(rng.standard_normal((4, 2, 6, 6)).astype(np.float32))
    state = src.state_dict()
    expected = {"0.weight", "1.running_mean", "1.running_var", "5.weight", "6.running_mean", "9.bias"}
    assert expected <= set(state)
    assert not np.all(state["1.running_mean"] == 0)
    dst = small_cnn(seed=5, dtype=np.float32)
    dst.load_state_dict(state)
    for name, value in dst.state_dict().items():
        np.testing.assert_array_equal(value, state[name], err_msg=name)
    x = rng.standard_normal((3, 2, 6, 6)).astype(np.float32)
    src.eval()
    dst.eval()
    np.testing.assert_array_equal(src.forward(x.copy()), dst.forward(x.copy()))
    state["1.running_var"] = np.ones(7, np.float32)
    with pytest.raises(ValueError, match="running_var"):
        dst.load_state_dict(state)


def test_block_state_names_inside_a_model():
    model = resnet_like(dtype=np.float32)
    names = list(model.state_dict())
    assert "3.conv1.weight" in names and "3.shortcut.0.weight" in names
    assert "3.shortcut.1.running_var" in names and "3.bn2.running_mean" in names
    assert model[3].conv1.weight.name == "3.conv1.weight"


def test_eval_mode_disables_dropout_and_freezes_batchnorm(rng):
    model = small_cnn(p=0.5).eval()
    assert all(not layer.training for layer in model)
    x = rng.standard_normal((3, 2, 6, 6))
    rm = model[1].running_mean.copy()
    y1 = model.forward(x.copy())
    y2 = model.forward(x.copy())
    np.testing.assert_array_equal(y1, y2)
    np.testing.assert_array_equal(model[1].running_mean, rm)
    model.train()
    assert all(layer.training for layer in model)


def test_default_dtype_is_float32():
    model = Sequential([Linear(3, 4), ReLU(), Dropout(0.1), Linear(4, 2)])
    assert all(p.dtype == np.float32 and p.grad.dtype == np.float32 for p in model.parameters())
    y = model.forward(np.ones((2, 3), np.float32))
    assert y.dtype == np.float32
    assert model.backward(np.ones_like(y)).dtype == np.float32


def test_first_layer_without_input_grad():
    model = Sequential([Flatten(), Linear(4, 3), ReLU(), Linear(3, 2)])
    model[1].needs_input_grad = False
    y = model.forward(np.ones((2, 2, 2), np.float32))
    assert model.backward(np.ones_like(y)) is None
    assert np.any(model[1].weight.grad != 0)
