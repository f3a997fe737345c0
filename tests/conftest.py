"""Shared fixtures: ``comm`` is the current world communicator (MPI's, or a world of one)."""

from __future__ import annotations

import pytest

import hpcdl.comm as hc


@pytest.fixture
def comm() -> hc.Communicator:
    """The current world, ``hpcdl.comm.world()`` (MPI's COMM_WORLD outside the simulator)."""
    return hc.world()
