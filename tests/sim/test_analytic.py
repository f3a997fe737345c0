"""Simulated times against the model's closed forms, exactly (integer ticks), through the whole stack.

alpha = 1 us and B = 1 GB/s between nodes, one rank per node, compute ``none``: a byte
costs exactly 1000 ticks, so every formula below holds to the tick.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import hpcdl.comm as hc
from hpcdl.comm.collectives import Collectives
from hpcdl.sim.compute import make_compute
from hpcdl.sim.engine import simulate
from hpcdl.sim.network import load_network
from hpcdl.sim.ticks import TICKS_PER_SECOND, ticks

ALPHA, B = 1e-6, 1e9


@pytest.fixture
def net(tmp_path: Path) -> Path:
    path = tmp_path / "line.toml"
    path.write_text(
        'source = "a test network"\nranks_per_node = 1\n'
        "[intra]\nlatency_us = 1.0\nbandwidth_GBps = 1.0\n"
        "[inter]\nlatency_us = 1.0\nbandwidth_GBps = 1.0\n"
        '[topology]\nkind = "switch"\n'
    )
    return path


def _run(n: int, body, net: Path):
    return simulate(n, body, network=load_network(net, n), compute=make_compute("none"))


def _ticks(seconds: float) -> int:
    return round(seconds * TICKS_PER_SECOND)


@pytest.mark.parametrize("nbytes", [0, 8, 1000, 1 << 20])
def test_ping_pong_is_two_alpha_plus_two_transfers(net: Path, nbytes: int) -> None:
    def body():
        comm = hc.world()
        buf = np.zeros(nbytes, dtype=np.uint8)
        if comm.Get_rank() == 0:
            comm.Send(buf, dest=1)
            comm.Recv(buf, source=1)
        else:
            comm.Recv(buf, source=0)
            comm.Send(buf, dest=0)
        return hc.wtime()

    result = _run(2, body, net)
    assert _ticks(result.results[0]) == 2 * (ticks(ALPHA) + nbytes * 1000)


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_ring_allreduce_is_2_n_minus_1_steps(net: Path, n: int) -> None:
    nbytes = 4 * n * 1024  # divisible by n: equal chunks

    def body():
        comm = hc.world()
        x = np.ones(nbytes // 4, dtype=np.float32)
        with Collectives(comm, "ring") as coll:
            t0 = hc.wtime()
            coll.Allreduce(x, x)
            t = hc.wtime() - t0
        assert x[0] == comm.Get_size()
        return t

    result = _run(n, body, net)
    expected = 2 * (n - 1) * (ticks(ALPHA) + nbytes // n * 1000)
    assert {_ticks(t) for t in result.results} == {expected}


@pytest.mark.parametrize("senders", [1, 2, 5, 16])
def test_incast_serialises_on_the_receiver(net: Path, senders: int) -> None:
    nbytes = 4096

    def body():
        comm = hc.world()
        if comm.Get_rank() == 0:
            bufs = [np.zeros(nbytes, dtype=np.uint8) for _ in range(senders)]
            hc.waitall([comm.Irecv(b, source=p + 1) for p, b in enumerate(bufs)])
            return hc.wtime()
        comm.Send(np.zeros(nbytes, dtype=np.uint8), dest=0)
        return None

    result = _run(senders + 1, body, net)
    assert _ticks(result.results[0]) == ticks(ALPHA) + senders * nbytes * 1000


def test_same_command_same_seed_same_times_bit_for_bit(net: Path) -> None:
    """compute none: wildcard receives, nonblocking collectives and all, two runs agree exactly."""

    def body():
        comm = hc.world()
        rank, size = comm.Get_rank(), comm.Get_size()
        x = np.arange(1000, dtype=np.float64) * (rank + 1)
        with Collectives(comm, "auto") as coll:
            reqs = [coll.Iallreduce(x.copy(), np.empty_like(x)) for _ in range(3)]
            if rank == 0:
                got, status = [], hc.Status()
                for _ in range(size - 1):
                    comm.Recv(np.zeros(8), source=hc.ANY_SOURCE, status=status)
                    got.append((status.Get_source(), hc.wtime()))
            else:
                comm.Send(np.full(8, rank, dtype=np.float64), dest=0)
                got = None
            hc.waitall(reqs)
        return got, hc.wtime()

    a, b = _run(7, body, net), _run(7, body, net)
    assert a.results == b.results and a.times_s == b.times_s
