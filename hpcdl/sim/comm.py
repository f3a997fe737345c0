"""The simulated communicator: docs/design.md's contract with MPI's matching semantics, in virtual time.

Point-to-point messages carry a copy of the send buffer (taken when the send is posted:
the eager protocol; the send request completes when the network model says the sender's
NIC is done). Matching is MPI's: a receive takes the first message that matches its source
and tag (``ANY_SOURCE``/``ANY_TAG`` allowed) in arrival order; messages of one source
arrive in the order sent. Communicators are contexts: the messages of a ``Dup``, a
``Split`` or a sub-communicator never match another's, and every communicator has a second,
hidden context for its collectives (MPI's collective context).

Collectives run as point-to-point rounds through the same network model, with the
algorithms MPICH picks by default (MPICH's ``MPIR_Allreduce_intra_auto``: recursive
doubling up to ``MPIR_CVAR_ALLREDUCE_SHORT_MSG_SIZE`` = 2048 bytes or when the count is
below the largest power of two in the communicator, Rabenseifner's reduce-scatter +
allgather above), reusing hpcdl's own schedules; ``Bcast`` and ``Reduce`` by binomial
tree, ``Allgather`` by ring, ``Gather`` by direct sends to the root, ``Barrier`` by
dissemination. Python objects (``bcast``, ``gather``, ...) travel pickled, their pickle's
length being the message size.
"""

from __future__ import annotations

import operator
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from hpcdl._ext.simcore import CommBase, check_array
from hpcdl._ext.simcore import Request as SimRequest
from hpcdl.sim.engine import Engine
from hpcdl.sim.errors import SimAbort
from hpcdl.sim.ticks import ticks

__all__ = ["SimComm", "SimRequest", "SimStatus", "SimWorld", "ANY_SOURCE", "ANY_TAG"]

# MPI's own constants, so that code passing hpcdl.comm.ANY_SOURCE works unchanged
ANY_SOURCE = -1
ANY_TAG = -1
_SHORT_ALLREDUCE = 2048  # MPICH's MPIR_CVAR_ALLREDUCE_SHORT_MSG_SIZE


class SimStatus:
    """Source, tag and byte count of a matched message (mpi4py's ``Status`` methods)."""

    __slots__ = ("count", "source", "tag")

    def __init__(self) -> None:
        self.source = -1
        self.tag = -1
        self.count = 0

    def Get_source(self) -> int:  # noqa: N802
        return self.source

    def Get_tag(self) -> int:  # noqa: N802
        return self.tag

    def Get_count(self, datatype: Any = None) -> int:  # noqa: N802
        if datatype is None:
            return self.count
        size = datatype.Get_size() if hasattr(datatype, "Get_size") else np.dtype(datatype).itemsize
        return self.count // size

    def _fill(self, source: int, tag: int, count: int) -> None:
        self.source, self.tag, self.count = source, tag, count


class SimComm(CommBase):
    """One virtual rank's view of a simulated communicator (a context and a group of world ranks).

    Point-to-point calls, ``Iprobe`` and the world hooks are :class:`hpcdl._ext.simcore.CommBase`'s
    (in C); this class adds the collectives and the communicator management.

    Args:
        engine: the engine.
        world_rank: the owning virtual rank.
        context: this communicator's context id (hashable; its collectives use
            ``(context, "coll")``).
        group: the world ranks of the members, by rank in this communicator.
    """

    def __init__(self, engine: Engine, world_rank: int, context: Any, group: Sequence[int]) -> None:
        super().__init__(engine, world_rank, context, group)
        self._children = 0  # Dup/Split counter: the same on every member (collective calls)
        self._iallreduces = 0  # nonblocking allreduces started: each gets its own tag
        self._groups: dict[tuple[int, ...], int] = {}
        self._freed = False

    def __repr__(self) -> str:
        return f"<SimComm rank {self._rank} of {self._size} (world rank {self._world_rank})>"

    # -- world hooks (hpcdl.comm) ---------------------------------------------------------------

    def new_status(self) -> SimStatus:
        return SimStatus()

    def subcomm(self, ranks: list[int]) -> SimComm:
        """The communicator of ``ranks`` (only members call it; its context is agreed without messages)."""
        key = tuple(ranks)
        k = self._groups.get(key, 0)
        self._groups[key] = k + 1
        group = [self._group[i] for i in ranks]
        return SimComm(self._engine, self._world_rank, (self._context, "group", key, k), group)

    def host_ranks(self) -> list[int]:
        """Every rank: the virtual ranks all run in this one process, sharing its memory."""
        return list(range(self._size))

    def node_segments(self, nbytes: int) -> tuple[list[Any], Any, Any] | None:
        """Every rank's ``nbytes`` (collective): the virtual ranks share this process's memory,
        so each rank's segment is an array the others read directly (no sync needed). None, as
        under MPI, when the network puts this communicator's ranks on more than one node."""
        per_node = int(getattr(self._engine.network, "ranks_per_node", 0))
        if per_node and len({r // per_node for r in self._group}) > 1:
            return None
        self._children += 1
        key = (self._context, "node", self._children)
        board = self._engine.node_boards.setdefault(key, {})
        board[self._rank] = np.zeros(int(nbytes), dtype=np.uint8)
        self.Barrier()  # every segment is on the board
        segments = [board[r] for r in range(self._size)]
        self.Barrier()  # every rank took them
        self._engine.node_boards.pop(key, None)

        def free() -> None:
            self.Barrier()

        return segments, _no_sync, free

    def memory_beta(self) -> float | None:
        """Seconds per byte a rank of this communicator takes to read or write node memory
        (:meth:`~hpcdl.sim.network.Network.memory_beta`): what the allreduce ``"shm"`` is
        charged and ``auto`` prices it at; None when its ranks span nodes or the network has
        no ``intra.memory_GBps`` (``auto`` then does not choose ``"shm"``)."""
        memory_beta = getattr(self._engine.network, "memory_beta", None)
        return None if memory_beta is None else memory_beta(self._group)

    def memory_pass(self, work: Callable[[], Any], nbytes: int) -> Any:
        """Run ``work()``, a pass that reads plus writes ``nbytes`` of node memory, charged at
        :meth:`memory_beta` per byte instead of measured (measured compute, when None).

        Like a message's transfer time, the charge is the network model's: the compute
        model's speed, stragglers, jitter and ``slow_down`` do not scale it."""
        beta = self.memory_beta()
        if beta is None:
            return work()
        out = self._engine.unmeasured(self._world_rank, work)
        self._engine.charge(self._world_rank, ticks(nbytes * beta))
        return out

    def alpha_beta(self, ranks: int) -> tuple[float, float]:
        """The simulated network's α (s) and β (s/byte) between two of ``ranks`` ranks
        (:meth:`~hpcdl.sim.network.Network.alpha_beta`): what ``auto`` picks from here, in place
        of a calibration (:mod:`hpcdl.comm.collectives.tune`)."""
        return self._engine.network.alpha_beta(ranks)

    # -- collectives on buffers -------------------------------------------------------------------

    def _schedule(self, schedule: Any) -> None:
        """Run one of hpcdl's collective schedules on the collective context, blocking."""
        from hpcdl.comm.collectives.schedule import CollRequest

        CollRequest(schedule).Wait()

    def Barrier(self) -> None:  # noqa: N802
        """Dissemination barrier: ``ceil(log2 n)`` rounds of empty messages."""
        n, me = self._size, self._rank
        empty = np.empty(0, dtype=np.uint8)
        k = 1
        while k < n:
            r = self._crecv(np.empty(0, dtype=np.uint8), (me - k) % n, 1)
            s = self._csend(empty, (me + k) % n, 1)
            self.waitall([r, s])
            k <<= 1

    def Bcast(self, buf: Any, root: int = 0) -> None:  # noqa: N802
        from hpcdl.comm.collectives import tree

        self._schedule(tree.bcast(self._collective_view(), _flat(buf), root, 2))

    def Reduce(self, sendbuf: Any, recvbuf: Any, op: Any = None, root: int = 0) -> None:  # noqa: N802
        from hpcdl.comm.collectives import tree

        src, dst = self._pair(sendbuf, recvbuf, root)
        self._schedule(tree.reduce(self._collective_view(), src, dst, self._op(op), root, 3))

    def _pair(self, sendbuf: Any, recvbuf: Any, root: int | None) -> tuple[Any, Any]:
        mine = root is None or self._rank == root
        dst = _flat(recvbuf) if mine and recvbuf is not None else None
        if sendbuf is self._in_place:
            return dst, dst
        src = _flat(sendbuf)
        if dst is None:
            return src, None
        return src, dst

    def _op(self, op: Any) -> Any:
        return self._sum if op is None else op

    def _allreduce_schedule(self, src: Any, dst: Any, op: Any, tag: int) -> Any:
        from hpcdl.comm.collectives import doubling, rabenseifner

        pof2 = 1 << (self._size.bit_length() - 1)
        short = dst.nbytes <= _SHORT_ALLREDUCE or dst.size < pof2
        algorithm = doubling.allreduce if short else rabenseifner.allreduce
        return algorithm(self._collective_view(), src, dst, op, tag)

    def Allreduce(self, sendbuf: Any, recvbuf: Any, op: Any = None) -> None:  # noqa: N802
        src, dst = self._pair(sendbuf, recvbuf, None)
        self._schedule(self._allreduce_schedule(src, dst, self._op(op), 4))

    def Iallreduce(self, sendbuf: Any, recvbuf: Any, op: Any = None) -> Any:  # noqa: N802
        from hpcdl.comm.collectives.schedule import CollRequest

        src, dst = self._pair(sendbuf, recvbuf, None)
        self._iallreduces += 1  # keep concurrent ones apart
        tag = 1000 + self._iallreduces % 30000
        return CollRequest(self._allreduce_schedule(src, dst, self._op(op), tag), "Iallreduce")

    def Allgather(self, sendbuf: Any, recvbuf: Any) -> None:  # noqa: N802
        from hpcdl.comm.collectives import ring

        dst = _flat(recvbuf)
        mine = None if sendbuf is self._in_place else _flat(sendbuf)
        n = self._size
        if mine is not None and mine.size * n != dst.size:
            raise ValueError(f"Allgather: recvbuf holds {dst.size} elements, not {n} x {mine.size}")
        self._schedule(ring.allgather(self._collective_view(), mine, dst, 5))

    def Gather(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> None:  # noqa: N802
        src = _flat(sendbuf)
        if self._rank != root:
            self._csend(src, root, 6).Wait()
            return
        dst = _flat(recvbuf)
        part = src.size
        reqs = []
        for p in range(self._size):
            if p == root:
                dst[p * part : (p + 1) * part] = src
            else:
                reqs.append(self._crecv(dst[p * part : (p + 1) * part], p, 6))
        self.waitall(reqs)

    # -- collectives on Python objects ------------------------------------------------------------

    def bcast(self, obj: Any, root: int = 0) -> Any:
        n, me = self._size, self._rank
        vrank = (me - root) % n
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if me == root else None
        mask = 1
        while mask < n:  # binomial tree: receive from the parent
            if vrank & mask:
                req = self._crecv(None, (me - mask) % n, 7)
                req.Wait()
                data = req.obj
                break
            mask <<= 1
        mask >>= 1
        sends = []
        while mask > 0:
            if vrank + mask < n:
                sends.append(self._csend(data, (me + mask) % n, 7))
            mask >>= 1
        self.waitall(sends)
        return obj if me == root else pickle.loads(data)

    def gather(self, sendobj: Any, root: int = 0) -> list[Any] | None:
        data = pickle.dumps(sendobj, protocol=pickle.HIGHEST_PROTOCOL)
        if self._rank != root:
            self._csend(data, root, 8).Wait()
            return None
        reqs = {p: self._crecv(None, p, 8) for p in range(self._size) if p != root}
        self.waitall(list(reqs.values()))
        return [sendobj if p == root else pickle.loads(reqs[p].obj) for p in range(self._size)]

    def allgather(self, sendobj: Any) -> list[Any]:
        """Every rank's object: gathered on rank 0, then broadcast (2 (n - 1) messages, not n (n - 1))."""
        every = self.gather(sendobj, root=0)
        return self.bcast(every, root=0)

    def allreduce(self, sendobj: Any, op: Any = None) -> Any:
        """Binomial-tree reduction of the objects to rank 0 (in rank order), then a broadcast."""
        op = self._op(op)
        fn = {id(self._sum): _add, id(self._max): _max, id(self._min): _min}.get(id(op))
        if fn is None:
            raise ValueError(f"allreduce of objects supports SUM, MAX and MIN (got {op!r})")
        n, me = self._size, self._rank
        acc = sendobj
        mask = 1
        while mask < n:
            if me & mask:  # hand the partial result of ranks me .. me + mask - 1 to the left
                self._csend(pickle.dumps(acc, protocol=pickle.HIGHEST_PROTOCOL), me - mask, 10).Wait()
                break
            if me + mask < n:
                req = self._crecv(None, me + mask, 10)
                req.Wait()
                acc = fn(acc, pickle.loads(req.obj))
            mask <<= 1
        return self.bcast(acc if me == 0 else None, root=0)

    # -- communicator management ------------------------------------------------------------------

    def Dup(self) -> SimComm:  # noqa: N802
        self._children += 1
        return SimComm(self._engine, self._world_rank, (self._context, "dup", self._children), self._group)

    def Split(self, color: int = 0, key: int = 0) -> SimComm | None:  # noqa: N802
        self._children += 1
        k = self._children
        every = self.allgather((color, key))
        if color is None or int(color) < 0:  # MPI.UNDEFINED (negative): not in any new communicator
            return None
        members = sorted((kk, r) for r, (c, kk) in enumerate(every) if c == color)
        group = [self._group[r] for _, r in members]
        return SimComm(self._engine, self._world_rank, (self._context, "split", k, color), group)

    def Free(self) -> None:  # noqa: N802
        self._freed = True

    def Abort(self, errorcode: int = 1) -> None:  # noqa: N802
        raise SimAbort(errorcode, self._world_rank)


class SimWorld(SimComm):
    """A virtual rank's world communicator (context 0, every rank)."""

    def __init__(self, engine: Engine, world_rank: int) -> None:
        super().__init__(engine, world_rank, 0, range(engine.size))

    def sleep(self, seconds: float) -> None:
        """:func:`hpcdl.comm.sleep`: the rank's virtual clock moves on by ``seconds``."""
        self._engine.charge(self._world_rank, ticks(seconds))

    def slow_down(self, factor: float) -> bool:
        """:func:`hpcdl.comm.slow_down`: this rank's modelled compute costs ``factor`` times as much."""
        self._engine.compute.slow_down(self._world_rank, factor)
        return True

    def launcher(self) -> str:
        """The command line that started this simulation, up to the command's own arguments
        (``python -m hpcdl.simulate -n 4 ... -m hpcdl.train``); "" when not started by one."""
        return self._engine.launcher

    def sim_attrs(self) -> dict[str, Any]:
        """What a run file records of the simulated world (root attributes)."""
        import json

        eng = self._engine
        return {
            "world": "sim",
            "network": json.dumps(eng.network.describe()),
            "compute": json.dumps(eng.compute.describe()),
            "mpi_library": "hpcdl.sim (virtual ranks)",
        }


def _no_sync() -> None:
    """Memory of one process needs no fence between virtual ranks (they run one at a time)."""


def _flat(buf: Any) -> Any:
    return check_array(buf, "collective").reshape(-1)


def _add(a: Any, b: Any) -> Any:
    return operator.add(a, b)


def _max(a: Any, b: Any) -> Any:
    return np.maximum(a, b) if isinstance(a, np.ndarray) else max(a, b)


def _min(a: Any, b: Any) -> Any:
    return np.minimum(a, b) if isinstance(a, np.ndarray) else min(a, b)
