"""The algorithm ``"mpi"``: the MPI library's own allreduce, as a schedule of one round."""

from __future__ import annotations

from typing import Any

from hpcdl.comm.collectives.buffers import mpi_op
from hpcdl.comm.collectives.schedule import Schedule
from hpcdl.comm.contract import Communicator

__all__ = ["allreduce"]


def allreduce(comm: Communicator, src: Any, dst: Any, op: Any, tag: int, *, alloc: Any = None) -> Schedule:
    """``comm.Iallreduce`` of ``src`` into ``dst`` (``src is dst``: ``IN_PLACE``); ``tag``, ``alloc`` unused.

    The blocking :meth:`Collectives.allreduce` calls ``comm.Allreduce`` instead, since MPI
    libraries pick their blocking and nonblocking algorithms separately.
    """
    if src is dst:
        import hpcdl.comm as hc

        src = hc.IN_PLACE
    yield [comm.Iallreduce(src, dst, op=mpi_op(op))]
