"""The mpi4py adapter: the only hpcdl module that imports mpi4py.

Importing it initialises MPI (mpi4py 4 calls ``MPI_Init_thread`` on ``from mpi4py import
MPI`` by default, ``mpi4py.rc.initialize``); without mpiexec that is a world of one
(singleton init). :mod:`hpcdl.comm` imports this module only when first needed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hpcdl.errors import HpcdlError, NodeMemoryError

try:
    from mpi4py import MPI
except (ImportError, RuntimeError) as _err:  # mpi4py missing, or no MPI library to load
    _reason = str(_err).splitlines()[0]
    raise HpcdlError(
        f"mpi4py cannot start MPI ({_reason}): install an MPI library, e.g. `pip install mpich` "
        "(the [mpich] extra), or build mpi4py against your cluster's MPI (README: Installing on a cluster)"
    ) from None

__all__ = [
    "ANY_SOURCE",
    "ANY_TAG",
    "IN_PLACE",
    "MAX",
    "MIN",
    "PROC_NULL",
    "SHM_DIR",
    "SUM",
    "WatchedRequest",
    "all_requests",
    "host_ranks",
    "is_null",
    "node_segments",
    "world_ranks",
    "comm_world",
    "library_version",
    "new_status",
    "subcomm",
    "wait",
    "waitall",
    "waitany",
    "wtime",
]

ANY_SOURCE: int = MPI.ANY_SOURCE
ANY_TAG: int = MPI.ANY_TAG
IN_PLACE: Any = MPI.IN_PLACE
PROC_NULL: int = MPI.PROC_NULL
SUM: MPI.Op = MPI.SUM
MAX: MPI.Op = MPI.MAX
MIN: MPI.Op = MPI.MIN


class WatchedRequest(MPI.Request):
    """An MPI request whose ``Wait()`` is a watched wait (:class:`hpcdl.comm.watched.WatchedComm`'s).

    So code that writes mpi4py's ``req.Wait()`` is watched as one that calls
    :func:`hpcdl.comm.waitall` is. Otherwise it is the MPI request (``Test``,
    ``Request.Waitall`` and the rest are MPI's). ``what`` says what it is, for stall
    reports; ``due`` is the time it became due, when the caller said so
    (:func:`hpcdl.comm.due`).

    Args:
        req: the MPI request (its handle is taken over: use only the new object).
        wait: ``wait(req, status)`` blocks until ``req`` completes (the watchdog's).
        what: ``(operation, peer, tag, communicator name)``, e.g. ``("Irecv from", 1, 7, "world")``.
    """

    __slots__ = ("_wait", "due", "what")

    def __new__(cls, req: MPI.Request, wait: Any, what: tuple[Any, ...]) -> WatchedRequest:  # noqa: D102
        self = super().__new__(cls, req)
        self._wait = wait
        self.what = what
        self.due: float | None = None
        return self

    def Wait(self, status: MPI.Status | None = None) -> bool:  # noqa: N802  (MPI's name)
        """Wait for completion through the watchdog (``status``: filled as MPI's would be)."""
        self._wait(self, status)
        return True


def comm_world() -> MPI.Intracomm:
    """MPI's ``COMM_WORLD``."""
    return MPI.COMM_WORLD


def wtime() -> float:
    """``MPI.Wtime()``: wall-clock seconds."""
    return MPI.Wtime()


def new_status() -> MPI.Status:
    """A fresh ``MPI.Status``."""
    return MPI.Status()


def library_version() -> str:
    """The MPI library's version string (first line)."""
    return MPI.Get_library_version().strip().splitlines()[0]


def all_requests(reqs: Sequence[Any]) -> bool:
    """True when every entry is an ``MPI.Request`` or ``None``."""
    request = MPI.Request
    for r in reqs:  # a loop, not all(genexpr): this runs once per round of every collective
        if r is not None and not isinstance(r, request):
            return False
    return True


def _with_nulls(reqs: Sequence[MPI.Request | None]) -> Sequence[MPI.Request]:
    for r in reqs:
        if r is None:
            return [MPI.REQUEST_NULL if r is None else r for r in reqs]
    return reqs


def wait(req: MPI.Request, status: MPI.Status | None = None) -> None:
    """MPI's own ``Request.Wait`` (a :class:`WatchedRequest`'s too: unwatched)."""
    MPI.Request.Wait(req, status)


def waitall(reqs: Sequence[MPI.Request | None]) -> None:
    """``MPI.Request.Waitall`` over ``reqs`` (``None`` entries skipped)."""
    MPI.Request.Waitall(_with_nulls(reqs))


def waitany(reqs: Sequence[MPI.Request | None], status: MPI.Status | None = None) -> int | None:
    """``MPI.Request.Waitany``: the index completed, or ``None`` when none is active."""
    index = MPI.Request.Waitany(_with_nulls(reqs), status)
    return None if index == MPI.UNDEFINED else index


def subcomm(comm: MPI.Intracomm, ranks: Sequence[int]) -> MPI.Intracomm:
    """``comm.Create_group(comm.Get_group().Incl(ranks))``, freeing the groups.

    Collective over the members of ``ranks`` only.
    """
    group = comm.Get_group()
    try:
        sub = group.Incl(list(ranks))
        try:
            return comm.Create_group(sub)
        finally:
            sub.Free()
    finally:
        group.Free()


def host_ranks(comm: Any) -> list[int]:
    """The ranks of ``comm`` on this rank's node: ``Split_type(COMM_TYPE_SHARED)`` (collective).

    ``comm`` may be a :class:`~hpcdl.comm.WatchedComm` (its MPI communicator is split).
    """
    raw = getattr(comm, "mpi", comm)
    node = raw.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        group, parent = node.Get_group(), raw.Get_group()
        try:
            ranks = MPI.Group.Translate_ranks(group, list(range(node.Get_size())), parent)
        finally:
            group.Free()
            parent.Free()
    finally:
        node.Free()
    return sorted(int(r) for r in ranks)


def node_segments(comm: Any, nbytes: int) -> tuple[list[Any], Any, Any] | None:
    """``nbytes`` of memory per rank that every rank of ``comm`` can read (collective).

    An MPI-3 shared window (``Win.Allocate_shared``, one segment per rank, each rank's own
    pages first touched by itself) held in a passive-target epoch (``Lock_all``) until freed.

    Returns:
        ``(segments, sync, free)``: every rank's segment as a ``uint8`` NumPy array, by
        rank; ``Win_sync``; a collective free. None when ``comm``'s ranks are not all on one
        node (the same answer on every rank).

    Raises:
        NodeMemoryError: on every rank, when :data:`SHM_DIR` has less room free than the
            window needs (MPICH maps it from a file there, and a page touched past the room a
            tmpfs has left kills the process with SIGBUS: a container's 64 MB default).
    """
    import numpy as np

    raw = getattr(comm, "mpi", comm)
    node = raw.Split_type(MPI.COMM_TYPE_SHARED)  # key 0: ranks keep their order
    try:
        if node.Get_size() != raw.Get_size():
            return None
        short = node.bcast(_shm_short(int(nbytes) * node.Get_size()) if node.Get_rank() == 0 else None)
        if short is not None:
            raise NodeMemoryError(short)
        info = MPI.Info.Create()
        info.Set("alloc_shared_noncontig", "true")  # each segment on its own rank's pages
        try:
            win = MPI.Win.Allocate_shared(max(int(nbytes), 1), 1, info, comm=node)
        finally:
            info.Free()
    finally:
        node.Free()
    win.Lock_all(MPI.MODE_NOCHECK)
    count = int(nbytes)
    segments = [np.frombuffer(win.Shared_query(q)[0], np.uint8, count) for q in range(raw.Get_size())]

    def free() -> None:
        win.Unlock_all()
        win.Free()

    return segments, win.Sync, free


#: where MPI libraries keep the files shared windows are mapped from (MPICH, Open MPI's default)
SHM_DIR = "/dev/shm"


def _shm_short(nbytes: int) -> str | None:
    """Why :data:`SHM_DIR` cannot hold ``nbytes`` more (None: it can, or it cannot be asked)."""
    import os

    try:
        st = os.statvfs(SHM_DIR)
    except OSError:  # not there (another OS, another scheme): nothing to check
        return None
    free = st.f_bavail * st.f_frsize
    if nbytes <= free:
        return None
    return (
        f"node memory: the ranks of this node need {nbytes / 1e6:.1f} MB of {SHM_DIR} for memory "
        f"they share, and it has {free / 1e6:.1f} MB free of {st.f_blocks * st.f_frsize / 1e6:.1f} MB: "
        "give it more room (a container: docker run --shm-size=1g)"
    )


def is_null(comm: Any) -> bool:
    """True for ``MPI.COMM_NULL`` (what ``Split`` gives a rank with color ``UNDEFINED``)."""
    return comm == MPI.COMM_NULL


def world_ranks(comm: MPI.Comm, ranks: Sequence[int]) -> list[int]:
    """The ranks in ``COMM_WORLD`` of ``ranks`` of ``comm``."""
    group, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        return [int(r) for r in MPI.Group.Translate_ranks(group, list(ranks), world)]
    finally:
        group.Free()
        world.Free()
