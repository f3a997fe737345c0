"""Tests of hpcdl.comm.buckets: the bucket plan as literal tables, packing per bucket, readiness."""

from __future__ import annotations

import numpy as np
import pytest

from hpcdl.comm.buckets import Buckets, plan_buckets
from hpcdl.comm.pack import HAVE_EXT, Packer, PackError

needs_ext = pytest.mark.skipif(not HAVE_EXT, reason="hpcdl._ext.pack not built")
IMPLS = [pytest.param("cython", marks=needs_ext), "numpy"]
MLP32 = [(512, 784), (512,)] + [(512, 512), (512,)] * 30 + [(10, 512), (10,)]


def test_plan_fills_from_the_last_array_back() -> None:
    # sizes in elements, 4-byte items, 48-byte buckets (12 elements); array 4 alone exceeds it
    plan = plan_buckets([5, 5, 5, 5, 30, 5], 48, 4)
    table = [(b.index, b.arrays, b.offsets) for b in plan.buckets]
    assert table == [
        (0, (5,), (0, 5)),
        (1, (4,), (0, 30)),
        (2, (2, 3), (0, 5, 10)),
        (3, (0, 1), (0, 5, 10)),
    ]
    assert plan.bucket_of == (3, 3, 2, 2, 1, 0)
    assert [b.last_ready for b in plan.buckets] == [5, 4, 2, 0]
    assert [plan.nbytes(b) for b in range(len(plan))] == [20, 120, 40, 40]
    assert "bucket" in plan.describe()


def test_plan_edges() -> None:
    assert plan_buckets([3, 0, 4], None, 8).buckets[0].arrays == (0, 1, 2)
    assert len(plan_buckets([], 100, 4)) == 0
    assert [b.arrays for b in plan_buckets([0, 2, 0], 4, 4).buckets] == [(2,), (0, 1)]
    with pytest.raises(ValueError, match="positive"):
        plan_buckets([1], 0, 4)


@pytest.mark.parametrize("cap_mib", [0.25, 1, 4, 25])
@pytest.mark.parametrize("itemsize", [2, 4])
def test_mlp32_plan_invariants(cap_mib: float, itemsize: int) -> None:
    sizes = [int(np.prod(s)) for s in MLP32]
    cap = int(cap_mib * 2**20)
    plan = plan_buckets(sizes, cap, itemsize)
    seen = [i for b in plan.buckets for i in b.arrays]
    assert sorted(seen) == list(range(len(sizes)))  # every array exactly once
    assert plan.buckets[0].arrays[-1] == len(sizes) - 1  # bucket 0 holds the last layer
    for b in plan.buckets:
        assert list(b.arrays) == list(range(b.arrays[0], b.arrays[-1] + 1))  # contiguous run
        assert plan.nbytes(b.index) <= cap or len(b.arrays) == 1
        if b.index + 1 < len(plan):
            assert plan.buckets[b.index + 1].arrays[-1] == b.arrays[0] - 1  # next one goes back


def make_arrays(dtype: type, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    shapes = [(7, 3), (0,), (40,), (1,), (5, 5), (), (130,), (2, 9)]
    return [np.asarray(rng.standard_normal(s) * 10, dtype) for s in shapes]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("mode", ["plain", "float16", "bfloat16", "int32"])
@pytest.mark.parametrize("cap", [None, 16, 100, 400, 10_000])  # 16 bytes: smaller than most arrays
def test_buckets_round_trip(impl: str, dtype: type, mode: str, cap: int | None) -> None:
    arrays = make_arrays(dtype)
    buckets = Buckets(arrays, cap, mode=mode, impl=impl)
    qscale = 1e4 if mode == "int32" else None
    bufs = buckets.pack(arrays, qscale=qscale)
    flat = [Packer([arrays[i] for i in bk.arrays], mode=mode) for bk in buckets.plan.buckets]
    for b, bk in enumerate(buckets.plan.buckets):
        assert bufs[b].dtype == buckets.wire_dtype and bufs[b].size == bk.size
        ref = flat[b].pack([arrays[i] for i in bk.arrays], qscale=qscale)  # a Packer over the bucket
        assert np.array_equal(bufs[b].view(np.uint8), ref.view(np.uint8))
        assert buckets.packer(b).last_impl == impl
    out = [np.full_like(a, np.nan) for a in arrays]
    buckets.unpack([b.copy() for b in bufs], out, scale=0.5, qscale=qscale)
    for b, bk in enumerate(buckets.plan.buckets):
        ref_out = [np.empty_like(arrays[i]) for i in bk.arrays]
        flat[b].unpack(bufs[b], ref_out, scale=0.5, qscale=qscale)
        for i, r in zip(bk.arrays, ref_out):
            assert np.array_equal(out[i], r)
    if mode == "plain":
        for a, o in zip(arrays, out):
            assert np.array_equal(o, a * dtype(0.5))


def test_bucket_bytes_count_the_packed_format() -> None:
    arrays = [np.zeros(100, np.float32) for _ in range(4)]
    assert len(Buckets(arrays, 400)) == 4 and len(Buckets(arrays, 400, mode="float16")) == 2


def test_mark_ready_releases_buckets_in_order() -> None:
    arrays = [np.zeros(n, np.float32) for n in (5, 5, 5, 5, 30, 5)]
    buckets = Buckets(arrays, 48)  # plan of test_plan_fills_from_the_last_array_back
    assert [buckets.mark_ready(i) for i in reversed(range(6))] == [[0], [1], [], [2], [], [3]]
    assert all(buckets.is_complete(b) for b in range(4))
    with pytest.raises(PackError, match="marked ready twice"):
        buckets.mark_ready(0)
    buckets.reset()
    # out of order: bucket 2 completes first, but is released only after 0 and 1
    assert [buckets.mark_ready(i) for i in (2, 3, 0, 5, 1, 4)] == [[], [], [], [0], [], [1, 2, 3]]
    assert [buckets.bucket_of(i) for i in range(6)] == [3, 3, 2, 2, 1, 0]


def test_buffers_grow_only_when_needed() -> None:
    arrays = [np.ones(10, np.float32), np.ones(20, np.float32)]
    buckets = Buckets(arrays, 80)
    storage = [buckets.packer(b)._storage for b in range(len(buckets))]
    buckets.pack(arrays)
    buckets.rebind([(5,), (20,)])
    assert [buckets.packer(b)._storage for b in range(2)] == storage
    buckets.rebind([(5,), (30,)])  # bucket 0 grows (an array alone above the capacity)
    assert buckets.packer(0)._storage is not storage[0] and buckets.packer(1)._storage is storage[1]


def test_errors() -> None:
    arrays = make_arrays(np.float32)
    buckets = Buckets(arrays, 100)
    with pytest.raises(PackError, match="got 2 arrays, the buckets were built for 8"):
        buckets.pack_bucket(0, arrays[:2])
    with pytest.raises(PackError, match="dtype="):
        Buckets([(3,)], 100)
    with pytest.raises(PackError, match="float32 and float64"):
        Buckets([np.zeros(3, np.int64)], 100)
    with pytest.raises(ValueError, match="impl must be one of"):
        Buckets(arrays, 100, impl="fast")
    with pytest.raises(PackError, match="2 buffers for"):
        buckets.unpack([buckets.buffer(0)] * 2, arrays)
    assert buckets.maxabs(arrays) == max(float(np.abs(a).max()) for a in arrays if a.size)
