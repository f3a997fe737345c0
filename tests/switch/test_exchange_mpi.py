"""The ``switch`` exchange under mpiexec: the UDP switch sums what the int32 ring sums, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from hpcdl.comm import world, wtime
from hpcdl.config import load_config
from hpcdl.nn.parameter import Parameter
from hpcdl.parallel.exchange import ExchangeError
from hpcdl.parallel.switched import make_switch_exchange, spawn_switch, stop_switch
from hpcdl.train import run

COMMON = ["optimizer.lr=0.05", "train.steps=8", "schedule.scale=none", "exchange.bucket_mb=0.05"]


def _parameters(run_result: object) -> np.ndarray:
    return np.concatenate([p.data.ravel() for p in run_result.model.parameters()])


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "faults",
    [[], ["switch.loss=0.1", "switch.duplicate=0.05", "switch.reorder=0.1"]],
    ids=["clean", "lossy"],
)
def test_digits_mlp_through_the_udp_switch_is_the_int32_ring_bitwise(faults: list[str]) -> None:
    comm = world()
    ring_cfg = [*COMMON, "exchange.compression='int32'", "exchange.algorithm=ring"]
    ring = run(load_config("digits-mlp", ring_cfg), comm)
    switched = run(load_config("digits-mlp", [*COMMON, "exchange.name=switch", *faults]), comm)
    assert switched.steps == ring.steps == 8
    mine = _parameters(switched)
    assert np.array_equal(mine, _parameters(ring))
    assert np.array_equal(mine, comm.bcast(mine, root=0))  # every worker alike


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(300)
def test_the_switch_rank_at_n_plus_1_is_the_udp_switch_at_n_bitwise() -> None:
    """N workers and the last rank as the switch, against the same N workers and a spawned UDP switch."""
    comm = world()
    ranked = run(load_config("digits-mlp", [*COMMON, "exchange.name=switch", "exchange.switch=rank"]), comm)
    workers = comm.Split(0 if comm.Get_rank() < comm.Get_size() - 1 else 1, comm.Get_rank())
    try:
        if comm.Get_rank() < comm.Get_size() - 1:
            spawned = [*COMMON, "exchange.name=switch", "exchange.switch=spawn"]
            udp = run(load_config("digits-mlp", spawned), workers)
            assert udp.steps == ranked.steps == 8
            assert np.array_equal(_parameters(ranked), _parameters(udp))
    finally:
        workers.Free()


def _exchange(comm: object, address: str, timeout_s: float) -> tuple[object, list[Parameter]]:
    cfg = load_config("digits-mlp", ["exchange.name=switch", f"exchange.switch='{address}'",
                                     f"switch.timeout_s={timeout_s}", "switch.timeout_ms=5"])  # fmt: skip
    rng = np.random.default_rng(comm.Get_rank())
    params = [Parameter(rng.standard_normal(n), name=f"p{i}") for i, n in enumerate((900, 40))]
    for p in params:
        p.grad[...] = rng.standard_normal(p.size)
    return make_switch_exchange(cfg, comm, params), params


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_a_killed_switch_fails_every_worker_within_timeout_s_naming_it() -> None:
    comm = world()
    process, address = None, ""
    if comm.Get_rank() == 0:
        process, address = spawn_switch(comm.Get_size(), 64, 1024, 1)
    address = comm.bcast(address, root=0)
    try:
        exchange, params = _exchange(comm, address, timeout_s=2.0)
        exchange.exchange()  # the switch answers
        first = [p.grad.copy() for p in params]
        assert all(np.isfinite(g).all() for g in first)
        comm.Barrier()
        if process is not None:
            process.kill()
            process.wait()
        comm.Barrier()
        t0 = wtime()
        with pytest.raises(ExchangeError) as e:
            exchange.exchange()
        waited = wtime() - t0
        assert 2.0 <= waited < 4.0
        text = str(e.value)
        assert address in text and "switch.timeout_s" in text and "bucket" in text
        assert "in flight" in text or "exponent round" in text
    finally:
        if process is not None:
            stop_switch(process)
