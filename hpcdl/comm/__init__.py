"""The communicator contract and its helpers: the same code runs on MPI and in the simulator.

``import hpcdl.comm`` is cheap: mpi4py (and MPI initialisation) is imported by
:mod:`hpcdl.comm.mpi` on the first call of :func:`world`, :func:`wtime`, ... or the first
use of a constant (``ANY_SOURCE``, ``ANY_TAG``, ``SUM``, ``MAX``, ``MIN``, ``IN_PLACE``,
which are mpi4py's own objects).
"""

from __future__ import annotations

from typing import Any

from hpcdl.comm.abort import abort_on_exception
from hpcdl.comm.context import (
    Status,
    due,
    host_ranks,
    long_wait,
    node_memory,
    notes,
    reset_world,
    set_world,
    sleep,
    slow_down,
    subcomm,
    use_world,
    waitall,
    waitany,
    world,
    wtime,
)
from hpcdl.comm.contract import Communicator, Request, WorldHooks
from hpcdl.comm.contract import Status as StatusProtocol
from hpcdl.comm.objects import on_root, recv_object, scatter_objects, send_object
from hpcdl.comm.watchdog import StallError
from hpcdl.comm.watched import WatchedComm, watch

__all__ = [
    "ANY_SOURCE",
    "ANY_TAG",
    "IN_PLACE",
    "MAX",
    "MIN",
    "SUM",
    "Communicator",
    "Request",
    "StallError",
    "Status",
    "StatusProtocol",
    "WatchedComm",
    "WorldHooks",
    "abort_on_exception",
    "due",
    "host_ranks",
    "on_root",
    "recv_object",
    "scatter_objects",
    "send_object",
    "sleep",
    "slow_down",
    "long_wait",
    "node_memory",
    "notes",
    "reset_world",
    "set_world",
    "subcomm",
    "use_world",
    "waitall",
    "waitany",
    "world",
    "watch",
    "wtime",
]

_MPI_CONSTANTS = frozenset({"ANY_SOURCE", "ANY_TAG", "IN_PLACE", "MAX", "MIN", "SUM"})


def __getattr__(name: str) -> Any:
    """Resolve the MPI constants from :mod:`hpcdl.comm.mpi` on first use (PEP 562)."""
    if name in _MPI_CONSTANTS:
        from hpcdl.comm import mpi

        return getattr(mpi, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _MPI_CONSTANTS)
