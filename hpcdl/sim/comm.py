"""The simulated communicator: DESIGN.md's contract with MPI's matching semantics, in virtual time.

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
from collections.abc import Sequence
from typing import Any

import numpy as np

from hpcdl.sim.engine import Engine, SimAbort
from hpcdl.sim.ticks import seconds

__all__ = ["SimComm", "SimRequest", "SimStatus", "SimWorld", "ANY_SOURCE", "ANY_TAG"]

# MPI's own constants, so that code passing hpcdl.comm.ANY_SOURCE works unchanged
ANY_SOURCE = -1
ANY_TAG = -1
_SHORT_ALLREDUCE = 2048  # MPICH's MPIR_CVAR_ALLREDUCE_SHORT_MSG_SIZE


def _constants() -> tuple[Any, Any, Any, Any, Any, Any]:
    import hpcdl.comm as hc

    return hc.ANY_SOURCE, hc.ANY_TAG, hc.IN_PLACE, hc.SUM, hc.MAX, hc.MIN


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


class _Message:
    """A message in flight or unexpected: its matching key, source rank in the communicator, tag, payload."""

    __slots__ = ("key", "nbytes", "payload", "source", "tag")

    def __init__(self, key: Any, source: int, tag: int, payload: Any, nbytes: int) -> None:
        self.key = key
        self.source = source
        self.tag = tag
        self.payload = payload
        self.nbytes = nbytes


class SimRequest:
    """A simulated nonblocking send or receive; ``t_done`` is its completion tick (None: not yet)."""

    __slots__ = (
        "_active",
        "buf",
        "comm",
        "error",
        "key",
        "obj",
        "source",
        "status",
        "t_done",
        "tag",
        "waiter",
    )

    def __init__(
        self, comm: SimComm, key: Any = None, buf: Any = None, source: int = 0, tag: int = 0
    ) -> None:
        self.comm = comm
        self.key = key
        self.buf = buf
        self.source = source
        self.tag = tag
        self.t_done: int | None = None
        self.waiter: int | None = None
        self.status: tuple[int, int, int] | None = None
        self.obj: Any = None
        self.error: Exception | None = None  # raised in the receiving rank when it completes the request
        self._active = True

    # -- matching (receives) ------------------------------------------------------------------

    def matches(self, msg: _Message) -> bool:
        return (self.source < 0 or self.source == msg.source) and (self.tag < 0 or self.tag == msg.tag)

    def complete(self, msg: _Message, t: int) -> None:
        """Copy ``msg`` into the receive buffer (or keep its object) and complete at tick ``t``."""
        if self.buf is None:
            self.obj = msg.payload
        else:
            payload = msg.payload
            dst = self.buf.reshape(-1).view(np.uint8)
            if payload.nbytes > dst.nbytes:  # MPI_ERR_TRUNCATE, reported to the receiver
                self.error = ValueError(
                    f"message truncated: {payload.nbytes} bytes from rank {msg.source} (tag {msg.tag}) "
                    f"into a buffer of {dst.nbytes} bytes"
                )
            else:
                dst[: payload.nbytes] = payload
        self.status = (msg.source, msg.tag, msg.nbytes)
        self.t_done = t

    # -- mpi4py's request methods ---------------------------------------------------------------

    def Test(self, status: Any = None) -> bool:  # noqa: N802
        """True when complete at this rank's current virtual time (a failed test costs ``poll_cost``)."""
        comm = self.comm
        if not self._active:  # completed and reported before: MPI's inactive request
            self._empty(status)
            return True
        eng, r = comm._engine, comm._world_rank
        eng.account(r)
        eng.sync(r)
        if self.t_done is not None and self.t_done <= eng.now[r]:
            eng.progressed(r)
            self._finish(status)
            eng.leave(r)
            return True
        eng.poll_failed(r, (_describe_all, "Test", (self,)), self.t_done)
        eng.leave(r)
        return False

    def Wait(self, status: Any = None) -> None:  # noqa: N802
        """Block (in virtual time) until complete."""
        comm = self.comm
        if not self._active:
            self._empty(status)
            return
        comm._engine.wait(comm._world_rank, (self,), 1, (_describe_all, "Wait", (self,)), True)
        self._finish(status)

    def _empty(self, status: Any) -> None:
        """MPI's empty status (an inactive request's): any source, any tag, no bytes."""
        if status is not None:
            status._fill(self.comm._any_source, self.comm._any_tag, 0)

    def _finish(self, status: Any) -> None:
        self._active = False
        if status is not None and self.status is not None:
            status._fill(*self.status)
        if self.error is not None:
            raise self.error

    def __bool__(self) -> bool:
        return self._active

    def describe(self) -> str:
        if self.key is None:
            return "a send"
        src = "ANY_SOURCE" if self.source < 0 else str(self.source)
        tag = "ANY_TAG" if self.tag < 0 else str(self.tag)
        return f"a receive from rank {src}, tag {tag}, on {self.comm._name(self.key[0])}"


class SimComm:
    """One virtual rank's view of a simulated communicator (a context and a group of world ranks).

    Args:
        engine: the engine.
        world_rank: the owning virtual rank.
        context: this communicator's context id (hashable; its collectives use
            ``(context, "coll")``).
        group: the world ranks of the members, by rank in this communicator.
    """

    def __init__(self, engine: Engine, world_rank: int, context: Any, group: Sequence[int]) -> None:
        self._engine = engine
        self._world_rank = world_rank
        self._context = context
        self._group = tuple(group)
        self._rank = self._group.index(world_rank)
        self._size = len(self._group)
        self._children = 0  # Dup/Split counter: the same on every member (collective calls)
        self._iallreduces = 0  # nonblocking allreduces started: each gets its own tag
        self._groups: dict[tuple[int, ...], int] = {}
        self._freed = False
        (self._any_source, self._any_tag, self._in_place, self._sum, self._max, self._min) = _constants()

    # -- identity -----------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    def Get_rank(self) -> int:  # noqa: N802
        return self._rank

    def Get_size(self) -> int:  # noqa: N802
        return self._size

    def __repr__(self) -> str:
        return f"<SimComm rank {self._rank} of {self._size} (world rank {self._world_rank})>"

    def _name(self, context: Any) -> str:
        return "the world" if context == 0 else f"communicator {context!r}"

    # -- world hooks (hpcdl.comm) ---------------------------------------------------------------

    def wtime(self) -> float:
        """This rank's virtual clock, in seconds (its compute so far charged first)."""
        eng = self._engine
        eng.account(self._world_rank)
        return seconds(eng.now[self._world_rank])

    def new_status(self) -> SimStatus:
        return SimStatus()

    def waitall(self, reqs: Sequence[Any]) -> bool:
        """Block until every request completes, if all are simulated ones; False otherwise."""
        active = []
        for q in reqs:
            if q is not None and q:
                if type(q) is not SimRequest:
                    return False
                active.append(q)
        if active:
            if len(active) > 1:
                active = list({id(q): q for q in active}.values())  # a request listed twice completes once
            what = (_describe_all, "waitall", active)
            self._engine.wait(self._world_rank, active, len(active), what, True)
            for q in active:
                q._finish(None)
        return True

    def subcomm(self, ranks: list[int]) -> SimComm:
        """The communicator of ``ranks`` (only members call it; its context is agreed without messages)."""
        key = tuple(ranks)
        k = self._groups.get(key, 0)
        self._groups[key] = k + 1
        group = [self._group[i] for i in ranks]
        return SimComm(self._engine, self._world_rank, (self._context, "group", key, k), group)

    # -- point-to-point -------------------------------------------------------------------------

    def _check_peer(self, peer: int, what: str) -> int:
        if not 0 <= peer < self._size:
            raise ValueError(f"{what} {peer} out of range for a communicator of {self._size} ranks")
        return peer

    def _isend(self, buf: Any, dest: int, tag: int, context: Any) -> SimRequest:
        """Post a send of ``buf`` (an array, copied; or ``bytes``, kept) from the rank's code."""
        eng, r = self._engine, self._world_rank
        eng.enter(r)
        if type(buf) is bytes:
            payload, nbytes = buf, len(buf)
        else:  # the copy is the engine's work, not the rank's compute
            payload = buf.reshape(-1).view(np.uint8).copy() if type(buf) is np.ndarray else _payload(buf)
            nbytes = payload.nbytes
        req = self._post_send(payload, nbytes, dest, tag, context)
        eng.leave(r)
        return req

    def _post_send(self, payload: Any, nbytes: int, dest: int, tag: int, context: Any) -> SimRequest:
        """Post a send now (the rank has entered the engine)."""
        if not 0 <= dest < self._size:
            self._check_peer(dest, "dest")
        dst = self._group[dest]
        req = SimRequest(self)
        req.t_done = self._engine.post_send(
            self._world_rank, _Message((context, dst), self._rank, tag, payload, nbytes), dst
        )
        return req

    def _irecv(self, buf: Any, source: int, tag: int, context: Any) -> SimRequest:
        eng, r = self._engine, self._world_rank
        eng.enter(r)
        req = self._post_recv(buf, source, tag, context)
        eng.leave(r)
        return req

    def _post_recv(self, buf: Any, source: int, tag: int, context: Any) -> SimRequest:
        """Post a receive now (the rank has entered the engine): match an unexpected message, or wait."""
        eng, r = self._engine, self._world_rank
        if source is self._any_source or source == ANY_SOURCE:
            source = -1
        elif not 0 <= source < self._size:
            self._check_peer(source, "source")
        if tag is self._any_tag or tag == ANY_TAG:
            tag = -1
        req = SimRequest(self, (context, r), buf, source, tag)
        queue = eng.unexpected.get(req.key)
        if queue:
            for i, msg in enumerate(queue):
                if (source < 0 or source == msg.source) and (tag < 0 or tag == msg.tag):
                    del queue[i]
                    req.complete(msg, eng.now[r])
                    return req
        posted = eng.posted.get(req.key)
        if posted is None:
            eng.posted[req.key] = [req]
        else:
            posted.append(req)
        return req

    def Isend(self, buf: Any, dest: int, tag: int = 0) -> SimRequest:  # noqa: N802
        return self._isend(buf, dest, tag, self._context)

    def Irecv(self, buf: Any, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> SimRequest:  # noqa: N802
        if type(buf) is not np.ndarray or not buf.flags.c_contiguous:
            buf = _array(buf, "Irecv")
        return self._irecv(buf, source, tag, self._context)

    def Send(self, buf: Any, dest: int, tag: int = 0) -> None:  # noqa: N802
        self.Isend(buf, dest, tag).Wait()

    def Recv(self, buf: Any, source: int = ANY_SOURCE, tag: int = ANY_TAG, status: Any = None) -> None:  # noqa: N802
        self.Irecv(buf, source, tag).Wait(status)

    def Sendrecv(  # noqa: N802, PLR0917
        self,
        sendbuf: Any,
        dest: int,
        sendtag: int = 0,
        recvbuf: Any = None,
        source: int = ANY_SOURCE,
        recvtag: int = ANY_TAG,
        status: Any = None,
    ) -> None:
        if type(recvbuf) is not np.ndarray or not recvbuf.flags.c_contiguous:
            recvbuf = _array(recvbuf, "Sendrecv recvbuf")
        eng, r = self._engine, self._world_rank
        eng.enter(r)
        payload = (  # copied inside the engine: not the rank's compute
            sendbuf.reshape(-1).view(np.uint8).copy() if type(sendbuf) is np.ndarray else _payload(sendbuf)
        )
        rreq = self._post_recv(recvbuf, source, recvtag, self._context)
        sreq = self._post_send(payload, payload.nbytes, dest, sendtag, self._context)
        reqs = (rreq, sreq)
        eng.wait(r, reqs, 2, (_describe_all, "Sendrecv", reqs))
        sreq._active = False
        rreq._finish(status)

    def Iprobe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG, status: Any = None) -> bool:  # noqa: N802
        eng, r = self._engine, self._world_rank
        eng.account(r)
        eng.sync(r)
        src = -1 if source is self._any_source or source == ANY_SOURCE else source
        tg = -1 if tag is self._any_tag or tag == ANY_TAG else tag
        msg = eng.probe_unexpected(
            (self._context, r), lambda m: (src < 0 or m.source == src) and (tg < 0 or m.tag == tg)
        )
        if msg is None:
            eng.poll_failed(r, (_describe_probe, source, tag, self._name(self._context)))
            eng.leave(r)
            return False
        eng.progressed(r)
        eng.leave(r)
        if status is not None:
            status._fill(msg.source, msg.tag, msg.nbytes)
        return True

    # -- collectives: helpers ---------------------------------------------------------------------

    @property
    def _coll(self) -> Any:
        return (self._context, "coll")

    def _csend(self, obj: Any, dest: int, tag: int = 0) -> SimRequest:
        """Send ``obj`` (an array: copied; bytes: as is) on the collective context."""
        return self._isend(obj, dest, tag, self._coll)

    def _crecv(self, buf: Any, source: int, tag: int = 0) -> SimRequest:
        return self._irecv(buf, source, tag, self._coll)

    def _schedule(self, schedule: Any) -> None:
        """Run one of hpcdl's collective schedules on the collective context, blocking."""
        from hpcdl.comm.collectives.schedule import CollRequest

        CollRequest(schedule).Wait()

    # the schedules call Isend/Irecv/Get_rank/Get_size on the communicator they are given
    def _collective_view(self) -> _CollView:
        return _CollView(self)

    # -- collectives on buffers -------------------------------------------------------------------

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

    def waitany(self, reqs: Sequence[Any], status: Any = None) -> tuple[bool, int | None]:
        """Block until one request completes, if all are simulated ones.

        Returns:
            ``(True, index)`` (``index`` None when no request is active), or ``(False, None)``
            when some request is not a simulated one (the caller polls instead).
        """
        active = [i for i, q in enumerate(reqs) if q is not None and q]
        if not all(type(reqs[i]) is SimRequest for i in active):
            return False, None
        if not active:
            return True, None
        eng, r = self._engine, self._world_rank
        qs = list({id(reqs[i]): reqs[i] for i in active}.values())
        eng.wait(r, qs, 1, (_describe_all, "waitany", qs), True)
        now = eng.now[r]
        _, index = min(
            (reqs[i].t_done, i) for i in active if reqs[i].t_done is not None and reqs[i].t_done <= now
        )
        reqs[index]._finish(status)
        return True, index


class SimWorld(SimComm):
    """A virtual rank's world communicator (context 0, every rank)."""

    def __init__(self, engine: Engine, world_rank: int) -> None:
        super().__init__(engine, world_rank, 0, range(engine.size))

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


class _CollView:
    """The collective context of a :class:`SimComm`, with the point-to-point methods schedules call."""

    __slots__ = ("_comm",)

    def __init__(self, comm: SimComm) -> None:
        self._comm = comm

    def Get_rank(self) -> int:  # noqa: N802
        return self._comm._rank

    def Get_size(self) -> int:  # noqa: N802
        return self._comm._size

    def Isend(self, buf: Any, dest: int, tag: int = 0) -> SimRequest:  # noqa: N802
        return self._comm._csend(buf, dest, tag)

    def Irecv(self, buf: Any, source: int, tag: int = 0) -> SimRequest:  # noqa: N802
        return self._comm._crecv(buf, source, tag)



def _describe_probe(source: int, tag: int, where: str) -> str:
    return f"polling Iprobe(source={source}, tag={tag}) on {where}"


def _describe_all(kind: str, reqs: Sequence[SimRequest]) -> str:
    pending = [q for q in reqs if q.t_done is None]
    first = pending[0].describe() if pending else "completed requests"
    return f"{kind} of {len(reqs)} requests, {len(pending)} pending, e.g. {first}"


def _array(buf: Any, what: str) -> Any:
    if not isinstance(buf, np.ndarray):
        if hasattr(buf, "get") and hasattr(buf, "__cuda_array_interface__"):
            raise TypeError(f"{what}: the simulator takes NumPy arrays (copy CuPy arrays to the host)")
        raise TypeError(f"{what}: the simulator takes NumPy arrays as buffers (got {type(buf).__name__})")
    if not buf.flags.c_contiguous:
        raise ValueError(f"{what}: buffers must be C-contiguous")
    return buf


def _payload(buf: Any) -> np.ndarray:
    """A private copy of the send buffer's bytes."""
    a = _array(buf, "Isend")
    return a.reshape(-1).view(np.uint8).copy()


def _flat(buf: Any) -> Any:
    return _array(buf, "collective").reshape(-1)


def _add(a: Any, b: Any) -> Any:
    return operator.add(a, b)


def _max(a: Any, b: Any) -> Any:
    return np.maximum(a, b) if isinstance(a, np.ndarray) else max(a, b)


def _min(a: Any, b: Any) -> Any:
    return np.minimum(a, b) if isinstance(a, np.ndarray) else min(a, b)
