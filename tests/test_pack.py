"""Tests of hpcdl.comm.pack: the Cython kernel and the NumPy fallback against np.concatenate."""

from __future__ import annotations

import numpy as np
import pytest

from hpcdl.comm.pack import HAVE_EXT, Packer, PackError

DTYPES = (np.float32, np.float64)
SHAPES = [(3, 5), (0,), (7,), (1,), (2, 0, 4), (13, 3, 1), (), (1031,)]

needs_ext = pytest.mark.skipif(not HAVE_EXT, reason="hpcdl._ext.pack not built")
IMPLS = [pytest.param("cython", marks=needs_ext), "numpy"]


def make_arrays(dtype: type, shapes=SHAPES, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [np.asarray(rng.standard_normal(s), dtype) for s in shapes]


def reference(arrays: list[np.ndarray]) -> np.ndarray:
    return np.concatenate([a.ravel() for a in arrays])


def test_kernel_is_built() -> None:
    """The compiled kernel exists (`python setup.py build_ext --inplace` or pip install)."""
    assert HAVE_EXT


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_pack_matches_concatenate(impl: str, dtype: type) -> None:
    arrays = make_arrays(dtype)
    packer = Packer(arrays, impl=impl)
    buf = packer.pack(arrays)
    assert buf.dtype == dtype and buf.ndim == 1
    assert np.array_equal(buf, reference(arrays))
    assert packer.total == sum(a.size for a in arrays) == buf.size
    assert packer.offsets.tolist() == [0, *np.cumsum([a.size for a in arrays]).tolist()]
    for i, a in enumerate(arrays):
        assert np.array_equal(packer.slot(buf, i), a)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [1.0, 0.5, 1 / 3])
def test_unpack_scale_round_trip(impl: str, dtype: type, scale: float) -> None:
    arrays = make_arrays(dtype)
    packer = Packer([a.shape for a in arrays], dtype, impl=impl)
    buf = packer.pack(arrays).copy()
    out = [np.full(a.shape, np.nan, dtype=dtype) for a in arrays]
    packer.unpack(buf, out, scale=scale)
    for a, o in zip(arrays, out, strict=True):
        assert o.dtype == dtype
        assert np.array_equal(o, a * scale)  # same rounding as NumPy: computed in dtype


def test_pack_is_ordered_by_the_list() -> None:
    a, b = np.ones(2, np.float32), np.full(3, 2, np.float32)
    assert Packer([b, a]).pack([b, a]).tolist() == [2, 2, 2, 1, 1]
    assert Packer([a, b]).pack([a, b]).tolist() == [1, 1, 2, 2, 2]


@pytest.mark.parametrize("dtype", DTYPES)
def test_fallback_identical_to_kernel(dtype: type) -> None:
    shapes = [(1,), (0,), (977,), (31, 17), (2,)]
    arrays = make_arrays(dtype, shapes, seed=3)
    auto, numpy_path = Packer(arrays), Packer(arrays, impl="numpy")
    assert np.array_equal(auto.pack(arrays), numpy_path.pack(arrays))
    outs = [[np.empty_like(a) for a in arrays] for _ in range(2)]
    auto.unpack(auto.buffer, outs[0], scale=0.125)
    numpy_path.unpack(numpy_path.buffer, outs[1], scale=0.125)
    for x, y in zip(*outs, strict=True):
        assert np.array_equal(x, y)


def test_non_contiguous_inputs_take_the_fallback() -> None:
    base = make_arrays(np.float64, [(6, 8), (9,)])
    arrays = [base[0][:, ::2], base[1][::3]]  # strided views
    packer = Packer([a.shape for a in arrays], np.float64)
    buf = packer.pack(arrays)
    assert packer.last_impl == "numpy"
    assert np.array_equal(buf, reference(arrays))
    out = [np.zeros((6, 8))[:, 1::2], np.zeros(9)[::3]]
    packer.unpack(buf, out, scale=2.0)
    assert packer.last_impl == "numpy"
    for a, o in zip(arrays, out, strict=True):
        assert np.array_equal(o, a * 2.0)


@needs_ext
def test_contiguous_inputs_use_the_kernel() -> None:
    arrays = make_arrays(np.float32, [(4,), (2, 3)])
    packer = Packer(arrays)
    buf = packer.pack(arrays)
    assert packer.last_impl == "cython"
    packer.unpack(buf, [np.empty_like(a) for a in arrays], scale=0.5)
    assert packer.last_impl == "cython"
    # a read-only output, a subclass or a mismatched shape does not qualify: slice path
    ro = [np.empty_like(a) for a in arrays]
    ro[1].flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        packer.unpack(buf, ro)
    assert packer.last_impl == "numpy"


def test_buffer_reused_and_grown_only_when_needed() -> None:
    arrays = make_arrays(np.float32, [(100,), (50,)])
    packer = Packer(arrays)
    first = packer.pack(arrays)
    storage = packer._storage
    second = packer.pack(make_arrays(np.float32, [(100,), (50,)], seed=1))
    assert np.shares_memory(first, second) and packer._storage is storage
    packer.rebind([(30,), (20,), (0,)])  # smaller: same storage
    assert packer._storage is storage and packer.total == 50 and packer.buffer.size == 50
    small = make_arrays(np.float32, [(30,), (20,), (0,)])
    assert np.array_equal(packer.pack(small), reference(small))
    packer.rebind([(200,)])  # larger: reallocated
    assert packer._storage is not storage and packer._storage.size == 200
    big = make_arrays(np.float32, [(200,)])
    assert np.array_equal(packer.pack(big), reference(big))


def test_unpack_accepts_a_larger_received_buffer() -> None:
    arrays = make_arrays(np.float64, [(3,), (4,)])
    packer = Packer(arrays)
    recv = np.concatenate([reference(arrays), [99.0, 99.0]])
    out = [np.empty(3), np.empty(4)]
    packer.unpack(recv, out)
    assert np.array_equal(out[0], arrays[0]) and np.array_equal(out[1], arrays[1])


def test_empty_list() -> None:
    packer = Packer([], np.float32)
    assert packer.pack([]).size == 0 and packer.nbytes == 0
    packer.unpack(np.zeros(0, np.float32), [])


@pytest.mark.parametrize("impl", IMPLS)
def test_errors_name_the_problem(impl: str) -> None:
    arrays = make_arrays(np.float32, [(3,), (4,)])
    packer = Packer(arrays, impl=impl)
    with pytest.raises(PackError, match="got 1 arrays, the packer was built for 2"):
        packer.pack(arrays[:1])
    with pytest.raises(PackError, match="array 1 has dtype float64, the packer float32"):
        packer.pack([arrays[0], arrays[1].astype(np.float64)])
    with pytest.raises(PackError, match=r"array 0 has shape \(4,\), the packer expects \(3,\)"):
        packer.pack([arrays[1], arrays[1]])
    with pytest.raises(PackError, match="at least 7 elements"):
        packer.unpack(np.zeros(6, np.float32), arrays)
    with pytest.raises(PackError, match="buffer has dtype float64"):
        packer.unpack(np.zeros(7), arrays)
    with pytest.raises(PackError, match="got 3 arrays"):
        packer.unpack(packer.buffer, [*arrays, arrays[0]])


def test_constructor_errors() -> None:
    with pytest.raises(PackError, match="dtype="):
        Packer([(3,), (4,)])
    with pytest.raises(PackError, match="one dtype"):
        Packer([np.zeros(2, np.float32), np.zeros(2, np.float64)])
    with pytest.raises(PackError, match="float32 and float64"):
        Packer([np.zeros(2, np.int32)])
    with pytest.raises(PackError, match="array 0 has dtype float32, the packer float64"):
        Packer([np.zeros(2, np.float32)], np.float64)
    with pytest.raises(ValueError, match="impl must be one of"):
        Packer([(2,)], np.float32, impl="fast")


@needs_ext
def test_kernel_checks_sizes() -> None:
    from hpcdl._ext import pack as kernel

    buf = np.zeros(5, np.float32)
    offsets = np.array([0, 2, 5], dtype=np.intp)
    with pytest.raises(ValueError, match="array 1 has 2 elements, its slot 3"):
        kernel.pack([np.ones(2, np.float32), np.ones(2, np.float32)], buf, offsets)
    with pytest.raises(ValueError, match="buffer too small"):
        kernel.pack([np.ones(2, np.float32), np.ones(3, np.float32)], buf[:4], offsets)
    with pytest.raises(ValueError, match="len\\(arrays\\) \\+ 1"):
        kernel.unpack(buf, [np.ones(2, np.float32)], offsets)
