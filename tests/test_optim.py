"""Optimizers against plain reference formulas (and PyTorch when installed); schedules."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hpcdl.nn import Parameter
from hpcdl.optim import SGD, Adam, AdamW, Schedule, scaled_lr


def _params(seed: int = 0) -> list[Parameter]:
    rng = np.random.default_rng(seed)
    return [Parameter(rng.standard_normal(s)) for s in [(3, 4), (5,), (2, 2, 3)]]


def _grads(step: int, params: list[Parameter]) -> list[np.ndarray]:
    rng = np.random.default_rng(100 + step)
    return [rng.standard_normal(p.shape) for p in params]


def _run(opt_factory, steps: int = 4) -> list[np.ndarray]:
    params = _params()
    opt = opt_factory(params)
    for t in range(steps):
        for p, g in zip(params, _grads(t, params)):
            p.grad[...] = g
        opt.step()
    return [p.data for p in params]


def _reference_sgd(lr, mu, nesterov, wd, steps=4):
    ws = [p.data.copy() for p in _params()]
    vs = [None] * len(ws)
    for t in range(steps):
        for i, g in enumerate(_grads(t, _params())):
            g = g + wd * ws[i]
            vs[i] = g.copy() if vs[i] is None else mu * vs[i] + g
            d = g + mu * vs[i] if nesterov else vs[i]
            ws[i] = ws[i] - lr * (d if mu else g)
    return ws


@pytest.mark.parametrize(
    ("mu", "nesterov", "wd"), [(0.0, False, 0.0), (0.9, False, 0.0), (0.9, True, 1e-2), (0.5, False, 1e-3)]
)
def test_sgd_matches_reference(mu: float, nesterov: bool, wd: float) -> None:
    got = _run(lambda ps: SGD(ps, 0.1, momentum=mu, nesterov=nesterov, weight_decay=wd))
    for a, b in zip(got, _reference_sgd(0.1, mu, nesterov, wd)):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


def _reference_adam(lr, b1, b2, eps, wd, decoupled, steps=4):
    ws = [p.data.copy() for p in _params()]
    ms = [np.zeros_like(w) for w in ws]
    vs = [np.zeros_like(w) for w in ws]
    for t in range(1, steps + 1):
        for i, g in enumerate(_grads(t - 1, _params())):
            if decoupled:
                ws[i] = ws[i] * (1 - lr * wd)
            else:
                g = g + wd * ws[i]
            ms[i] = b1 * ms[i] + (1 - b1) * g
            vs[i] = b2 * vs[i] + (1 - b2) * g * g
            mhat, vhat = ms[i] / (1 - b1**t), vs[i] / (1 - b2**t)
            ws[i] = ws[i] - lr * mhat / (np.sqrt(vhat) + eps)
    return ws


@pytest.mark.parametrize(("wd", "decoupled"), [(0.0, False), (1e-2, False), (1e-2, True)])
def test_adam_matches_reference(wd: float, decoupled: bool) -> None:
    cls = AdamW if decoupled else Adam
    got = _run(lambda ps: cls(ps, 1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=wd))
    for a, b in zip(got, _reference_adam(1e-2, 0.8, 0.99, 1e-6, wd, decoupled)):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["sgd", "nesterov", "adam", "adamw"])
def test_against_torch(name: str) -> None:
    torch = pytest.importorskip("torch")
    params = _params()
    tparams = [torch.tensor(p.data.copy(), requires_grad=True) for p in params]
    ours, theirs = {
        "sgd": (
            lambda: SGD(params, 0.1, momentum=0.9, weight_decay=1e-3),
            lambda: torch.optim.SGD(tparams, 0.1, momentum=0.9, weight_decay=1e-3),
        ),
        "nesterov": (
            lambda: SGD(params, 0.1, momentum=0.9, nesterov=True),
            lambda: torch.optim.SGD(tparams, 0.1, momentum=0.9, nesterov=True),
        ),
        "adam": (
            lambda: Adam(params, 1e-2, weight_decay=1e-3),
            lambda: torch.optim.Adam(tparams, 1e-2, weight_decay=1e-3),
        ),
        "adamw": (
            lambda: AdamW(params, 1e-2, weight_decay=1e-2),
            lambda: torch.optim.AdamW(tparams, 1e-2, weight_decay=1e-2),
        ),
    }[name]
    opt, topt = ours(), theirs()
    for t in range(5):
        for p, tp, g in zip(params, tparams, _grads(t, params)):
            p.grad[...] = g
            tp.grad = torch.tensor(g)
        opt.step()
        topt.step()
    for p, tp in zip(params, tparams):
        np.testing.assert_allclose(p.data, tp.detach().numpy(), rtol=1e-10, atol=1e-12)


def test_state_dict_round_trip_continues_identically() -> None:
    a = _params()
    opt = SGD(a, 0.1, momentum=0.9)
    for t in range(2):
        for p, g in zip(a, _grads(t, a)):
            p.grad[...] = g
        opt.step()
    saved = opt.state_dict()
    b = [Parameter(p.data.copy(), name=p.name) for p in a]
    opt2 = SGD(b, 0.5, momentum=0.9)
    opt2.load_state_dict(saved)
    for o, ps in ((opt, a), (opt2, b)):
        for p, g in zip(ps, _grads(7, ps)):
            p.grad[...] = g
        o.step()
    for p, q in zip(a, b):
        np.testing.assert_array_equal(p.data, q.data)


def test_float32_stays_float32() -> None:
    p = Parameter(np.ones(4, dtype=np.float32))
    p.grad[...] = 0.5
    for opt in (SGD([p], 0.1, momentum=0.9, weight_decay=1e-4), Adam([p]), AdamW([p])):
        opt.step()
        assert p.data.dtype == np.float32


def test_schedules() -> None:
    const = Schedule(peak_lr=0.4, total_steps=100, warmup_steps=10, start_lr=0.1)
    assert const(0) == pytest.approx(0.1)
    assert const(5) == pytest.approx(0.25)
    assert const(10) == const(99) == pytest.approx(0.4)
    cos = Schedule(peak_lr=1.0, total_steps=110, name="cosine", warmup_steps=10, min_lr=0.1)
    assert cos(10) == pytest.approx(1.0)
    assert cos(60) == pytest.approx(0.55)
    assert cos(110) == pytest.approx(0.1)
    step = Schedule(peak_lr=1.0, total_steps=100, name="step", step_size=30, gamma=0.1)
    assert [step(s) for s in (0, 29, 30, 60)] == pytest.approx([1.0, 1.0, 0.1, 0.01])
    warm = Schedule(peak_lr=1.0, total_steps=10, warmup_steps=4)
    assert warm(0) == pytest.approx(0.25) and warm(3) == pytest.approx(0.8125)


def test_lr_scaling_rules() -> None:
    assert scaled_lr(0.1, 4, "none") == 0.1
    assert scaled_lr(0.1, 4, "linear") == pytest.approx(0.4)
    assert scaled_lr(0.1, 4, "sqrt") == pytest.approx(0.2)
    assert scaled_lr(0.1, 2, "sqrt") == pytest.approx(0.1 * math.sqrt(2))
    with pytest.raises(ValueError, match="none, linear or sqrt"):
        scaled_lr(0.1, 2, "cubic")
