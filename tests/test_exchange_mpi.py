"""The gradient exchange under mpiexec: averages as MPI's Allreduce does; debug checks name the culprit."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hpcdl.comm import SUM, world
from hpcdl.nn import Parameter
from hpcdl.parallel import ExchangeError, make_exchange


def _params(rank: int, sizes: tuple[int, ...] = (3, 0, 7)) -> list[Parameter]:
    rng = np.random.default_rng(rank)
    ps = []
    for i, n in enumerate(sizes):
        p = Parameter(rng.standard_normal(n).astype(np.float32), name=f"p{i}")
        p.grad[...] = rng.standard_normal(n)
        ps.append(p)
    return ps


@pytest.mark.mpi(min_size=2)
def test_exchange_averages_like_mpi_allreduce() -> None:
    comm = world()
    params = _params(comm.Get_rank())
    expected = []
    for p in params:
        total = np.empty_like(p.grad)
        comm.Allreduce(p.grad.copy(), total, op=SUM)
        expected.append(total / comm.Get_size())
    ex = make_exchange("allreduce", comm, params)
    ex.exchange()
    for p, e in zip(params, expected):
        np.testing.assert_allclose(p.grad, e, rtol=1e-6)
    assert ex.bytes_sent == 10 * 4 and ex.comm_time >= 0


@pytest.mark.mpi(min_size=2)
def test_broadcast_parameters_from_root() -> None:
    comm = world()
    params = _params(comm.Get_rank())
    root = comm.Get_size() - 1
    make_exchange("allreduce", comm, params).broadcast_parameters(root=root)
    theirs = _params(root)
    for p, q in zip(params, theirs):
        np.testing.assert_array_equal(p.data, q.data)


@pytest.mark.mpi(min_size=2)
def test_debug_catches_different_models() -> None:
    comm = world()
    sizes = (3, 4) if comm.Get_rank() == 1 else (3, 5)
    ex = make_exchange("allreduce", comm, _params(comm.Get_rank(), sizes), debug=True)
    with pytest.raises(ExchangeError, match=r"rank 0: 8 float32, rank 1: 7 float32"):
        ex.exchange()


@pytest.mark.mpi(min_size=2)
def test_debug_names_the_non_finite_gradient() -> None:
    comm = world()
    params = _params(comm.Get_rank())
    if comm.Get_rank() == 1:
        params[2].grad[4] = np.nan
    ex = make_exchange("allreduce", comm, params, debug=True)
    with pytest.raises(ExchangeError) as info:
        ex.exchange()
    if comm.Get_rank() == 1:
        assert "rank 1: gradient of 'p2' has 1 non-finite values" in str(info.value)
    else:
        assert "another rank" in str(info.value)


@pytest.mark.mpi(min_size=2)
def test_bucketed_exchange_starts_buckets_during_backward() -> None:
    """Buckets fill from the last layer back and their allreduces start before backward ends."""
    from hpcdl.models import build_model
    from hpcdl.nn import SoftmaxCrossEntropy, observe
    from hpcdl.parallel import BucketedExchange
    from hpcdl.rng import generator

    comm = world()
    model = build_model("mlp", (64,), 10, rng=generator(0, "init"), depth=4, width=64)
    alone = build_model("mlp", (64,), 10, rng=generator(0, "init"), depth=4, width=64)  # no exchange
    ex = make_exchange("bucketed", comm, model.parameters(), bucket_mb=0.01, algorithm="ring")
    assert isinstance(ex, BucketedExchange) and len(ex.buckets) > 2
    assert ex.buckets.plan.buckets[0].arrays[-1] == len(model.parameters()) - 1  # bucket 0: the last layer
    rng = np.random.default_rng(comm.Get_rank())
    x, y = rng.standard_normal((8, 64)).astype(np.float32), rng.integers(0, 10, 8)
    loss = SoftmaxCrossEntropy()
    started = []

    class Watch:
        def before(self, phase, layer, x):
            pass

        def after(self, phase, layer, y):
            if phase == "backward":
                started.append(len(ex._reqs))

    with observe(Watch()), observe(ex):  # ex inner: its after() runs first
        loss.forward(model.forward(x), y)
        model.backward(loss.backward())
    assert started == sorted(started) and started[-1] == len(ex._reqs)
    assert max(started[:-3]) >= 1  # buckets were in flight while three layers' backward remained
    loss.forward(alone.forward(x), y)  # this rank's own gradients (the exchange's sum them in place)
    alone.backward(loss.backward())
    local = [p.grad.copy() for p in alone.parameters()]
    ex.exchange()
    for p, g in zip(model.parameters(), local):
        total = np.empty_like(g)
        comm.Allreduce(g, total, op=SUM)
        np.testing.assert_allclose(p.grad, total / comm.Get_size(), rtol=1e-5, atol=1e-7)
    ex.free()


def _mean_over_ranks(comm, arrays: list[np.ndarray]) -> list[np.ndarray]:
    out = []
    for a in arrays:
        total = np.empty_like(a, dtype=np.float64)
        comm.Allreduce(a.astype(np.float64), total, op=SUM)
        out.append(total / comm.Get_size())
    return out


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", ["allreduce", "bucketed"])
def test_accumulation_averages_over_ranks_and_micro_steps(name: str) -> None:
    """Three micro-steps: the exchange gives the mean of all 3 N gradients, and then starts afresh."""
    comm = world()
    params = _params(comm.Get_rank(), (5, 0, 300, 7))
    rng = np.random.default_rng([11, comm.Get_rank()])
    micro = [[rng.standard_normal(p.grad.shape).astype(np.float32) for p in params] for _ in range(3)]
    ex = make_exchange(name, comm, params, **({"bucket_mb": 0.0005} if name == "bucketed" else {}))
    for m, grads in enumerate(micro):
        for p, g in zip(params, grads):
            p.grad[...] = g
        if m < 2:
            ex.accumulate()
    ex.exchange()
    expected = _mean_over_ranks(comm, [sum(gs[i] for gs in micro) / 3 for i in range(len(params))])
    for p, e in zip(params, expected):
        np.testing.assert_allclose(p.grad, e, rtol=1e-5, atol=1e-6)
    for p, g in zip(params, micro[0]):  # the next step has no micro-steps left over
        p.grad[...] = g
    ex.exchange()
    for p, e in zip(params, _mean_over_ranks(comm, micro[0])):
        np.testing.assert_allclose(p.grad, e, rtol=1e-5, atol=1e-6)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("compression", ["float16", "bfloat16"])
def test_bucketed_compression_rounds_once_after_a_float32_sum(compression: str) -> None:
    """The mean of N 2-byte gradients, summed in float32 and rounded once, over several buckets."""
    from hpcdl.comm.pack import narrow_into as narrow

    comm = world()
    size = comm.Get_size()
    params = _params(comm.Get_rank(), (5, 0, 300, 7, 1))
    ex = make_exchange("bucketed", comm, params, bucket_mb=0.0005, compression=compression)
    assert len(ex.buckets) >= 2 and ex.buckets.wire_dtype.itemsize == 2
    local = [p.grad.copy() for p in params]
    ex.exchange()
    wire = np.float16 if compression == "float16" else np.uint16
    for p, g in zip(params, local):
        w = narrow(compression, g, np.empty(g.shape, wire))  # this rank's wire values
        every = comm.allgather(w)
        exact = np.zeros(g.shape, np.float32)
        for e in every:  # widen exactly, then sum
            exact += (
                e.astype(np.float32)
                if compression == "float16"
                else (e.astype(np.uint32) << 16).view(np.float32)
            )
        summed = narrow(compression, exact, np.empty(g.shape, wire))
        wide = (
            summed.astype(np.float32)
            if compression == "float16"
            else (summed.astype(np.uint32) << 16).view(np.float32)
        )
        ulp = 2.0**-10 if compression == "float16" else 2.0**-7
        np.testing.assert_allclose(p.grad, wide / size, rtol=ulp, atol=2.0**-24)
        exact_mean = _mean_over_ranks(comm, [g])[0]
        np.testing.assert_allclose(p.grad, exact_mean, rtol=4 * ulp, atol=4 * ulp)
    assert ex.bytes_sent == 2 * sum(p.size for p in params)
    ex.free()


@pytest.mark.mpi(min_size=2)
def test_bucketed_int32_compression_quantizes_with_a_shared_power_of_two() -> None:
    """The default rule (pow2): the scale is 2**k from the MAX of the ranks' int32 exponents, and the
    mean is bitwise sum_r(rint(g_r 2**k)) / 2**k / N, computed here independently, over several buckets."""
    from hpcdl.comm import MAX
    from hpcdl.comm.pack import int32_pow2_scale

    comm = world()
    size, rank = comm.Get_size(), comm.Get_rank()
    params = _params(rank, (5, 0, 300, 7, 1))
    params[2].grad[7] = 1e4 * (rank + 1)  # the largest exponent comes from the last rank
    params[3].grad[...] *= 1e-6  # a bucket of small gradients: a large k of its own
    ex = make_exchange("bucketed", comm, params, bucket_mb=0.0005, compression="int32")
    assert ex.int32_scale == "pow2" and len(ex.buckets) >= 2
    local = [p.grad.copy() for p in params]
    ex.exchange()
    for b, bucket in enumerate(ex.buckets.plan.buckets):
        members = [local[i] for i in bucket.arrays]
        e = comm.allreduce(max(math.frexp(float(np.abs(g).max(initial=0)))[1] for g in members), op=MAX)
        k = (2**31 - 1) // size
        k = k.bit_length() - 1 - e  # the largest k with N 2**e 2**k <= 2**31 - 1
        assert ex._qscales[b] == int32_pow2_scale(e, size) == 2.0**k
        for i in bucket.arrays:
            quantized = np.rint(local[i].astype(np.float64) * 2.0**k)
            assert np.abs(quantized).max(initial=0) * size <= 2**31 - 1
            total = np.empty_like(quantized)
            comm.Allreduce(quantized, total, op=SUM)  # integers: exact in float64
            want = (total / 2.0**k * (1.0 / size)).astype(np.float32)
            assert np.array_equal(params[i].grad, want), params[i].name
    assert ex.bytes_sent == 4 * sum(p.size for p in params)
    ex.free()


@pytest.mark.mpi(min_size=2)
def test_bucketed_int32_compression_old_rule_quantizes_with_the_global_max() -> None:
    """The rule before pow2 (``int32_scale="max"``), kept for runs that began under it: the mean is
    sum(rint(g q)) / (N q), q = int32_scale(global max |g|, N)."""
    from hpcdl.comm import MAX
    from hpcdl.comm.pack import int32_scale

    comm = world()
    size = comm.Get_size()
    params = _params(comm.Get_rank(), (5, 0, 300, 7, 1))
    params[2].grad[7] = 1e4 * (comm.Get_rank() + 1)  # the global max comes from the last rank
    ex = make_exchange(
        "bucketed", comm, params, bucket_mb=0.0, compression="int32", int32_scale="max"
    )  # one bucket
    local = [p.grad.copy() for p in params]
    ex.exchange()
    q = int32_scale(comm.allreduce(max(float(np.abs(g).max(initial=0)) for g in local), op=MAX), size)
    assert q == int32_scale(1e4 * size, size) == ex._qscales[0]
    for p, g in zip(params, local):
        total = np.empty(g.shape, np.float64)
        comm.Allreduce(np.rint(g.astype(np.float64) * q), total, op=SUM)
        assert np.array_equal(p.grad, (total * (1.0 / size / q)).astype(np.float32)), p.name
    assert ex.bytes_sent == 4 * sum(p.size for p in params)
    ex.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("rule", ["pow2", "max"])
@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_int32_compression_refuses_a_non_finite_gradient_on_every_rank(rule: str, bad: float) -> None:
    comm = world()
    params = _params(comm.Get_rank())
    if comm.Get_rank() == comm.Get_size() - 1:
        params[2].grad[1] = bad
    ex = make_exchange("bucketed", comm, params, compression="int32", int32_scale=rule)
    with pytest.raises(ExchangeError, match="not finite on some rank"):
        ex.exchange()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gradients_in_their_buckets_memory_sum_bit_for_bit_as_packed_ones(dtype: type) -> None:
    """In the plain format each ``p.grad`` is a view of its bucket's buffer: backward writes what is
    sent and nothing is packed; the averages are those of the packing exchange (``debug`` packs)
    bit for bit, and stay in the same arrays."""
    from hpcdl.models import build_model
    from hpcdl.nn import SoftmaxCrossEntropy, observe
    from hpcdl.rng import generator

    comm = world()
    rng = np.random.default_rng(comm.Get_rank())
    x, y = rng.standard_normal((8, 64)).astype(dtype), rng.integers(0, 10, 8)
    grads = {}
    for debug in (False, True):
        model = build_model("mlp", (64,), 10, rng=generator(0, "init"), depth=4, width=48, dtype=dtype)
        params = model.parameters()
        ex = make_exchange("bucketed", comm, params, debug=debug, bucket_mb=0.01, algorithm="ring")
        assert ex.in_place is not debug
        bound = [p.grad for p in model.parameters()]
        buffers = [ex.buckets.buffer(b) for b in range(len(ex.buckets))]
        assert all(any(np.shares_memory(g, buf) for buf in buffers) for g in bound) is not debug
        loss = SoftmaxCrossEntropy()
        with observe(ex):
            loss.forward(model.forward(x), y)
            model.backward(loss.backward())
        ex.exchange()
        assert all(p.grad is g for p, g in zip(model.parameters(), bound))
        grads[debug] = [p.grad.copy() for p in model.parameters()]
        ex.free()
    for a, b in zip(grads[False], grads[True]):
        assert a.tobytes() == b.tobytes()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_buckets_in_node_memory_are_reduced_where_they_lie(dtype: type) -> None:
    """On one node the buckets are node memory and ``shm`` sums them there: the means equal the
    ring's (packing, ``debug``) to rounding, bit for bit at 2 ranks (both add the owner's value
    first), and are the same bits on every rank."""
    import hashlib

    from hpcdl.models import build_model
    from hpcdl.nn import SoftmaxCrossEntropy, observe
    from hpcdl.rng import generator

    comm = world()
    rng = np.random.default_rng(comm.Get_rank())
    x, y = rng.standard_normal((8, 64)).astype(dtype), rng.integers(0, 10, 8)
    grads = {}
    for algorithm, debug in (("shm", False), ("ring", True)):
        model = build_model("mlp", (64,), 10, rng=generator(0, "init"), depth=4, width=48, dtype=dtype)
        ex = make_exchange(
            "bucketed", comm, model.parameters(), debug=debug, bucket_mb=0.01, algorithm=algorithm
        )
        assert ex.node_memory is not debug
        loss = SoftmaxCrossEntropy()
        with observe(ex):
            loss.forward(model.forward(x), y)
            model.backward(loss.backward())
        ex.exchange()
        grads[algorithm] = [p.grad.copy() for p in model.parameters()]
        ex.free()  # node memory unmapped: the gradients were copied out, as they were
        assert all(p.grad.base is None for p in model.parameters())
        assert all(a.tobytes() == p.grad.tobytes() for a, p in zip(grads[algorithm], model.parameters()))
    digest = hashlib.sha256(b"".join(g.tobytes() for g in grads["shm"])).hexdigest()
    assert len(set(comm.allgather(digest))) == 1
    for a, b in zip(grads["shm"], grads["ring"]):
        if comm.Get_size() == 2:
            assert a.tobytes() == b.tobytes()
        else:
            np.testing.assert_allclose(a, b, rtol=1e-5 if dtype == np.float32 else 1e-12, atol=1e-7)


@pytest.mark.mpi(min_size=2)
def test_shm_needs_the_gradients_in_their_buckets() -> None:
    from hpcdl.errors import ConfigError

    comm = world()
    for options in ({"debug": True}, {"compression": "float16"}, {"in_place": False}):
        with pytest.raises(ConfigError, match="needs exchange.in_place = true, no compression"):
            make_exchange("bucketed", comm, _params(comm.Get_rank()), algorithm="shm", **options)


@pytest.mark.mpi(min_size=2)
def test_node_memory_only_where_an_algorithm_may_use_it() -> None:
    """Buckets go into node memory for ``shm``, or ``auto`` whose table picks it; not for the
    others (a shared window costs /dev/shm); a resume's table that picks it moves them there."""
    from hpcdl.comm.collectives import AutoTable

    comm = world()
    shm_table = AutoTable(fallback=((None, "shm"),))
    ring_table = AutoTable(fallback=((None, "ring"),))
    for algorithm, table, want in (("ring", None, False), ("auto", ring_table, False),
                                   ("auto", shm_table, True), ("shm", None, True)):  # fmt: skip
        ex = make_exchange("bucketed", comm, _params(comm.Get_rank()), algorithm=algorithm, auto=table)
        assert ex.node_memory is want, (algorithm, table)
        ex.free()
    params = _params(comm.Get_rank())
    grads = [p.grad.copy() for p in params]
    ex = make_exchange("bucketed", comm, params, algorithm="auto", auto=ring_table)
    ex.auto = shm_table  # as a resume puts back its checkpoint's table
    assert ex.node_memory and all(a.tobytes() == p.grad.tobytes() for a, p in zip(grads, params))
    ex.exchange()
    expected = [np.empty_like(g) for g in grads]
    for g, e in zip(grads, expected):
        comm.Allreduce(g, e, op=SUM)
        e /= comm.Get_size()
    for p, e in zip(params, expected):
        np.testing.assert_allclose(p.grad, e, rtol=1e-6)
    ex.free()


def small_dev_shm(monkeypatch: pytest.MonkeyPatch) -> None:
    """/dev/shm with 1 MB free (a container's small /dev/shm), on every rank."""
    import os

    from hpcdl.comm import mpi

    class Fake:
        f_frsize, f_bavail, f_blocks = 4096, 256, 16384

    real = os.statvfs
    monkeypatch.setattr(os, "statvfs", lambda path: Fake() if path == mpi.SHM_DIR else real(path))


@pytest.mark.mpi(min_size=2)
def test_too_little_dev_shm_is_one_line_for_shm_and_a_remark_for_auto(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A window /dev/shm cannot hold would kill the ranks with SIGBUS when touched: it is refused
    before it is mapped, on every rank. Named ``shm``: the error, with the fix; ``auto`` whose table
    picks it: the buckets stay ordinary memory, the table's message algorithm sums them, and a remark
    says why."""
    from hpcdl.comm.collectives import AutoTable, Collectives
    from hpcdl.errors import NodeMemoryError
    from hpcdl.parallel.sync import auto_remarks

    small_dev_shm(monkeypatch)
    comm = world()
    big = [Parameter(np.ones(300_000, np.float32), name="w")]  # 1.2 MB per rank: more than 1 MB
    said = r"need [\d.]+ MB of /dev/shm for memory they share, and it has 1\.0 MB free of 67\.1 MB: "
    said += r"give it more room \(a container: docker run --shm-size=1g\)"
    with pytest.raises(NodeMemoryError, match=said):
        with Collectives(comm) as coll:
            coll.node_empty(300_000 * comm.Get_size(), np.float32)
    with pytest.raises(NodeMemoryError, match="or choose another exchange.algorithm than 'shm'"):
        make_exchange("bucketed", comm, big, algorithm="shm")
    params = _params(comm.Get_rank(), (300_000, 5))
    grads = [p.grad.copy() for p in params]
    ex = make_exchange("bucketed", comm, params, algorithm="auto", auto=AutoTable(fallback=((None, "shm"),)))
    assert not ex.node_memory
    (remark,) = auto_remarks(ex)
    assert "MB free" in remark and "auto runs the fastest of the message algorithms in place of shm" in remark
    ex.exchange()
    for p, g in zip(params, grads):
        want = np.empty_like(g)
        comm.Allreduce(g, want, op=SUM)
        np.testing.assert_allclose(p.grad, want / comm.Get_size(), rtol=1e-6)
    ex.free()


@pytest.mark.mpi(min_size=2)
def test_auto_calibrates_without_shm_when_dev_shm_is_too_small(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Calibrated with room, then timed again without: this run chooses among the others and says
    so; the cache keeps its entry with shm's times, for the next run that has the room."""
    import json
    from pathlib import Path

    from hpcdl.comm.collectives.tune import tuned_table

    comm = world()
    cache = comm.bcast(str(tmp_path_factory.mktemp("cache") / "auto.json") if comm.Get_rank() == 0 else None)
    first = tuned_table(comm, (4096, 4 << 20), cache=cache, min_time=1e-4)
    assert first.source == "calibrated"
    before = Path(cache).read_text()
    small_dev_shm(monkeypatch)
    tuning = tuned_table(comm, (4096, 4 << 20), mode="always", cache=cache, min_time=1e-4)
    assert tuning.lines[0].startswith("auto leaves out shm in this run: node memory: the ranks of this node")
    assert tuning.lines[-1].startswith("auto calibrated 2 bucket sizes") and "not cached" in tuning.lines[-1]
    segments = tuning.table.segments[comm.Get_size()]
    assert all(s.algorithm != "shm" for s in segments) and tuning.source == "calibrated"
    assert tuning.table.meta[comm.Get_size()]["notes"] == tuning.lines
    comm.Barrier()
    assert Path(cache).read_text() == before  # nothing stored
    (entry,) = json.loads(before)["entries"].values()
    assert "shm" in entry["algorithms"] and all("shm" in t for t in entry["times"].values())
