"""K-FAC in one process against an independent float64 computation of its formulas.

The independent side captures each covered layer's input and output gradient with a plain
observer, writes ā (with the bias's 1; a convolution's patches by explicit loops over the
kernel) and g = B · ∂L/∂s itself, sums the factors with the docstring's normalisation, and
solves ``(G ⊗ A + damping · I) vec(P) = vec(∇W)`` — the Kronecker form the eigenbasis
formula equals — instead of decomposing. Then the first update, KL clipping and momentum
included. Cases: Linear and Conv2d with and without bias, and a convolution inside a
residual block (the hook reaches it).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from hpcdl.errors import HpcdlError
from hpcdl.nn import Flatten, Linear, ReLU, Sequential, SoftmaxCrossEntropy, observe
from hpcdl.nn.conv import Conv2d
from hpcdl.nn.hooks import depth
from hpcdl.nn.residual import BasicBlock
from hpcdl.optim.kfac import KFAC, covered_layers

RNG = np.random.default_rng(5)
F64 = np.float64


class Capture:
    """Every covered layer's input and output gradient, inside blocks too (and at which depth)."""

    nested = True

    def __init__(self, layers: list[Any]) -> None:
        self.ids = {id(x) for x in layers}
        self.x: dict[int, Any] = {}
        self.gy: dict[int, Any] = {}
        self.depth: dict[int, int] = {}

    def before(self, phase: str, layer: Any, x: Any) -> None:
        if id(layer) in self.ids:
            (self.x if phase == "forward" else self.gy)[id(layer)] = np.array(x, dtype=F64)
            self.depth[id(layer)] = depth()

    def after(self, phase: str, layer: Any, y: Any) -> None:
        pass


def patches(x: np.ndarray, conv: Conv2d) -> np.ndarray:
    """(B, T, C kh kw): each output position's input patch, by loops (padding with zeros)."""
    (kh, kw), (sh, sw), (ph, pw) = conv.kernel_size, conv.stride, conv.padding
    b, c, h, w = x.shape
    xp = np.zeros((b, c, h + 2 * ph, w + 2 * pw))
    xp[:, :, ph : ph + h, pw : pw + w] = x
    ho, wo = (h + 2 * ph - kh) // sh + 1, (w + 2 * pw - kw) // sw + 1
    out = np.zeros((b, ho * wo, c * kh * kw))
    for i in range(ho):
        for j in range(wo):
            out[:, i * wo + j] = xp[:, :, i * sh : i * sh + kh, j * sw : j * sw + kw].reshape(b, -1)
    return out


def factors(layer: Any, x: np.ndarray, gy: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A and G from the formulas (B the batch, T the positions; g = B dL/ds)."""
    b = x.shape[0]
    if isinstance(layer, Linear):
        a, g = x, b * gy  # B, in / B, out
    else:
        a = patches(x, layer).reshape(-1, layer.in_channels * np.prod(layer.kernel_size))  # B*T, K
        g = (b * gy).transpose(0, 2, 3, 1).reshape(-1, gy.shape[1])  # B*T, O
    if layer.bias is not None:
        a = np.concatenate([a, np.ones((a.shape[0], 1))], axis=1)
    n = a.shape[0]  # B or B*T
    A = sum(np.outer(r, r) for r in a) / n
    G = sum(np.outer(r, r) for r in g) / n
    return A, G


def preconditioned(A: np.ndarray, G: np.ndarray, grad: np.ndarray, damping: float) -> np.ndarray:
    """P with (G ⊗ A + damping I) vec(P) = vec(∇W), row-major vec (W is (out, in))."""
    eye = np.eye(A.shape[0] * G.shape[0])
    return np.linalg.solve(np.kron(G, A) + damping * eye, grad.ravel()).reshape(grad.shape)


def weight_grad(layer: Any) -> np.ndarray:
    g = np.array(layer.weight.grad, dtype=F64).reshape(layer.weight.shape[0], -1)
    if layer.bias is not None:
        g = np.concatenate([g, np.array(layer.bias.grad, dtype=F64)[:, None]], axis=1)
    return g


def model_of(kind: str) -> tuple[Sequential, np.ndarray]:
    kw = {"dtype": F64, "rng": np.random.default_rng(1)}
    if kind == "linear":
        net = Sequential([Flatten(), Linear(12, 5, bias=True, **kw), ReLU(), Linear(5, 3, bias=False, **kw)])
        x = RNG.standard_normal((6, 3, 2, 2))
    elif kind in {"conv", "conv-winograd"}:  # Winograd's layers keep their input, not its windows
        wino = True if kind == "conv-winograd" else None
        net = Sequential([
            Conv2d(2, 3, 3, padding=1, bias=True, winograd=wino, **kw), ReLU(),
            Conv2d(3, 2, 2, stride=2, bias=False, **kw),
            Flatten(), Linear(8, 3, **kw),
        ])  # fmt: skip
        x = RNG.standard_normal((4, 2, 4, 4))
    else:  # a convolution inside a residual block
        net = Sequential([Conv2d(2, 3, 3, padding=1, bias=False, **kw), BasicBlock(3, 4, stride=2, **kw),
                          Flatten(), Linear(16, 3, **kw)])  # fmt: skip
        x = RNG.standard_normal((4, 2, 4, 4))
    return net, x


@pytest.mark.parametrize("kind", ["linear", "conv", "conv-winograd", "residual"])
@pytest.mark.parametrize("kl_clip", [0.0, 1e-4])
def test_factors_and_the_first_update_match_the_formulas_in_float64(kind: str, kl_clip: float) -> None:
    net, x = model_of(kind)
    y = RNG.integers(0, 3, size=x.shape[0])
    lr, damping, momentum, wd = 0.3, 0.05, 0.9, 1e-3
    opt = KFAC(net, lr, momentum=momentum, weight_decay=wd, damping=damping, kl_clip=kl_clip)
    layers = covered_layers(net)
    assert [e.layer for e in opt.layers] == layers
    before = {id(p): np.array(p.data) for p in net.parameters()}
    cap = Capture(layers)
    loss = SoftmaxCrossEntropy()
    with observe(opt.observer), observe(cap):
        loss.forward(net.forward(x), y)
        net.backward(loss.backward())
    if kind == "residual":  # the block's convolutions were reached, one level down
        assert sorted(set(cap.depth.values())) == [0, 1]
    grads = {id(layer): weight_grad(layer) for layer in layers}
    want = {id(layer): factors(layer, cap.x[id(layer)], cap.gy[id(layer)]) for layer in layers}
    opt.step()
    ps = {}
    for e in opt.layers:
        A, G = want[id(e.layer)]
        np.testing.assert_allclose(e.A, A, rtol=1e-12, atol=1e-14 * np.abs(A).max(), err_msg=e.name)
        np.testing.assert_allclose(e.G, G, rtol=1e-12, atol=1e-14 * np.abs(G).max(), err_msg=e.name)
        ps[id(e.layer)] = preconditioned(A, G, grads[id(e.layer)], damping)
    nu = 1.0
    if kl_clip:
        vg = lr * lr * sum(float((ps[k] * grads[k]).sum()) for k in ps)
        nu = min(1.0, math.sqrt(kl_clip / abs(vg)))
        assert nu < 1  # the case clips
    for layer in layers:
        p = ps[id(layer)] * nu
        cols = layer.weight.data.reshape(layer.weight.shape[0], -1).shape[1]
        pairs = [(layer.weight, p[:, :cols].reshape(layer.weight.shape))]
        if layer.bias is not None:
            pairs.append((layer.bias, p[:, cols]))
        for param, pg in pairs:
            w0 = before[id(param)]
            expect = w0 - lr * (pg + wd * w0)  # first step: the momentum buffer is the gradient
            np.testing.assert_allclose(param.data, expect, rtol=1e-10, atol=1e-12, err_msg=param.name)
    covered = {id(q) for layer in layers for q in (layer.weight, layer.bias) if q is not None}
    others = [p for p in net.parameters() if id(p) not in covered]
    for p in others:  # BatchNorm: SGD's update with the raw gradient
        np.testing.assert_allclose(p.data, before[id(p)] - lr * (np.array(p.grad) + wd * before[id(p)]),
                                   rtol=1e-12, atol=1e-14)  # fmt: skip


def test_a_plain_observer_sees_a_block_whole_and_a_nested_one_inside_it() -> None:
    net, x = model_of("residual")

    class Plain:
        def __init__(self) -> None:
            self.seen: list[str] = []

        def before(self, phase: str, layer: Any, x: Any) -> None:
            if phase == "forward":
                self.seen.append(type(layer).__name__)

        def after(self, phase: str, layer: Any, y: Any) -> None:
            pass

    plain = Plain()
    cap = Capture(covered_layers(net))
    with observe(plain), observe(cap):
        net.forward(x)
    assert plain.seen == ["Conv2d", "BasicBlock", "Flatten", "Linear"]  # each top-level layer once
    assert len(cap.x) == len(covered_layers(net)) == 5  # conv, block's conv1, conv2, shortcut conv, linear


def test_running_averages_decay_and_micro_steps_are_averaged() -> None:
    net, x = model_of("linear")
    y = RNG.integers(0, 3, size=x.shape[0])
    opt = KFAC(net, 0.1, damping=0.1, factor_decay=0.7, kl_clip=0)
    loss = SoftmaxCrossEntropy()
    seen = []
    for _ in range(2):  # step 0 sets the factors, step 1 folds its two micro-steps' mean in
        cap = Capture(covered_layers(net))
        parts = (x[:3], y[:3]), (x[3:], y[3:])
        batch = []
        for xs, ys in parts if opt.t else [(x, y)]:
            with observe(opt.observer), observe(cap):
                loss.forward(net.forward(xs), ys)
                net.backward(loss.backward())
            batch.append({id(layer): factors(layer, cap.x[id(layer)], cap.gy[id(layer)])
                          for layer in covered_layers(net)})  # fmt: skip
        seen.append(batch)
        opt.step()
    for e in opt.layers:
        k = id(e.layer)
        first = seen[0][0][k]
        second = [(a + b) / 2 for a, b in zip(seen[1][0][k], seen[1][1][k])]
        for got, f0, f1 in zip((e.A, e.G), first, second):
            np.testing.assert_allclose(got, 0.7 * f0 + 0.3 * f1, rtol=1e-12)


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"damping": 0.0}, "kfac.damping must be > 0"),
        ({"factor_every": 5, "inv_every": 2}, "kfac.inv_every = 2 must be >= kfac.factor_every = 5"),
        ({"factor_decay": 1.0}, "kfac.factor_decay must be in [0, 1)"),
    ],
)
def test_bad_settings_are_refused(kwargs: dict[str, Any], says: str) -> None:
    net, _ = model_of("linear")
    with pytest.raises(ValueError, match="kfac") as err:
        KFAC(net, 0.1, **kwargs)
    assert says in str(err.value)


def test_non_finite_factors_stop_the_step() -> None:
    net, x = model_of("linear")
    x = x.copy()
    x[0, 0, 0, 0] = np.inf
    opt = KFAC(net, 0.1)
    loss = SoftmaxCrossEntropy()
    with observe(opt.observer):
        loss.forward(net.forward(x), np.zeros(x.shape[0], dtype=np.int64))
        net.backward(loss.backward())
    with pytest.raises(HpcdlError, match="factors of layer 1 are not finite at step 0"):
        opt.step()


def test_the_state_round_trips_and_a_state_without_factors_is_refused() -> None:
    net, x = model_of("conv")
    y = RNG.integers(0, 3, size=x.shape[0])
    opt = KFAC(net, 0.1, momentum=0.9)
    loss = SoftmaxCrossEntropy()
    with observe(opt.observer):
        loss.forward(net.forward(x), y)
        net.backward(loss.backward())
    opt.step()
    state = opt.state_dict()
    names = {k for k in state if k.startswith("kfac/")}
    assert names == {f"kfac/{e.name}/{a}" for e in opt.layers for a in ("A", "G", "QA", "dA", "QG", "dG")}
    other = KFAC(model_of("conv")[0], 0.1, momentum=0.9)
    other.load_state_dict(state)
    for a, b in zip(opt.layers, other.layers):
        for attr in ("A", "G", "QA", "dA", "QG", "dG"):
            assert np.array_equal(getattr(a, attr), getattr(b, attr))
    plain = {k: v for k, v in state.items() if not k.startswith("kfac/")}
    assert "no K-FAC state for layer 0" in other.check_state(plain)
    with pytest.raises(ValueError, match="no K-FAC state"):
        other.load_state_dict(plain)
