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
