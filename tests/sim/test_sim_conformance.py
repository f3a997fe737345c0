"""The communicator conformance suite on the simulated communicator: N virtual ranks in this process.

The same bodies as under mpiexec (``tests/comm/conformance.py`` and the collectives'
checks of ``tests/comm/test_collectives.py``), on 2, 3 and 5 virtual ranks (and 1 where a
body allows it), with measured compute (the barrier body sleeps on rank 0).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from comm import test_collectives as collectives  # tests/ is on sys.path (pytest prepend mode)
from comm import test_widening as widening
from comm.conformance import CHECKS

import hpcdl.comm as hc
from hpcdl.comm import Communicator
from hpcdl.sim.engine import simulate

SIZES = (2, 3, 5)


def _run(check: Callable[[Communicator], None], n: int) -> None:
    result = simulate(n, lambda: check(hc.world()))
    assert len(result.results) == n


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("check", CHECKS, ids=[c.__name__ for c in CHECKS])
def test_conformance_in_the_simulator(check: Callable[[Communicator], None], n: int) -> None:
    _run(check, n)


@pytest.mark.parametrize("n", (1, 2, 3, 4))
@pytest.mark.parametrize("check", collectives.CHECKS, ids=[c.__name__ for c in collectives.CHECKS])
def test_hpcdl_collectives_in_the_simulator(check: Callable[[Communicator], None], n: int) -> None:
    _run(check, n)


@pytest.mark.parametrize("n", (2, 3))
@pytest.mark.parametrize("check", widening.CHECKS, ids=[c.__name__ for c in widening.CHECKS])
def test_widening_in_the_simulator(check: Callable[[Communicator], None], n: int) -> None:
    _run(check, n)


def test_node_memory_follows_the_simulated_nodes() -> None:
    """Node memory on one simulated node (every rank's segment readable by all, the engine's
    board emptied after); none where the network puts the ranks on two nodes, as under MPI."""
    from hpcdl.sim.network import load_network

    engines = []

    def body() -> tuple[bool, bool]:
        comm = hc.world()
        engines.append(comm._engine)
        whole = hc.node_memory(comm, 16)
        half = hc.subcomm(comm, [r for r in range(comm.Get_size()) if r // 2 == comm.Get_rank() // 2])
        pair = hc.node_memory(half, 16)
        for memory in (whole, pair):
            if memory is not None:
                memory.free()
        return whole is not None, pair is not None

    result = simulate(4, body, network=load_network("eth10g", 4))  # one rank per node
    assert result.results == [(False, False)] * 4
    result = simulate(4, body, network=load_network("shm-local", 4))  # one node
    assert result.results == [(True, True)] * 4
    assert all(not engine.node_boards for engine in engines)
