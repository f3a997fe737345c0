"""An MPI communicator whose every wait goes through the stall watchdog, and :func:`watch`.

:class:`WatchedComm` satisfies the communicator contract over an ``mpi4py``
intracommunicator: nonblocking calls are MPI's own (point-to-point ones are remembered for
the watchdog's reports), and the requests they return wait through the watchdog in
``Wait()`` (:class:`~hpcdl.comm.mpi.WatchedRequest`), so that mpi4py's ``req.Wait()`` is
watched as :func:`hpcdl.comm.waitall` is; every blocking call is its nonblocking form waited on by the
:class:`~hpcdl.comm.watchdog.Watchdog` — ``Send`` is ``Isend``, ``Allreduce`` is
``Iallreduce``, ``Barrier`` is ``Ibarrier`` — and the object collectives (``bcast``,
``gather``, ``allgather``, ``allreduce``) are pickles moved by nonblocking buffer
collectives (a length, then the bytes), so they are watched too. ``Split`` and ``Dup``,
which MPI cannot start without blocking, are preceded by a watched barrier: once every
rank has arrived, they complete at once. As world hooks (:class:`~hpcdl.comm.WorldHooks`)
it provides ``waitall``/``waitany`` (so :func:`hpcdl.comm.waitall` and hpcdl's collectives
are watched), ``notes`` and ``long_wait``.
"""

from __future__ import annotations

import contextlib
import functools
import pickle
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from hpcdl.comm.context import _WORLD, reset_world, set_world, world
from hpcdl.comm.contract import Communicator
from hpcdl.comm.watchdog import Watchdog

__all__ = ["WatchedComm", "watch"]


class WatchedComm:
    """An ``mpi4py`` intracommunicator whose blocking calls wait through ``watchdog``.

    Args:
        comm: the MPI communicator.
        watchdog: the world's watchdog (shared by every communicator derived from it).
        name: how reports name this communicator (``world``, ``world.dup1``, ...).
    """

    def __init__(self, comm: Any, watchdog: Watchdog, name: str = "world") -> None:
        from hpcdl.comm import mpi

        self._comm = comm
        self._dog = watchdog
        self.name = name
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self._children = 0
        self._sum, self._any_source, self._any_tag = mpi.SUM, mpi.ANY_SOURCE, mpi.ANY_TAG
        self._request = mpi.WatchedRequest
        self._wait_one = watchdog.wait_one
        # local calls are MPI's own, bound once
        self.Iprobe = comm.Iprobe
        self.Abort = comm.Abort

    def __getattr__(self, name: str) -> Any:
        """Anything else (``Get_name``, ``Ibcast``, ...) is the MPI communicator's; the requests
        of its nonblocking calls (``Ibarrier``, ``Ibcast``, ...) are watched."""
        if name.startswith("_"):
            raise AttributeError(name)
        attr = getattr(self._comm, name)
        if name[:1] == "I" and callable(attr):  # a call whose result is a request: watched
            return functools.partial(self._watched_call, attr, name)
        return attr

    def _watched_call(self, call: Any, name: str, *args: Any, **kwargs: Any) -> Any:
        from hpcdl.comm import mpi

        result = call(*args, **kwargs)
        if result is not None and mpi.all_requests([result]):
            return self._request(result, self._wait_one, (name, None, None, self.name))
        return result

    def __repr__(self) -> str:
        return f"<WatchedComm {self.name} rank {self.rank} of {self.size}, stall_s={self._dog.stall_s:g}>"

    def Get_rank(self) -> int:  # noqa: N802  (MPI's names)
        return self.rank

    def Get_size(self) -> int:  # noqa: N802
        return self.size

    @property
    def mpi(self) -> Any:
        """The MPI communicator underneath."""
        return self._comm

    # -- nonblocking: MPI's requests, whose Wait() is watched --------------------------------
    def Isend(self, buf: Any, dest: int, tag: int = 0) -> Any:  # noqa: N802
        what = ("Isend to", dest, tag, self.name)
        return self._request(self._comm.Isend(buf, dest, tag), self._wait_one, what)

    def Irecv(self, buf: Any, source: int | None = None, tag: int | None = None) -> Any:  # noqa: N802
        source = self._any_source if source is None else source
        tag = self._any_tag if tag is None else tag
        what = ("Irecv from", source, tag, self.name)
        return self._request(self._comm.Irecv(buf, source, tag), self._wait_one, what)

    def Iallreduce(self, sendbuf: Any, recvbuf: Any, op: Any = None) -> Any:  # noqa: N802
        req = self._comm.Iallreduce(sendbuf, recvbuf, self._sum if op is None else op)
        return self._request(req, self._wait_one, ("Iallreduce", None, None, self.name))

    def Send(self, buf: Any, dest: int, tag: int = 0) -> None:  # noqa: N802
        self._dog.wait([self._comm.Isend(buf, dest, tag)], ("Send to", dest, tag, self.name))

    def Recv(  # noqa: N802
        self, buf: Any, source: int | None = None, tag: int | None = None, status: Any = None
    ) -> None:
        source = self._any_source if source is None else source
        tag = self._any_tag if tag is None else tag
        self._dog.wait([self._comm.Irecv(buf, source, tag)], ("Recv from", source, tag, self.name), status)

    def Sendrecv(  # noqa: N802, PLR0917  (mpi4py's signature)
        self,
        sendbuf: Any,
        dest: int,
        sendtag: int = 0,
        recvbuf: Any = None,
        source: int | None = None,
        recvtag: int | None = None,
        status: Any = None,
    ) -> None:
        source = self._any_source if source is None else source
        recvtag = self._any_tag if recvtag is None else recvtag
        recv = self._comm.Irecv(recvbuf, source, recvtag)
        send = self._comm.Isend(sendbuf, dest, sendtag)
        self._dog.wait([recv, send], ("Sendrecv from", source, recvtag, self.name), status)

    # -- collectives, buffers ----------------------------------------------------------------
    def Barrier(self) -> None:  # noqa: N802
        self._dog.wait([self._comm.Ibarrier()], ("Barrier", None, None, self.name))

    def Bcast(self, buf: Any, root: int = 0) -> None:  # noqa: N802
        self._dog.wait([self._comm.Ibcast(buf, root)], ("Bcast from", root, None, self.name))

    def Reduce(self, sendbuf: Any, recvbuf: Any, op: Any = None, root: int = 0) -> None:  # noqa: N802
        req = self._comm.Ireduce(sendbuf, recvbuf, self._sum if op is None else op, root)
        self._dog.wait([req], ("Reduce to", root, None, self.name))

    def Allreduce(self, sendbuf: Any, recvbuf: Any, op: Any = None) -> None:  # noqa: N802
        req = self._comm.Iallreduce(sendbuf, recvbuf, self._sum if op is None else op)
        self._dog.wait([req], ("Allreduce", None, None, self.name))

    def Allgather(self, sendbuf: Any, recvbuf: Any) -> None:  # noqa: N802
        self._dog.wait([self._comm.Iallgather(sendbuf, recvbuf)], ("Allgather", None, None, self.name))

    def Gather(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> None:  # noqa: N802
        req = self._comm.Igather(sendbuf, recvbuf, root)
        self._dog.wait([req], ("Gather to", root, None, self.name))

    # -- collectives, Python objects: a pickle's length, then its bytes ----------------------
    def bcast(self, obj: Any, root: int = 0) -> Any:
        """``root``'s object on every rank (a copy everywhere, the root included, as mpi4py)."""
        what = ("bcast from", root, None, self.name)
        n = np.zeros(1, dtype=np.int64)
        data = pickle.dumps(obj, pickle.HIGHEST_PROTOCOL) if self.rank == root else b""
        n[0] = len(data)
        self._dog.wait([self._comm.Ibcast(n, root)], what)
        buf = np.frombuffer(data, dtype=np.uint8).copy() if self.rank == root else np.empty(n[0], np.uint8)
        self._dog.wait([self._comm.Ibcast(buf, root)], what)
        return pickle.loads(buf.tobytes())

    def gather(self, sendobj: Any, root: int = 0) -> list[Any] | None:
        """The list of every rank's object on ``root``, None elsewhere."""
        what = ("gather to", root, None, self.name)
        data = np.frombuffer(pickle.dumps(sendobj, pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
        mine = np.array([data.size], dtype=np.int64)
        counts = np.zeros(self.size, dtype=np.int64) if self.rank == root else None
        self._dog.wait([self._comm.Igather(mine, counts, root)], what)
        if self.rank != root:
            self._dog.wait([self._comm.Igatherv(data, None, root)], what)
            return None
        assert counts is not None
        offsets = np.concatenate(([0], np.cumsum(counts)[:-1]))
        out = np.empty(int(counts.sum()), dtype=np.uint8)
        self._dog.wait([self._comm.Igatherv(data, [out, (counts.tolist(), offsets.tolist())], root)], what)
        return [pickle.loads(out[o : o + c].tobytes()) for o, c in zip(offsets, counts)]

    def allgather(self, sendobj: Any) -> list[Any]:
        """The list of every rank's object, on every rank."""
        what = ("allgather", None, None, self.name)
        data = np.frombuffer(pickle.dumps(sendobj, pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
        counts = np.zeros(self.size, dtype=np.int64)
        self._dog.wait([self._comm.Iallgather(np.array([data.size], dtype=np.int64), counts)], what)
        offsets = np.concatenate(([0], np.cumsum(counts)[:-1]))
        out = np.empty(int(counts.sum()), dtype=np.uint8)
        self._dog.wait([self._comm.Iallgatherv(data, [out, (counts.tolist(), offsets.tolist())])], what)
        return [pickle.loads(out[o : o + c].tobytes()) for o, c in zip(offsets, counts)]

    def allreduce(self, sendobj: Any, op: Any = None) -> Any:
        """The reduction of every rank's object in rank order (``op``: SUM, MAX, MIN)."""
        return functools.reduce(self._sum if op is None else op, self.allgather(sendobj))

    # -- communicators -----------------------------------------------------------------------
    def _derived(self, comm: Any, kind: str) -> WatchedComm:
        self._children += 1
        return WatchedComm(comm, self._dog, f"{self.name}.{kind}{self._children}")

    def Dup(self) -> WatchedComm:  # noqa: N802
        """A duplicate, watched too (a watched barrier first: MPI's ``Dup`` blocks)."""
        self.Barrier()
        return self._derived(self._comm.Dup(), "dup")

    def Split(self, color: int = 0, key: int = 0) -> Any:  # noqa: N802
        """``Split``, watched too (a watched barrier first: MPI's ``Split`` blocks).

        A rank that gives ``UNDEFINED`` gets MPI's ``COMM_NULL``, as with MPI's own.
        """
        from hpcdl.comm import mpi

        self.Barrier()
        new = self._comm.Split(color, key)
        return new if mpi.is_null(new) else self._derived(new, "split")

    def subcomm(self, ranks: Sequence[int]) -> WatchedComm:
        """The sub-communicator of ``ranks`` (:func:`hpcdl.comm.subcomm`), watched too.

        Only the members call it: a watched barrier among them comes first (MPI's
        ``Create_group`` blocks), on the watchdog's own communicator.
        """
        from hpcdl.comm import mpi

        members = mpi.world_ranks(self._comm, ranks)
        self._dog.members_barrier(members, ("subcomm of ranks", None, None, f"{self.name} {list(ranks)}"))
        return self._derived(mpi.subcomm(self._comm, ranks), "sub")

    def host_ranks(self) -> list[int]:
        """:func:`hpcdl.comm.host_ranks`, watched (a watched barrier first: MPI's ``Split_type`` blocks)."""
        from hpcdl.comm import mpi

        self.Barrier()
        return mpi.host_ranks(self._comm)

    def node_segments(self, nbytes: int) -> Any:
        """:func:`hpcdl.comm.mpi.node_segments`, watched (a watched barrier before MPI's blocking
        ``Split_type``, ``Win.Allocate_shared`` and, in ``free``, ``Win.Free``)."""
        from hpcdl.comm import mpi

        self.Barrier()
        found = mpi.node_segments(self._comm, nbytes)
        if found is None:
            return None
        segments, sync, free = found

        def watched_free() -> None:
            self.Barrier()
            free()

        return segments, sync, watched_free

    def Free(self) -> None:  # noqa: N802
        self._comm.Free()

    # -- world hooks ---------------------------------------------------------------------------
    def waitall(self, reqs: Sequence[Any]) -> bool:
        """:func:`hpcdl.comm.waitall` in this world: a watched wait."""
        self._dog.wait(reqs, "waitall")
        return True

    def waitany(self, reqs: Sequence[Any], status: Any = None) -> tuple[bool, int | None]:
        """:func:`hpcdl.comm.waitany` in this world: a watched wait."""
        return True, self._dog.wait_any(reqs, "waitany", status)

    def due(self, req: Any, since: float) -> None:
        """:func:`hpcdl.comm.due` in this world: waits for ``req`` count from ``since``."""
        if isinstance(req, self._request):
            req.due = since

    def notes(self) -> dict[str, Any]:
        """The watchdog's notes (step, phase, ...): what reports say the rank was doing."""
        return self._dog.context

    def long_wait(self, reason: str, limit_s: float | None = None) -> contextlib.AbstractContextManager[None]:
        """Waits inside are long by design: they stall only after ``limit_s`` (they still answer)."""
        return self._dog.long_wait(reason, limit_s)


@contextlib.contextmanager
def watch(stall_s: float, *, grace_s: float | None = None) -> Iterator[Communicator]:
    """Inside, MPI's world is a :class:`WatchedComm`: every wait stalls after ``stall_s``.

    Collective over MPI's world on entry and on a normal exit. Does nothing (yields the
    current world) when ``stall_s`` is 0, in a world of one, or when the world is already
    set (a simulated rank: the simulator has its own deadlock detection; or an enclosing
    ``watch``).

    Args:
        stall_s: seconds one wait may last (``debug.stall_s``); 0: off.
        grace_s: seconds a stalled rank waits for the others' answers (default: the
            :class:`~hpcdl.comm.watchdog.Watchdog`'s).

    Yields:
        The world communicator to use.
    """
    if stall_s <= 0 or _WORLD.get() is not None:
        yield world()
        return
    from hpcdl.comm import mpi

    comm = mpi.comm_world()
    if comm.Get_size() == 1:
        yield comm
        return
    dog = Watchdog(comm, stall_s, grace_s=grace_s)
    watched = WatchedComm(comm, dog)
    token = set_world(watched)
    try:
        yield watched
    except BaseException:
        reset_world(token)  # an error: no collective to free the watchdog (ranks may be gone)
        raise
    reset_world(token)
    dog.free()
