"""``hpcdl.nn.residual``: BasicBlock and Bottleneck gradients, structure, names, modes."""

from __future__ import annotations

import numpy as np
import pytest

from hpcdl.nn import BasicBlock, BatchNorm2d, Bottleneck, Conv2d, ReLU


def _randomise_bn(block, rng):
    """Non-trivial BatchNorm affine parameters so every branch contributes."""
    for name, p in block.named_parameters():
        if "bn" in name or name.startswith("shortcut.1"):
            scale = name.endswith("weight")
            p.data[...] = rng.uniform(0.5, 1.5, p.shape) if scale else rng.normal(0, 0.5, p.shape)
    return block


@pytest.mark.parametrize(("cin", "cout", "stride"), [(3, 3, 1), (2, 4, 2), (3, 4, 1)])
def test_basic_block_gradcheck(fd, rng, cin, cout, stride):
    block = _randomise_bn(BasicBlock(cin, cout, stride, rng=rng, dtype=np.float64), rng)
    assert (block.shortcut is None) == (cin == cout and stride == 1)
    fd.check_layer(block, rng.standard_normal((2, cin, 5, 4)))


@pytest.mark.parametrize(("cin", "mid", "stride"), [(8, 2, 1), (3, 2, 2)])
def test_bottleneck_gradcheck(fd, rng, cin, mid, stride):
    block = _randomise_bn(Bottleneck(cin, mid, stride, rng=rng, dtype=np.float64), rng)
    assert (block.shortcut is None) == (cin == mid * 4 and stride == 1)
    fd.check_layer(block, rng.standard_normal((2, cin, 5, 4)))


def test_basic_block_equals_its_parts(rng):
    block = _randomise_bn(BasicBlock(2, 4, 2, rng=rng, dtype=np.float64), rng)
    x = rng.standard_normal((2, 2, 6, 6))
    h = block.bn2.forward(block.conv2.forward(np.maximum(block.bn1.forward(block.conv1.forward(x)), 0)))
    s = block.shortcut[1].forward(block.shortcut[0].forward(x))
    np.testing.assert_allclose(block.forward(x), np.maximum(h + s, 0), rtol=1e-12)
    assert block.forward(x).shape == (2, 4, 3, 3)


def test_bottleneck_shapes_and_structure():
    block = Bottleneck(16, 4, stride=2)
    y = block.forward(np.ones((2, 16, 8, 8), np.float32))
    assert y.shape == (2, 16, 4, 4) and y.dtype == np.float32
    assert block.conv1.kernel_size == (1, 1) and block.conv3.kernel_size == (1, 1)
    assert block.conv2.kernel_size == (3, 3) and block.conv2.stride == (2, 2)
    assert Bottleneck(4, 4, expansion=2).out_channels == 8


def test_parameter_and_buffer_names():
    block = BasicBlock(2, 4, stride=2)
    assert [n for n, _ in block.named_parameters()] == [
        "conv1.weight",
        "bn1.weight",
        "bn1.bias",
        "conv2.weight",
        "bn2.weight",
        "bn2.bias",
        "shortcut.0.weight",
        "shortcut.1.weight",
        "shortcut.1.bias",
    ]
    assert [n for n, _ in block.named_buffers()] == [
        "bn1.running_mean",
        "bn1.running_var",
        "bn2.running_mean",
        "bn2.running_var",
        "shortcut.1.running_mean",
        "shortcut.1.running_var",
    ]
    assert [p.name for p in block.parameters()] == [n for n, _ in block.named_parameters()]
    assert isinstance(block.shortcut[0], Conv2d) and isinstance(block.shortcut[1], BatchNorm2d)
    assert block.conv1.bias is None
    identity = Bottleneck(8, 2)
    assert identity.shortcut is None
    assert "shortcut" not in {n.split(".")[0] for n, _ in identity.named_parameters()}


def test_eval_propagates_to_every_child(rng):
    block = BasicBlock(2, 4, stride=2).eval()
    assert all(not layer.training for layer in (block.bn1, block.bn2, block.shortcut[1]))
    rm = block.bn1.running_mean.copy()
    block.forward(rng.standard_normal((2, 2, 4, 4)).astype(np.float32))
    np.testing.assert_array_equal(block.bn1.running_mean, rm)
    block.train()
    assert block.bn1.training and block.shortcut[1].training
    assert isinstance(block.relu_out, ReLU)


def test_dtype_and_rng_determinism():
    a = BasicBlock(2, 4, 2, rng=np.random.default_rng(9))
    b = BasicBlock(2, 4, 2, rng=np.random.default_rng(9))
    assert all(p.dtype == np.float32 for p in a.parameters())
    for (_, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        np.testing.assert_array_equal(pa.data, pb.data)
    # The convolutions draw from one stream in turn: they differ from each other.
    assert not np.array_equal(a.conv2.weight.data[:, :2], a.conv1.weight.data[:, :2, :, :])
    assert all(p.dtype == np.float64 for p in Bottleneck(4, 2, dtype=np.float64).parameters())


def test_matches_torch(rng):
    torch = pytest.importorskip("torch")
    block = _randomise_bn(BasicBlock(2, 3, 2, rng=rng, dtype=np.float64), rng)
    t = torch.nn
    ref_main = t.Sequential(
        t.Conv2d(2, 3, 3, 2, 1, bias=False), t.BatchNorm2d(3), t.ReLU(),
        t.Conv2d(3, 3, 3, 1, 1, bias=False), t.BatchNorm2d(3),
    ).double()  # fmt: skip
    ref_short = t.Sequential(t.Conv2d(2, 3, 1, 2, 0, bias=False), t.BatchNorm2d(3)).double()
    ours = [block.conv1, block.bn1, None, block.conv2, block.bn2, *block.shortcut]
    theirs = [*ref_main, *ref_short]
    with torch.no_grad():
        for o, r in zip(ours, theirs, strict=True):
            if o is not None:
                for name, p in o.named_parameters():
                    getattr(r, name).copy_(torch.from_numpy(p.data))
    x = rng.standard_normal((2, 2, 5, 5))
    y = block.forward(x)
    gy = rng.standard_normal(y.shape)
    gx = block.backward(gy.copy())
    xt = torch.from_numpy(x.copy()).requires_grad_()
    yt = torch.relu(ref_main(xt) + ref_short(xt))
    yt.backward(torch.from_numpy(gy))
    np.testing.assert_allclose(y, yt.detach().numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(gx, xt.grad.numpy(), rtol=1e-10, atol=1e-12)
    gw = ref_main[0].weight.grad.numpy()
    np.testing.assert_allclose(block.conv1.weight.grad, gw, rtol=1e-10, atol=1e-12)
