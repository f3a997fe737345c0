"""Tests of hpcdl._ext.fused: each kernel against the array-module path it replaces.

SGD, Adam and ReLU must give the same bits as the NumPy code (run here by setting the
module's ``_fused`` to None); BatchNorm's kernels sum in float64, so they are compared
within a few float32 (or float64) roundings. Arrays the kernels do not cover (other
dtypes, non-contiguous, read-only) take the NumPy path.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import pytest

from hpcdl.nn import BatchNorm1d, BatchNorm2d, Parameter, ReLU, activation, norm
from hpcdl.optim import SGD, Adam, adam, sgd

fused = pytest.importorskip("hpcdl._ext.fused", reason="not built: python setup.py build_ext --inplace")

DTYPES = (np.float32, np.float64)
#: sizes that are not multiples of the vector width, empty and 0-d arrays, larger ones
SHAPES = [(7, 13), (5,), (1,), (0,), (), (1031,), (3, 700)]
#: values whose handling must match exactly: signed zeros, infinities, NaN, subnormals
SPECIAL = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, -1e-40, 5e-324, 3.0, -2.5]


def bits(a: np.ndarray) -> np.ndarray:
    """The bytes of ``a`` (so that -0.0 differs from 0.0 and NaNs compare)."""
    return np.ascontiguousarray(a).view(np.uint8)


def assert_same_bits(a: np.ndarray, b: np.ndarray) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert np.array_equal(bits(a), bits(b)), f"differ at {np.flatnonzero(bits(a) != bits(b))[:5]}"


def without_kernel(module, monkeypatch: pytest.MonkeyPatch, use: bool) -> None:
    """Make ``module`` take its array-module path (``use=False``) or its kernel."""
    monkeypatch.setattr(module, "_fused", fused if use else None)


def test_kernels_are_built() -> None:
    """Every module that dispatches to the kernels found them."""
    assert sgd._fused is adam._fused is activation._fused is norm._fused is fused


# -- optimizers --------------------------------------------------------------------------


def _trajectory(
    module, monkeypatch, use: bool, make: Callable, dtype: type, seed: int, steps: int = 4, special=False
) -> list[np.ndarray]:
    """Parameters and optimizer state after ``steps`` steps of ``make(params)``, the kernel on or off.

    The gradients span many magnitudes; the learning rate changes after the second step.
    """
    without_kernel(module, monkeypatch, use)
    rng = np.random.default_rng(seed)
    params = [Parameter(rng.standard_normal(s).astype(dtype)) for s in SHAPES]
    opt = make(params)
    for t in range(steps):
        for p in params:
            p.grad[...] = rng.standard_normal(p.shape) * 10.0 ** rng.integers(-8, 3)
            if special and p.size:
                p.grad.flat[: len(SPECIAL)] = SPECIAL[: p.size]
        if t == 2:
            opt.lr *= 0.37
        opt.step()
    return [p.data.copy() for p in params] + [a.copy() for arrays in opt.state.values() for a in arrays]


def _assert_same_trajectory(module, monkeypatch, make, dtype, seed=0, special=False) -> None:
    got = _trajectory(module, monkeypatch, True, make, dtype, seed, special=special)
    want = _trajectory(module, monkeypatch, False, make, dtype, seed, special=special)
    for a, b in zip(got, want, strict=True):
        assert_same_bits(a, b)


SGD_CASES = [
    (mu, nesterov, wd)
    for mu, nesterov, wd in itertools.product([0.0, 0.9, 0.37], [False, True], [0.0, 1e-4, 0.3])
    if not (nesterov and mu == 0)
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("mu", "nesterov", "wd"), SGD_CASES)
@pytest.mark.parametrize("lr", [0.1, 0.0123])
def test_sgd_same_bits(monkeypatch, dtype, mu, nesterov, wd, lr) -> None:
    """Every branch (first step v = g, momentum 0, Nesterov, weight decay) in float32 and float64."""

    def make(ps):
        return SGD(ps, lr, momentum=mu, nesterov=nesterov, weight_decay=wd)

    _assert_same_trajectory(sgd, monkeypatch, make, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("mu", "nesterov", "wd"), [(0.9, True, 1e-4), (0.0, False, 0.3), (0.5, False, 0.0)])
def test_sgd_same_bits_special_values(monkeypatch, dtype, mu, nesterov, wd) -> None:
    def make(ps):
        return SGD(ps, 0.1, momentum=mu, nesterov=nesterov, weight_decay=wd)

    with np.errstate(all="ignore"):
        _assert_same_trajectory(sgd, monkeypatch, make, dtype, special=True)


ADAM_CASES = list(itertools.product([1e-3, 0.1], [(0.9, 0.999), (0.5, 0.9)], [1e-8, 1e-3], [0.0, 0.01]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("lr", "betas", "eps", "wd"), ADAM_CASES)
@pytest.mark.parametrize("decoupled", [False, True])
def test_adam_same_bits(monkeypatch, dtype, lr, betas, eps, wd, decoupled) -> None:
    """Adam, L2 decay in the gradient, and AdamW's decoupled decay."""

    def make(ps):
        return Adam(ps, lr, betas=betas, eps=eps, weight_decay=wd, decoupled=decoupled)

    _assert_same_trajectory(adam, monkeypatch, make, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("decoupled", [False, True])
def test_adam_same_bits_special_values(monkeypatch, dtype, decoupled) -> None:
    def make(ps):
        return Adam(ps, 1e-3, weight_decay=0.01, decoupled=decoupled)

    with np.errstate(all="ignore"):
        _assert_same_trajectory(adam, monkeypatch, make, dtype, special=True)


def test_optimizer_kernels_hypothesis(monkeypatch) -> None:
    """Random sizes, seeds and hyperparameters: the same bits."""
    hypothesis = pytest.importorskip("hypothesis", reason="in the test extra: pip install -e '.[test]'")
    st = hypothesis.strategies

    @hypothesis.settings(max_examples=60, deadline=None)
    @hypothesis.given(
        size=st.integers(0, 3000),
        dtype=st.sampled_from(DTYPES),
        lr=st.floats(1e-6, 1.0),
        mu=st.sampled_from([0.0, 0.5, 0.9, 0.99]),
        nesterov=st.booleans(),
        wd=st.sampled_from([0.0, 1e-5, 5e-4, 0.1]),
        seed=st.integers(0, 2**16),
    )
    def check(size, dtype, lr, mu, nesterov, wd, seed):
        nesterov = nesterov and mu > 0

        def run(use: bool, optimizer: str) -> list[np.ndarray]:
            module = sgd if optimizer == "sgd" else adam
            monkeypatch.setattr(module, "_fused", fused if use else None)
            rng = np.random.default_rng(seed)
            p = Parameter(rng.standard_normal(size).astype(dtype))
            if optimizer == "sgd":
                opt = SGD([p], lr, momentum=mu, nesterov=nesterov, weight_decay=wd)
            else:
                opt = Adam([p], lr, betas=(mu, 0.999), weight_decay=wd, decoupled=nesterov)
            for _ in range(3):
                p.grad[...] = rng.standard_normal(size)
                opt.step()
            return [p.data, *[a for arrays in opt.state.values() for a in arrays]]

        for optimizer in ("sgd", "adam"):
            for a, b in zip(run(True, optimizer), run(False, optimizer), strict=True):
                assert_same_bits(a, b)

    check()


@pytest.mark.parametrize("make", [lambda ps: SGD(ps, 0.1, momentum=0.9), lambda ps: Adam(ps, 0.1)])
def test_numpy_scalar_lr_takes_the_numpy_path(monkeypatch, make) -> None:
    """An lr set to a NumPy float64 makes NumPy compute float32 updates in float64: the same bits."""

    def run(use: bool) -> np.ndarray:
        without_kernel(sgd, monkeypatch, use)
        without_kernel(adam, monkeypatch, use)
        p = Parameter(np.linspace(-1, 1, 2001, dtype=np.float32))
        opt = make([p])
        for t in range(3):
            p.grad[...] = np.float32(1 / 3) * (t + 1)
            opt.lr = np.float64(0.1) / 3
            opt.step()
        return p.data

    assert_same_bits(run(True), run(False))


def _arrays(dtype=np.float32, n=10, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(n).astype(dtype) for _ in range(3)]


@pytest.mark.parametrize(
    "case",
    ["float16", "mixed dtypes", "non-contiguous", "read-only w", "read-only v", "sizes differ", "list"],
)
def test_sgd_kernel_declines(case) -> None:
    """Arrays it does not cover: the kernel returns False and writes nothing."""
    w, g, v = _arrays()
    if case == "float16":
        w, g, v = (a.astype(np.float16) for a in (w, g, v))
    elif case == "mixed dtypes":
        g = g.astype(np.float64)
    elif case == "non-contiguous":
        w, g, v = (np.repeat(a, 2)[::2] for a in (w, g, v))
    elif case == "read-only w":
        w.flags.writeable = False
    elif case == "read-only v":
        v.flags.writeable = False
    elif case == "sizes differ":
        g = g[:-1]
    elif case == "list":
        g = g.tolist()
    w0, v0 = w.copy(), v.copy()
    assert fused.sgd(w, g, v, 0.1, 0.9, 0.0, False, False) is False
    assert fused.adam(w, g, v.copy(), v, 0, 1.0, 0.0, 0.9, 0.1, 0.999, 1e-3, 1.0, 1e-8, 0.1) is False
    assert_same_bits(w, w0)
    assert_same_bits(v, v0)


@pytest.mark.parametrize("order", ["F", "strided"])
def test_optimizers_fall_back_for_uncovered_parameters(monkeypatch, order) -> None:
    """Fortran-ordered and strided parameters take the NumPy path: the same result."""

    def run(use: bool, make) -> np.ndarray:
        without_kernel(sgd, monkeypatch, use)
        without_kernel(adam, monkeypatch, use)
        base = np.random.default_rng(1).standard_normal((6, 8)).astype(np.float32)
        data = np.asfortranarray(base) if order == "F" else base[:, ::2]
        p = Parameter(data)
        p.grad[...] = 0.5
        opt = make([p])
        for _ in range(3):
            opt.step()
        return p.data

    for make in (lambda ps: SGD(ps, 0.1, momentum=0.9, weight_decay=1e-3), lambda ps: Adam(ps, 0.01)):
        assert_same_bits(run(True, make), run(False, make))


# -- ReLU --------------------------------------------------------------------------------


def _relu_inputs(dtype, shape, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(dtype)
    if x.size:
        x.flat[: len(SPECIAL)] = np.asarray(SPECIAL[: x.size], dtype)
    gy = rng.standard_normal(shape).astype(dtype)
    if gy.size > 3:
        gy.flat[:4] = [np.nan, np.inf, -0.0, -np.inf]
    return x, gy


def _relu_run(monkeypatch, use, x, gy, inplace=True):
    without_kernel(activation, monkeypatch, use)
    relu = ReLU(inplace=inplace)
    x, gy = x.copy(), gy.copy()
    with np.errstate(all="ignore"):
        y = relu.forward(x)
        mask = relu._mask
        gx = relu.backward(gy)
    return x, y, mask, gx, gy


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4, 5), (0, 3), (), (3, 2, 7, 5), (1031,)])
@pytest.mark.parametrize("inplace", [True, False])
def test_relu_same_bits(monkeypatch, dtype, shape, inplace) -> None:
    """Forward (output and mask) and backward, -0.0, NaN and infinities included; in place or not."""
    x, gy = _relu_inputs(dtype, shape)
    got = _relu_run(monkeypatch, True, x, gy, inplace)
    want = _relu_run(monkeypatch, False, x, gy, inplace)
    for a, b in zip(got, want, strict=True):
        assert_same_bits(a, b)
    _, y, mask, gx, gy_after = got
    assert mask.dtype == np.bool_ and mask.shape == x.shape
    if inplace:  # the documented in-place behaviour is kept
        assert y is got[0] and gx is gy_after


@pytest.mark.parametrize("case", ["non-contiguous", "read-only", "float16"])
def test_relu_uncovered_inputs_take_the_numpy_path(monkeypatch, case) -> None:
    x, gy = _relu_inputs(np.float32, (6, 8))

    def prepare(a: np.ndarray) -> np.ndarray:
        if case == "non-contiguous":
            return np.repeat(a, 2, axis=1)[:, ::2]
        if case == "float16":
            return a.astype(np.float16)
        b = a.copy()
        b.flags.writeable = False
        return b

    def run(use: bool) -> tuple[np.ndarray, ...]:
        without_kernel(activation, monkeypatch, use)
        relu = ReLU()
        xc, gyc = prepare(x), prepare(gy)
        with np.errstate(all="ignore"):
            y = relu.forward(xc)
            return xc, y, relu._mask, relu.backward(gyc)

    got = run(True)
    for a, b in zip(got, run(False), strict=True):
        assert_same_bits(a, b)
    if case == "read-only":
        assert_same_bits(got[0], x)  # not written


def test_relu_kernel_declines_a_mask_of_another_shape() -> None:
    gy, mask = np.ones((3, 4), np.float32), np.ones((4, 3), np.bool_)
    assert fused.relu_backward(gy, mask, gy) is False
    assert fused.relu_forward(gy, np.empty(5, np.float32), np.empty(12, np.bool_)) is False


# -- BatchNorm ---------------------------------------------------------------------------

#: how close the kernels are to the NumPy path: a few roundings of the dtype
BN_RTOL = {np.float32: 2e-6, np.float64: 1e-13}


def _bn_run(monkeypatch, use, cls, dtype, x, gy, needs_input_grad=True):
    without_kernel(norm, monkeypatch, use)
    rng = np.random.default_rng(7)
    c = x.shape[1]
    bn = cls(c, momentum=0.3, dtype=dtype)
    bn.weight.data[...] = rng.uniform(0.5, 1.5, c)
    bn.bias.data[...] = rng.standard_normal(c)
    bn.running_var[...] = rng.uniform(0.5, 2.0, c)
    bn.needs_input_grad = needs_input_grad
    y = bn.forward(x)
    gx = bn.backward(gy)
    return {
        "y": y,
        "gx": gx,
        "gamma.grad": bn.weight.grad,
        "beta.grad": bn.bias.grad,
        "running_mean": bn.running_mean,
        "running_var": bn.running_var,
        "xhat": bn._xhat,
        "inv_std": bn._inv_std,
    }


#: channel by channel (odd spatial sizes included), and row by row (one value per sample and
#: channel: (N, C), (N, C, 1), (N, C, 1, 1))
BN_CASES = [
    (BatchNorm2d, (4, 3, 5, 7)),
    (BatchNorm2d, (16, 8, 4, 4)),
    (BatchNorm2d, (3, 2, 9, 11)),
    (BatchNorm1d, (5, 4, 3)),
    (BatchNorm1d, (64, 17)),
    (BatchNorm1d, (2, 3)),
    (BatchNorm1d, (6, 4, 1)),
    (BatchNorm2d, (2, 5, 1, 1)),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("cls", "shape"), BN_CASES)
def test_batchnorm_kernel_close_to_numpy(monkeypatch, dtype, cls, shape) -> None:
    """Training forward and backward, running statistics and caches, within a few roundings."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(shape) * 3 + 5).astype(dtype)
    gy = rng.standard_normal(shape).astype(dtype)
    got = _bn_run(monkeypatch, True, cls, dtype, x, gy)
    want = _bn_run(monkeypatch, False, cls, dtype, x, gy)
    for name in want:
        assert got[name].dtype == want[name].dtype == dtype, name
        assert got[name].shape == want[name].shape, name
        scale = max(float(np.max(np.abs(want[name]))), 1.0)
        np.testing.assert_allclose(got[name], want[name], rtol=0, atol=BN_RTOL[dtype] * scale, err_msg=name)


@pytest.mark.parametrize("dtype", DTYPES)
def test_batchnorm_kernel_without_input_grad(monkeypatch, dtype) -> None:
    rng = np.random.default_rng(4)
    x, gy = (rng.standard_normal((4, 3, 2, 5)).astype(dtype) for _ in range(2))
    got = _bn_run(monkeypatch, True, BatchNorm2d, dtype, x, gy, needs_input_grad=False)
    want = _bn_run(monkeypatch, False, BatchNorm2d, dtype, x, gy, needs_input_grad=False)
    assert got["gx"] is None and want["gx"] is None
    for name in ("gamma.grad", "beta.grad"):
        np.testing.assert_allclose(got[name], want[name], rtol=BN_RTOL[dtype], atol=BN_RTOL[dtype])


@pytest.mark.parametrize("shape", [(4096, 1, 1, 1), (4096, 1), (64, 1, 8, 8)])
def test_batchnorm_kernel_statistics_in_float64(shape) -> None:
    """A channel of large offset and small spread: the float64 sums give the exact statistics."""
    x = np.full(shape, 1000.0, np.float32)
    x.reshape(-1)[::2] += 0.0625  # exactly representable: mean 1000.03125, biased variance 0.0009765625
    xhat, y = np.empty_like(x), np.empty_like(x)
    mean, var, inv = (np.empty(1, np.float32) for _ in range(3))
    one, zero = np.ones(1, np.float32), np.zeros(1, np.float32)
    assert fused.batchnorm_forward(x, one, zero, 0.0, xhat, y, mean, var, inv)
    assert mean[0] == np.float32(1000.03125) and var[0] == np.float32(0.0009765625)
    np.testing.assert_array_equal(np.abs(xhat), 1.0)


@pytest.mark.parametrize("case", ["non-contiguous", "float16 parameters", "mixed dtypes"])
def test_batchnorm_uncovered_inputs_take_the_numpy_path(monkeypatch, case) -> None:
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, 6, 3, 5)).astype(np.float32)
    gy = rng.standard_normal((4, 6, 3, 5)).astype(np.float32)
    dtype = np.float32
    if case == "non-contiguous":
        x, gy = x[:, :, :, ::2], gy[:, :, :, ::2]
    elif case == "float16 parameters":
        dtype = np.float16
        x, gy = x.astype(np.float16), gy.astype(np.float16)
    else:
        x = x.astype(np.float64)  # float32 parameters, float64 input
    got = _bn_run(monkeypatch, True, BatchNorm2d, dtype, x, gy)
    want = _bn_run(monkeypatch, False, BatchNorm2d, dtype, x, gy)
    for name in want:
        assert_same_bits(got[name], want[name])


def test_batchnorm_eval_mode_is_unchanged(monkeypatch) -> None:
    """Evaluation keeps the NumPy path: the same bits with or without the kernels."""
    rng = np.random.default_rng(6)
    x, gy = (rng.standard_normal((4, 3, 2, 2)).astype(np.float32) for _ in range(2))

    def run(use):
        without_kernel(norm, monkeypatch, use)
        bn = BatchNorm2d(3).eval()
        bn.running_mean[...] = [0.1, -0.2, 0.3]
        return bn.forward(x), bn.backward(gy)

    for a, b in zip(run(True), run(False), strict=True):
        assert_same_bits(a, b)


# -- sum_spread: the allreduce shm's pass --------------------------------------------------------


def _spread_numpy(bufs: list[np.ndarray], own: int, lo: int, hi: int, scale: float | None) -> None:
    """What shm does without the kernel (hpcdl.comm.collectives.shm)."""
    acc = bufs[own][lo:hi]
    for p, b in enumerate(bufs):
        if p != own:
            np.add(acc, b[lo:hi], out=acc)
    if scale is not None:
        np.multiply(acc, acc.dtype.type(scale), out=acc)
    for p, b in enumerate(bufs):
        if p != own:
            b[lo:hi] = acc


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("ranks", [1, 2, 3, 5])
@pytest.mark.parametrize("scale", [None, 1 / 3])
def test_sum_spread_is_numpys_passes_bit_for_bit(dtype: type, ranks: int, scale: float | None) -> None:
    rng = np.random.default_rng([ranks, np.dtype(dtype).itemsize])
    n = 3000  # several of the kernel's 512-element blocks, and a part block
    for own in range(ranks):
        for lo, hi in ((0, n), (7, 1500), (n, n), (513, 1026)):
            bufs = [
                (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4, n)).astype(dtype) for _ in range(ranks)
            ]
            want = [b.copy() for b in bufs]
            _spread_numpy(want, own, lo, hi, scale)
            assert fused.sum_spread(bufs, own, lo, hi, scale) is True
            for b, w in zip(bufs, want):
                assert b.tobytes() == w.tobytes(), (own, lo, hi)


def test_sum_spread_declines_what_it_cannot_take() -> None:
    a, b = np.ones(10, np.float32), np.ones(10, np.float32)
    before = a.copy()
    assert fused.sum_spread([a, np.ones(10)], 0, 0, 10, None) is False  # two dtypes
    assert fused.sum_spread([a, np.ones(9, np.float32)], 0, 0, 10, None) is False  # two sizes
    assert fused.sum_spread([a, np.ones(20, np.float32)[::2]], 0, 0, 10, None) is False  # not contiguous
    assert fused.sum_spread([a, b], 2, 0, 10, None) is False  # no such rank
    assert fused.sum_spread([a, b], 0, 4, 11, None) is False  # past the end
    frozen = b.copy()
    frozen.flags.writeable = False
    assert fused.sum_spread([a, frozen], 0, 0, 10, None) is False
    assert fused.sum_spread([a.astype(np.int32), b.astype(np.int32)], 0, 0, 10, None) is False
    assert np.array_equal(a, before)
