"""Tests of the casting paths of hpcdl.comm.pack (float16, bfloat16, int32, maxabs) against NumPy."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from hpcdl.comm.pack import (
    HAVE_EXT,
    INT32_LIMIT,
    INT32_NONFINITE_EXPONENT,
    INT32_ZERO_EXPONENT,
    Packer,
    PackError,
    int32_exponent,
    int32_pow2_scale,
    int32_scale,
    local_maxabs,
)

DTYPES = (np.float32, np.float64)
SHAPES = [(3, 5), (0,), (7,), (1,), (2, 0, 4), (13, 3, 1), (), (1031,)]
MODES = ("plain", "float16", "bfloat16", "int32")

needs_ext = pytest.mark.skipif(not HAVE_EXT, reason="hpcdl._ext.pack not built")
IMPLS = [pytest.param("cython", marks=needs_ext), "numpy"]
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
UINT = {np.dtype(np.float32): np.uint32, np.dtype(np.float64): np.uint64, np.dtype(np.float16): np.uint16}


def bits(a: np.ndarray) -> np.ndarray:
    return a.view(UINT[a.dtype])


def special_values(dtype: type) -> np.ndarray:
    """Zeros, infinities, NaNs with payloads, and the float16 boundaries with their neighbours."""
    f16 = np.finfo(np.float16)
    edges = [0.0, -0.0, np.inf, -np.inf, float(f16.max), 65519.99, 65520.0, 65536.0, 1e10, float(f16.tiny)]
    edges += [2.0**-24, 2.0**-25, 1.5 * 2.0**-25, 2.0**-26, 3 * 2.0**-25, 2.0**-14 - 2.0**-25, 1e-30, 1e-40]
    edges += [1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, 1.0 + 2.0**-11 + 2.0**-20, 2049.0, 2051.0]
    values = np.array(edges + [-e for e in edges], dtype=dtype)
    values = np.concatenate(
        [values, np.nextafter(values, dtype(np.inf)), np.nextafter(values, dtype(-np.inf))]
    )
    if dtype == np.float32:
        nans = np.array([0x7FC00000, 0x7F800001, 0x7FA00000, 0xFFC00001, 0x7FBFFFFF, 0x7FC02000], np.uint32)
    else:
        nans = np.array([0x7FF8 << 48, 0x7FF0000000000001, 0x7FF4 << 48, 0xFFF8000000000001], np.uint64)
    return np.concatenate([values, nans.view(dtype)])


def random_values(dtype: type, n: int = 200_000, seed: int = 0) -> np.ndarray:
    """Random bit patterns, half of them with exponents in or near float16's range."""
    rng = np.random.default_rng(seed)
    if dtype == np.float32:
        raw = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
        exp = rng.integers(95, 145, n).astype(np.uint32) << np.uint32(23)
        near = (raw & np.uint32(0x807FFFFF)) | exp
    else:
        raw = rng.integers(0, 2**64, n, dtype=np.uint64)
        exp = rng.integers(990, 1045, n).astype(np.uint64) << np.uint64(52)
        near = (raw & np.uint64(0x800FFFFFFFFFFFFF)) | exp
    return np.concatenate([raw, near]).view(dtype)


# -- float16 ------------------------------------------------------------------------------


@needs_ext
@pytest.mark.parametrize("dtype", DTYPES)
def test_float16_kernel_bit_exact(dtype: type) -> None:
    from hpcdl._ext import pack as kernel

    x = np.concatenate([special_values(dtype), random_values(dtype)])
    out = np.empty(x.size, np.uint16)
    with np.errstate(over="ignore"):
        ref = x.astype(np.float16)
    kernel.to_float16(x, out)
    bad = np.flatnonzero(out != bits(ref))
    assert bad.size == 0, [(hex(bits(x)[i]), hex(out[i]), hex(bits(ref)[i])) for i in bad[:5]]


@needs_ext
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_float16_widens_exactly(dtype: type) -> None:
    from hpcdl._ext import pack as kernel

    h = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    out = np.empty(h.size, dtype)
    kernel.from_float16(h, out)
    assert np.array_equal(bits(out), bits(h.view(np.float16).astype(dtype)))  # NaN payloads kept
    back = np.empty(h.size, np.uint16)
    kernel.to_float16(out, back)
    assert np.array_equal(back, h)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [1.0, 0.5, 1 / 3])
def test_packer_float16_round_trip(impl: str, dtype: type, scale: float) -> None:
    rng = np.random.default_rng(1)
    arrays = [np.asarray(rng.standard_normal(s) * 100, dtype) for s in SHAPES]
    arrays.append(special_values(dtype))
    packer = Packer(arrays, impl=impl, mode="float16")
    with np.errstate(over="ignore"):
        ref = np.concatenate([a.ravel() for a in arrays]).astype(np.float16)
    buf = packer.pack(arrays)
    assert buf.dtype == np.float16 and packer.nbytes == 2 * buf.size
    assert np.array_equal(bits(buf), bits(ref))
    out = [np.empty_like(a) for a in arrays]
    packer.unpack(buf.copy(), out, scale=scale)
    assert packer.last_impl == impl
    for i, o in enumerate(out):
        want = packer.slot(ref, i).astype(dtype)
        if scale != 1.0:
            want = want * dtype(scale)
        assert np.array_equal(bits(o), bits(want))


def float16_cases() -> np.ndarray:
    """float32 over every exponent, the ties between neighbouring halves and their neighbours."""
    rng = np.random.default_rng(6)
    exps = np.repeat(np.arange(256, dtype=np.uint32), 32) << np.uint32(23)
    every_exp = (exps | rng.integers(0, 2**23, exps.size).astype(np.uint32)).view(np.float32)
    h = np.arange(0x7C00, dtype=np.uint16).view(np.float16).astype(np.float64)  # finite, >= 0
    ties = ((h[:-1] + h[1:]) / 2).astype(np.float32)  # exact: 12 significant bits
    ties = np.concatenate([ties, np.nextafter(ties, np.float32(0)), np.nextafter(ties, np.float32(np.inf))])
    x = np.concatenate([special_values(np.float32), every_exp, ties, -ties])
    return np.concatenate([x, -x])


def float16_arrays(dtype: type) -> list[np.ndarray]:
    """Lengths around the 8-lane blocks, at misaligned offsets, with NaNs in some blocks only."""
    with np.errstate(over="ignore"):
        pool = np.concatenate([float16_cases(), random_values(np.float32, 20_000)]).astype(dtype)
    base = np.random.default_rng(7).permutation(pool)
    base[np.isnan(base)] = 1.5  # NaNs only where placed below
    nans = np.array([0x7F800001, 0xFFC00001, 0x7FA00000, 0x7FBFFFFF, 0x7FC02000, 0xFF800001], np.uint32)
    base[[3, 40, 41, 1004, 1010, 5000]] = nans.view(np.float32).astype(dtype)
    arrays, start = [], 0
    for n in (0, 1, 7, 8, 9, 1001, 0, 8, 9, 7, 1):
        arrays.append(base[start : start + n])  # contiguous slices at several offsets mod 8
        start += n + 1
    return [*arrays, base[start:]]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_packer_float16_bit_exact_blocks_and_tails(impl: str, dtype: type, scale: float) -> None:
    arrays = float16_arrays(dtype)
    packer = Packer(arrays, impl=impl, mode="float16")
    with np.errstate(over="ignore"):
        ref = np.concatenate(arrays).astype(np.float16)
    buf = packer.pack(arrays)
    assert packer.last_impl == impl
    bad = np.flatnonzero(bits(buf) != bits(ref))
    assert bad.size == 0, [(i, hex(bits(buf)[i]), hex(bits(ref)[i])) for i in bad[:5]]
    shifted = np.empty(buf.size + 3, np.float16)[3:]  # the received buffer at an odd offset
    shifted[...] = buf
    out = [np.full_like(a, 7.0) for a in arrays]
    packer.unpack(shifted, out, scale=scale)
    assert packer.last_impl == impl
    for i, o in enumerate(out):
        want = packer.slot(ref, i).astype(dtype)  # signalling NaNs kept: no product at scale 1
        want = want if scale == 1.0 else want * dtype(scale)
        assert np.array_equal(bits(o), bits(want)), i


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_packer_every_float16_round_trip(impl: str, dtype: type, scale: float) -> None:
    h = np.arange(2**16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    wide = h.astype(dtype)  # NaN payloads kept, signalling NaNs too
    arrays = [wide[:1001], wide[1001:1010], wide[1010:]]
    packer = Packer(arrays, impl=impl, mode="float16")
    assert np.array_equal(bits(packer.pack(arrays)), bits(h))
    out = [np.empty_like(a) for a in arrays]
    packer.unpack(h, out, scale=scale)
    want = wide if scale == 1.0 else wide * dtype(scale)
    assert np.array_equal(bits(np.concatenate(out)), bits(want))


@needs_ext
@pytest.mark.parametrize("dtype", DTYPES)
def test_float16_simd_and_software_paths_agree(dtype: type) -> None:
    from hpcdl._ext import pack as kernel

    with np.errstate(over="ignore"):
        x = np.concatenate([float16_cases(), random_values(np.float32, 100_000, seed=8)]).astype(dtype)
    got = {}
    for simd in (True, False):
        h = np.empty(x.size, np.uint16)
        kernel.to_float16(x[1:], h[1:], simd=simd)
        outs = []
        for scale in (1.0, 0.5, 1 / 3):
            o = np.empty(x.size, dtype)
            kernel.from_float16(h[1:], o[1:], scale, simd=simd)
            outs.append(bits(o[1:]))
        got[simd] = (h[1:], *outs)
    for a, b in zip(got[True], got[False]):
        assert np.array_equal(a, b)


@needs_ext
def test_simd_paths_reported() -> None:
    from hpcdl._ext import pack as kernel

    paths = kernel.simd_paths()
    assert set(paths) == {"float16", "bfloat16"} and all(isinstance(v, bool) for v in paths.values())


# -- bfloat16 -----------------------------------------------------------------------------


def bfloat16_reference(x: np.ndarray) -> np.ndarray:
    """Nearest bfloat16 (ties to even) chosen by comparing distances in float64."""
    with np.errstate(over="ignore", invalid="ignore"):
        f = x.astype(np.float32)
    lo = f.view(np.uint32) & np.uint32(0xFFFF0000)
    hi = lo + np.uint32(0x10000)
    hi_value = hi.view(np.float32).astype(np.float64)
    hi_value[np.isinf(hi_value)] = np.copysign(2.0**128, hi_value[np.isinf(hi_value)])  # unbounded exponent
    with np.errstate(over="ignore", invalid="ignore"):
        d_lo = np.abs(f.astype(np.float64) - lo.view(np.float32).astype(np.float64))
        d_hi = np.abs(hi_value - f.astype(np.float64))
    up = (d_hi < d_lo) | ((d_hi == d_lo) & ((lo >> np.uint32(16)) & np.uint32(1)).astype(bool))
    up &= np.isfinite(f) & (f.view(np.uint32) != lo)
    return np.where(up, hi, lo) >> np.uint32(16)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_packer_bfloat16(impl: str, dtype: type) -> None:
    x = np.concatenate([special_values(dtype), random_values(dtype, 50_000)])
    arrays = [x[:100].copy(), x[100:].copy(), np.zeros(0, dtype)]
    packer = Packer(arrays, impl=impl, mode="bfloat16")
    buf = packer.pack(arrays)
    assert buf.dtype == np.uint16 and packer.last_impl == impl
    ref = bfloat16_reference(x)
    nan = np.isnan(x)
    assert np.array_equal(buf[~nan], ref[~nan])
    widened = (buf.astype(np.uint32) << np.uint32(16)).view(np.float32)
    assert np.isnan(widened[nan]).all()
    out = [np.empty_like(a) for a in arrays]
    packer.unpack(buf, out, scale=0.25)
    got = np.concatenate([o.ravel() for o in out])
    want = widened.astype(dtype) * dtype(0.25)
    assert np.array_equal(got[~nan], want[~nan]) and np.isnan(got[nan]).all()


@needs_ext
def test_bfloat16_simd_and_software_paths_agree() -> None:
    from hpcdl._ext import pack as kernel

    x = np.concatenate([special_values(np.float32), random_values(np.float32, 100_000, seed=9)])
    for start, stop in ((0, x.size), (1, x.size - 3), (5, 20), (2, 2)):
        got = [np.empty(stop - start, np.uint16) for _ in range(2)]
        kernel.to_bfloat16(x[start:stop], got[0], simd=True)
        kernel.to_bfloat16(x[start:stop], got[1], simd=False)
        assert np.array_equal(got[0], got[1])


# -- int32 --------------------------------------------------------------------------------


def quantize_reference(x: np.ndarray, qscale: float) -> np.ndarray:
    with np.errstate(invalid="ignore", over="ignore"):
        v = np.clip(x.astype(np.float64) * qscale, -INT32_LIMIT, INT32_LIMIT)
    return np.where(np.isnan(v), 0, np.rint(v)).astype(np.int32)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_packer_int32_saturates_and_rounds_to_even(impl: str, dtype: type) -> None:
    qscale = 1000.0
    ties = np.array([0.5, 1.5, 2.5, -0.5, -2.5, 1e-3 * 0.5, 3e-3 * 0.5], dtype)  # * qscale
    x = np.concatenate([special_values(dtype), ties / qscale, np.array([3e6, -3e6, 2.2e6], dtype)])
    rng = np.random.default_rng(2)
    arrays = [x, rng.standard_normal((17, 3)).astype(dtype), np.zeros(0, dtype)]
    packer = Packer(arrays, impl=impl, mode="int32")
    buf = packer.pack(arrays, qscale=qscale)
    assert buf.dtype == np.int32 and packer.last_impl == impl
    ref = np.concatenate([quantize_reference(a.ravel(), qscale) for a in arrays])
    assert np.array_equal(buf, ref)
    assert buf[: x.size].max() == INT32_LIMIT and buf[: x.size].min() == -INT32_LIMIT
    out = [np.empty_like(a) for a in arrays]
    packer.unpack(buf, out, scale=0.5, qscale=qscale)
    for i, o in enumerate(out):
        want = (packer.slot(ref, i).astype(np.float64) * (0.5 / qscale)).astype(dtype)
        assert np.array_equal(o, want)


@pytest.mark.parametrize("n_terms", [1, 2, 3, 7, 64])
@pytest.mark.parametrize("maxabs", [1e-30, 0.1, 1.0, 3.3e7])
def test_int32_scale_sum_of_n_cannot_overflow(n_terms: int, maxabs: float) -> None:
    scale = int32_scale(maxabs, n_terms)
    g = np.array([maxabs, -maxabs, np.nextafter(maxabs, 0)], np.float64)
    packer = Packer([g], mode="int32")
    q = packer.pack([g], qscale=scale).astype(np.int64)
    assert abs(q[:2]).max() * n_terms <= INT32_LIMIT
    assert abs(q[0]) >= INT32_LIMIT // n_terms - 1  # and the range is used


def test_int32_scale_edges() -> None:
    assert int32_scale(0.0, 4) == 1.0
    with pytest.raises(ValueError, match="finite"):
        int32_scale(math.nan, 2)
    with pytest.raises(ValueError, match="finite"):
        int32_scale(-1.0, 2)
    with pytest.raises(ValueError, match="positive"):
        int32_scale(1.0, 0)
    with pytest.raises(ValueError, match="too small"):
        int32_scale(1e-310, 2)


def _worst(e: int, dtype: type) -> float:
    """The largest ``|g|`` of ``dtype`` below ``2**e`` (its max |g| has exponent ``e``), or None."""
    top = np.ldexp(dtype(1.0), e) if e < np.finfo(dtype).maxexp else dtype(np.inf)
    g = np.nextafter(top, dtype(0))
    return float(g) if np.isfinite(g) and g > 0 and int32_exponent(float(g)) == e else None


def test_int32_pow2_scale_is_the_largest_power_of_two_n_worst_cases_cannot_overflow() -> None:
    """For random N in 1..1024 and exponents from subnormal to the largest float's, the worst case
    (the largest |g| below 2**e, of either sign, rounded to the nearest integer, +0.5 included) is
    within floor((2**31 - 1) / N), so N of them sum within int32; and with 2**(k + 1) it is not."""
    rng = np.random.default_rng(26)
    ns = np.concatenate([np.arange(1, 65), 2 ** np.arange(7, 11), rng.integers(1, 1025, 400)])
    exps = np.concatenate(
        [np.arange(-1073, 1025, 7), [-1073, -993, -994, -995, -149, -126, 0, 1, 30, 128, 1024]]
    )
    checked = 0
    for n in ns:
        n = int(n)
        bound = INT32_LIMIT // n
        for e in rng.choice(exps, 60):
            e = int(e)
            scale = int32_pow2_scale(e, n)
            k = math.frexp(scale)[1] - 1
            assert scale == 2.0**k and math.isfinite(scale)  # a power of two, a finite float64
            assert n * Fraction(2) ** (e + k) <= INT32_LIMIT  # N 2**e 2**k <= 2**31 - 1, exactly
            if k < 1023:  # the largest such k (unless capped): one more doubles past the bound
                assert n * Fraction(2) ** (e + k + 1) > INT32_LIMIT
            for dtype in (np.float32, np.float64):
                g = _worst(e, dtype)
                if g is None:
                    continue
                worst = np.array([g, -g], dtype)
                q = Packer([worst], mode="int32").pack([worst], qscale=scale).astype(np.int64)
                assert np.array_equal(q, np.rint(worst.astype(np.float64) * scale))  # as today, in float64
                assert abs(q).max() <= bound and n * abs(q).max() <= INT32_LIMIT
                checked += 1
    assert checked > 10_000


@pytest.mark.parametrize("n_terms", [1, 2, 3, 7, 64, 1024])
def test_int32_pow2_random_gradients_sum_exactly_within_int32(n_terms: int) -> None:
    """N ranks' random gradients (magnitudes spread over 40 binades, denormal-ish to huge) quantized with
    the shared power of two: each within the bound, the int64 sum within int32, dequantizing exact."""
    rng = np.random.default_rng(n_terms)
    for span in ((-150, -110), (-20, 20), (85, 124)):
        g = rng.standard_normal((n_terms, 50)) * np.exp2(rng.uniform(*span, (n_terms, 50)))
        g = g.astype(np.float32)
        e = max(int32_exponent(local_maxabs([r])) for r in g)  # the MAX allreduce of the exponents
        scale = int32_pow2_scale(e, n_terms)
        q = np.stack([Packer([r], mode="int32").pack([r], qscale=scale).astype(np.int64) for r in g])
        assert abs(q).max() <= INT32_LIMIT // n_terms and abs(q.sum(axis=0)).max() <= INT32_LIMIT
        assert np.array_equal(q.sum(axis=0) / scale * scale, q.sum(axis=0))  # power of two: exact


def test_int32_exponent_and_pow2_scale_edges() -> None:
    assert int32_exponent(0.75) == 0 and int32_exponent(1.0) == 1 and int32_exponent(0.5) == 0
    assert int32_exponent(2.0**-1074) == -1073 and int32_exponent(np.finfo(np.float64).max) == 1024
    assert int32_exponent(0.0) == INT32_ZERO_EXPONENT < -1073  # an all-zero bucket: passed over by MAX
    assert int32_exponent(math.nan) == int32_exponent(math.inf) == INT32_NONFINITE_EXPONENT == 2**31 - 1
    assert int32_pow2_scale(INT32_ZERO_EXPONENT, 4) == 1.0  # zero on every rank, as int32_scale(0.0, 4)
    assert int32_pow2_scale(0, 1) == 2.0**30 and int32_pow2_scale(0, 2) == 2.0**29
    assert int32_pow2_scale(0, 3) == 2.0**29 and int32_pow2_scale(-1073, 1) == 2.0**1023  # capped: finite
    assert int32_pow2_scale(1024, 2**31 - 1) == 2.0**-1024  # the largest float64: exact, subnormal scale
    with pytest.raises(ValueError, match="NaN or infinite"):
        int32_pow2_scale(INT32_NONFINITE_EXPONENT, 2)
    with pytest.raises(ValueError, match="n_terms"):
        int32_pow2_scale(0, 0)
    with pytest.raises(ValueError, match="beyond"):
        int32_pow2_scale(1025, 2)
    with pytest.raises(ValueError, match="non-negative"):
        int32_exponent(-1.0)


def test_qscale_is_required_exactly_for_int32() -> None:
    a = [np.ones(3, np.float32)]
    with pytest.raises(PackError, match="needs qscale"):
        Packer(a, mode="int32").pack(a)
    with pytest.raises(PackError, match="int32' only"):
        Packer(a).pack(a, qscale=2.0)
    with pytest.raises(PackError, match="mode must be one of"):
        Packer(a, mode="float8")
    with pytest.raises(PackError, match="buffer has dtype float32, the packer int32"):
        Packer(a, mode="int32").unpack(np.zeros(3, np.float32), a, qscale=1.0)


# -- maxabs and the two paths -------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_local_maxabs(dtype: type) -> None:
    rng = np.random.default_rng(3)
    arrays = [np.asarray(rng.standard_normal(s), dtype) for s in SHAPES]
    arrays[3][...] = -7.5
    want = max(float(np.abs(a).max()) for a in arrays if a.size)
    assert local_maxabs(arrays) == want == 7.5
    assert Packer(arrays).maxabs(arrays) == want
    assert local_maxabs([a.T for a in arrays] + [arrays[0][:, ::2]]) == want  # strided: NumPy path
    assert local_maxabs([]) == 0.0 and local_maxabs([np.zeros(0, dtype)]) == 0.0
    arrays[-1][5] = np.nan
    assert math.isnan(local_maxabs(arrays)) and math.isnan(Packer(arrays).maxabs(arrays))
    arrays[-1][5] = -np.inf
    assert local_maxabs(arrays) == math.inf


@needs_ext
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_and_fallback_agree_bitwise(mode: str, dtype: type) -> None:
    rng = np.random.default_rng(4)
    arrays = [np.asarray(rng.standard_normal(s) * 50, dtype) for s in SHAPES]
    kw = {"qscale": 1e6} if mode == "int32" else {}
    fast, slow = Packer(arrays, mode=mode), Packer(arrays, mode=mode, impl="numpy")
    a, b = fast.pack(arrays, **kw), slow.pack(arrays, **kw)
    assert (fast.last_impl, slow.last_impl) == ("cython", "numpy")
    assert a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8))
    outs = [[np.empty_like(x) for x in arrays] for _ in range(2)]
    fast.unpack(a, outs[0], scale=1 / 3, **kw)
    slow.unpack(b, outs[1], scale=1 / 3, **kw)
    for x, y in zip(*outs):
        assert np.array_equal(x, y)


@pytest.mark.parametrize("mode", MODES)
def test_strided_arrays_every_mode(mode: str) -> None:
    base = np.random.default_rng(5).standard_normal((6, 8)).astype(np.float32)
    arrays = [base[:, ::2], base[1]]
    contiguous = [np.ascontiguousarray(a) for a in arrays]
    kw = {"qscale": 1e5} if mode == "int32" else {}
    packer = Packer([a.shape for a in arrays], np.float32, mode=mode)
    got = packer.pack(arrays, **kw).copy()
    assert packer.last_impl == "numpy"
    assert np.array_equal(got.view(np.uint8), packer.pack(contiguous, **kw).view(np.uint8))
    out = [np.zeros((6, 8), np.float32)[:, 1::2], np.zeros(8, np.float32)]
    ref = [np.empty_like(a) for a in contiguous]
    packer.unpack(got, out, scale=0.5, **kw)
    packer.unpack(got, ref, scale=0.5, **kw)
    for x, y in zip(out, ref):
        assert np.array_equal(x, y)
