"""The gradient exchange under mpiexec: averages as MPI's Allreduce does; debug checks name the culprit."""

from __future__ import annotations

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
    local = [p.grad.copy() for p in model.parameters()]
    ex.exchange()
    for p, g in zip(model.parameters(), local):
        total = np.empty_like(g)
        comm.Allreduce(g, total, op=SUM)
        np.testing.assert_allclose(p.grad, total / comm.Get_size(), rtol=1e-5, atol=1e-7)
    ex.free()
