"""hpcdl's own collectives, written on point-to-point calls through the communicator contract.

Allreduce by ring, recursive doubling and Rabenseifner (or the MPI library's own, ``"mpi"``;
on one node, ``"shm"`` reads the others' buffers where they lie in node memory),
ring reduce-scatter and allgather, binomial-tree reduce and broadcast; for any rank count and
length; ``"auto"`` picks among them by message size and rank count from a calibrated
:class:`AutoTable` (:mod:`~hpcdl.comm.collectives.auto`). Each is written once, as a
resumable schedule of point-to-point rounds (:mod:`~hpcdl.comm.collectives.schedule`), so
the nonblocking form is the same code as the blocking one and runs without threads, in MPI
and in the simulator::

    with Collectives(comm) as coll:
        coll.Allreduce(grad, grad, algorithm="rabenseifner")  # in place
        reqs = [coll.Iallreduce(b, b) for b in buckets]       # started in the same order everywhere
        hpcdl.comm.waitall(reqs)
"""

from __future__ import annotations

from hpcdl.comm.collectives.api import (
    ALGORITHMS,
    NODE_ALGORITHMS,
    TAG_SPAN,
    Collectives,
    CollectivesFreedError,
    available_algorithms,
)
from hpcdl.comm.collectives.auto import AutoTable, load_table
from hpcdl.comm.collectives.buffers import chunk_counts
from hpcdl.comm.collectives.schedule import CollRequest, Schedule

__all__ = [
    "ALGORITHMS",
    "NODE_ALGORITHMS",
    "TAG_SPAN",
    "AutoTable",
    "CollRequest",
    "Collectives",
    "CollectivesFreedError",
    "Schedule",
    "available_algorithms",
    "chunk_counts",
    "load_table",
]
