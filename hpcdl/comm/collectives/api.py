"""The :class:`Collectives` object: hpcdl's own collectives on a private copy of a communicator."""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType
from typing import Any

import numpy as np

from hpcdl.backend import get_array_module
from hpcdl.comm.collectives import doubling, library, rabenseifner, ring, shm, tree, widening
from hpcdl.comm.collectives.auto import AutoTable, load_table
from hpcdl.comm.collectives.buffers import (
    Alloc,
    Reduction,
    Workspace,
    check_pair,
    chunk_counts,
    flat,
    is_in_place,
    scale_in_place,
)
from hpcdl.comm.collectives.schedule import CollRequest, Schedule
from hpcdl.comm.context import node_memory, waitall
from hpcdl.comm.contract import Communicator
from hpcdl.errors import ConfigError

__all__ = ["ALGORITHMS", "NODE_ALGORITHMS", "Collectives", "CollectivesFreedError", "available_algorithms"]

#: allreduce algorithms by name: ``schedule(comm, src, dst, op, tag)`` (flat arrays, ``src is
#: dst`` for in place). ``"mpi"`` is the MPI library's own ``Iallreduce`` (``Allreduce`` when
#: blocking).
ALGORITHMS: dict[str, Callable[[Communicator, Any, Any, Any, int], Schedule]] = {
    "ring": ring.allreduce,
    "doubling": doubling.allreduce,
    "rabenseifner": rabenseifner.allreduce,
    "mpi": library.allreduce,
}

#: allreduce algorithms on node memory only (:meth:`Collectives.node_empty`): the buffers of
#: every rank are read where they lie (:mod:`~hpcdl.comm.collectives.shm`). ``"auto"`` picks
#: one only for such a buffer (elsewhere, MPI's own in its place).
NODE_ALGORITHMS = ("shm",)


def available_algorithms(comm: Communicator) -> tuple[str, ...]:
    """The allreduce algorithms worth timing (or, simulated, pricing) on ``comm`` (collective):
    :data:`ALGORITHMS`, and :data:`NODE_ALGORITHMS` when every rank shares this rank's node
    (a simulated world: and its network prices memory, ``comm.memory_beta()``)."""
    from hpcdl.comm.context import host_ranks

    if comm.Get_size() < 2:
        return tuple(ALGORITHMS)
    if getattr(comm, "alpha_beta", None) is not None:
        memory_beta = getattr(comm, "memory_beta", None)
        one_node = memory_beta is not None and memory_beta() is not None
    else:
        one_node = len(host_ranks(comm)) == comm.Get_size()
    return (*ALGORITHMS, *NODE_ALGORITHMS) if one_node else tuple(ALGORITHMS)


#: Tags cycle through [0, TAG_SPAN): MPI guarantees tags up to 32767. Operations in flight
#: at once on one Collectives object must number fewer than this.
TAG_SPAN = 1 << 15


class CollectivesFreedError(RuntimeError):
    """A :class:`Collectives` object was used after :meth:`Collectives.free`."""


class Collectives:
    """hpcdl's collectives over a private duplicate of ``comm``, blocking and nonblocking.

    The duplicate keeps their messages apart from the caller's point-to-point traffic on
    ``comm``; each operation started gets the next tag of a sequence, which keeps
    operations in flight at the same time (one per gradient bucket, say) apart from each
    other. As in MPI, **every rank must start the collectives of one object in the same
    order** (blocking or not, whatever the algorithm); they may complete in any order.

    Methods are named after MPI's (buffers, upper case) and take NumPy or CuPy arrays,
    C-contiguous, of any shape (treated as flat). Each ``I``-prefixed method returns a
    :class:`CollRequest`, to be completed with ``Wait()``, ``Test()`` or
    :func:`hpcdl.comm.waitall`/:func:`~hpcdl.comm.waitany` beside other requests; its
    buffers must not be touched until then. The blocking method is the same schedule,
    waited on. Reductions take ``hpcdl.comm.SUM``, ``MAX`` or ``MIN``.

    The object owns a communicator: call :meth:`free` (collective) when done, or use it
    as a context manager.

    Args:
        comm: the communicator whose ranks take part (duplicated once, collectively).
        algorithm: the default allreduce algorithm, a key of :data:`ALGORITHMS`, or
            ``"auto"``: by message size and rank count, from ``auto``.
        auto: the table ``"auto"`` chooses from (:class:`~hpcdl.comm.collectives.auto.AutoTable`);
            ``None``: the packaged default (:func:`~hpcdl.comm.collectives.auto.load_table`).
            Every rank must pass the same table.

    Raises:
        ConfigError: ``algorithm`` is unknown, or the packaged table cannot be read.
    """

    def __init__(self, comm: Communicator, algorithm: str = "ring", auto: AutoTable | None = None) -> None:
        self.algorithm = _check_algorithm(algorithm)
        if auto is not None and not isinstance(auto, AutoTable):
            raise TypeError(
                f"auto must be an AutoTable or None (got {type(auto).__name__}): for a byte threshold "
                "pass AutoTable.threshold(nbytes)"
            )
        self._auto = auto if auto is not None else load_table(None)
        self._comm: Communicator | None = comm.Dup()
        self._auto_choose = self._auto.chooser(self._comm.Get_size())
        self._auto_ordinary = self._auto.chooser(self._comm.Get_size(), node=False)
        self._seq = 0
        self._inflight: list[CollRequest] = []
        self._workspace = Workspace()  # scratch buffers reused across operations
        self._node: list[shm.NodeMemory] = []  # node memory handed out by node_empty
        import hpcdl.comm as hc  # MPI's constants, resolved once: small messages feel each microsecond

        self._in_place = hc.IN_PLACE
        self._sum = hc.SUM
        self._ops = ((hc.SUM, "add"), (hc.MAX, "maximum"), (hc.MIN, "minimum"))

    @property
    def auto(self) -> AutoTable:
        """The table ``"auto"`` chooses from; every rank sets the same, between operations (a
        resume puts back the table its run started with)."""
        return self._auto

    @auto.setter
    def auto(self, table: AutoTable) -> None:
        if not isinstance(table, AutoTable):
            raise TypeError(f"auto must be an AutoTable (got {type(table).__name__})")
        if self._comm is None:
            raise CollectivesFreedError("these collectives were freed: their auto table is of no use")
        size = self._comm.Get_size()
        self._auto, self._auto_choose = table, table.chooser(size)
        self._auto_ordinary = table.chooser(size, node=False)

    # -- lifetime ---------------------------------------------------------------------------

    @property
    def comm(self) -> Communicator:
        """The private duplicate communicator the collectives run on."""
        if self._comm is None:
            raise CollectivesFreedError(
                "this Collectives object was freed: create a new Collectives(comm) to run more collectives"
            )
        return self._comm

    def free(self) -> None:
        """Free the duplicate communicator (collective; a second call does nothing).

        Raises:
            RuntimeError: nonblocking collectives started here have not completed.
        """
        if self._comm is None:
            return
        pending = [r for r in self._inflight if not r.finished]
        if pending:
            raise RuntimeError(
                f"Collectives.free() with {len(pending)} nonblocking collectives still in flight "
                f"({pending[0]!r}, ...): complete them with Wait() or hpcdl.comm.waitall first"
            )
        for memory in self._node:
            memory.free()
        self._node = []
        comm, self._comm = self._comm, None
        comm.Free()

    def __enter__(self) -> Collectives:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.free()

    def __repr__(self) -> str:
        if self._comm is None:
            return "<Collectives (freed)>"
        return f"<Collectives size={self._comm.Get_size()} algorithm={self.algorithm!r} started={self._seq}>"

    # -- node memory ------------------------------------------------------------------------------

    def node_empty(self, n: int, dtype: Any) -> Any:
        """A new 1-D NumPy array of ``n`` elements of ``dtype`` in memory every rank of this
        node reads directly, for the algorithm ``"shm"`` (collective: every rank asks for the
        same, in the same order; freed with the object).

        Operations of this object still in flight are completed first (the window calls
        block); those of other objects, and the caller's own messages, must not wait on
        this rank meanwhile.

        Returns:
            The array (uninitialised), or None on every rank when the ranks are not all on
            one node. It is valid until :meth:`free`, which unmaps it: copy out what must
            outlive this object.
        """
        comm = self.comm
        # MPI's window calls block, and this object's schedules advance only in Test/Wait: finish
        # them first (every rank does so at the same point of its sequence), or a rank blocked
        # here would never take its part in a round another rank waits for
        waitall([r for r in self._inflight if not r.finished])
        nbytes = int(n) * np.dtype(dtype).itemsize
        memory = node_memory(comm, nbytes)
        if memory is None:
            return None
        memory.ident = len(self._node)
        self._node.append(memory)
        return memory.segments[memory.rank][:nbytes].view(dtype)

    def _in_node(self, buf: Any) -> tuple[shm.NodeMemory, int] | None:
        """The node memory ``buf`` lies in and where (None: ordinary memory)."""
        for memory in self._node:
            at = memory.offset(buf)
            if at is not None:
                return memory, at
        return None

    def _start(self, name: str, make: Callable[[Communicator, int, Alloc], Schedule]) -> CollRequest:
        comm = self.comm
        tag = self._seq % TAG_SPAN
        self._seq += 1
        lease = self._workspace.lease()
        req = CollRequest(make(comm, tag, lease), name, on_done=lease.release)
        if not req.finished:
            if len(self._inflight) >= 64:  # forget the completed ones now and then
                self._inflight = [r for r in self._inflight if not r.finished]
            self._inflight.append(req)
        return req

    # -- allreduce ------------------------------------------------------------------------------

    def Iallreduce(  # noqa: N802  (MPI's name)
        self,
        sendbuf: Any,
        recvbuf: Any,
        op: Any = None,
        algorithm: str | None = None,
        *,
        narrow: str | None = None,
        scale: float | None = None,
    ) -> CollRequest:
        """Start an allreduce of every rank's ``sendbuf`` into every rank's ``recvbuf``.

        Args:
            sendbuf: this rank's contribution; ``recvbuf`` itself or ``hpcdl.comm.IN_PLACE``
                to reduce ``recvbuf`` in place.
            recvbuf: the result, same size and dtype as ``sendbuf``.
            op: ``hpcdl.comm.SUM`` (default), ``MAX`` or ``MIN``.
            algorithm: a key of :data:`ALGORITHMS`; default: this object's ``algorithm``.
            narrow: ``"float16"`` or ``"bfloat16"``: the buffers hold 2-byte floats
                (float16, or bfloat16 bits in uint16) to be summed in float32 and rounded
                once (:mod:`~hpcdl.comm.collectives.widening`, whatever ``algorithm``).
            scale: multiply the result by it, in ``recvbuf``'s dtype: the bits of
                ``recvbuf *= dtype(scale)`` after, at less cost (``ring`` and ``shm`` scale the
                chunk each rank completes, before it is passed on; the others scale at the end).

        Returns:
            The request of the operation.

        Raises:
            ConfigError: ``algorithm`` is unknown.
            ValueError: the buffers do not match, ``op`` is not supported, or ``narrow``
                is unknown, its buffers are not of its dtype, or ``op`` is not SUM.
        """
        name = _check_algorithm(algorithm or self.algorithm)
        self.comm  # noqa: B018  (raises CollectivesFreedError after free())
        src, dst = check_pair(sendbuf, recvbuf, "allreduce")
        _check_scale(dst, scale)
        if narrow is not None:
            if scale is not None:
                raise ValueError(f"narrow={narrow!r} rounds the sum once: scale it after (got scale={scale})")
            return self._start_widening(src, dst, op, narrow)
        red = self._reduction(op, dst)
        if name == "auto":
            name = self._auto_choose(dst.nbytes)
        if name in NODE_ALGORITHMS:
            node = self._node_place(dst, explicit=(algorithm or self.algorithm) != "auto")
            if node is not None:
                self._check_host(src)
                memory, at = node
                return self._start(
                    f"allreduce[{name}]",
                    lambda comm, tag, alloc: shm.allreduce(
                        comm, src, dst, red, tag, alloc=alloc, memory=memory, offset=at, scale=scale
                    ),
                )
            name = self._auto_ordinary(dst.nbytes)  # auto on ordinary memory: the best message one
        schedule = ALGORITHMS[name]
        if scale is not None and name == "ring":
            return self._start(
                f"allreduce[{name}]",
                lambda comm, tag, alloc: ring.allreduce(comm, src, dst, red, tag, alloc=alloc, scale=scale),
            )
        if scale is not None:
            return self._start(
                f"allreduce[{name}]",
                lambda comm, tag, alloc: _scaled(schedule(comm, src, dst, red, tag, alloc=alloc), dst, scale),
            )
        return self._start(
            f"allreduce[{name}]", lambda comm, tag, alloc: schedule(comm, src, dst, red, tag, alloc=alloc)
        )

    def _node_place(self, dst: Any, explicit: bool) -> tuple[shm.NodeMemory, int] | None:
        """Where ``dst`` lies in node memory; None for ``auto`` on ordinary memory.

        Raises:
            ValueError: ``"shm"`` was asked for by name on ordinary memory.
        """
        node = self._in_node(dst)
        if node is None and explicit:
            raise ValueError(
                "allreduce algorithm 'shm' reads every rank's buffer where it lies: the receive buffer "
                "must come from Collectives.node_empty (or choose another algorithm)"
            )
        return node

    @staticmethod
    def _check_host(src: Any) -> None:
        """Raise unless ``src`` is a NumPy array (node memory is host memory).

        Raises:
            ValueError: ``src`` is on a GPU.
        """
        if not isinstance(src, np.ndarray):
            raise ValueError(
                f"allreduce 'shm' sums host memory: sendbuf must be a NumPy array (got {type(src).__name__})"
            )

    def Allreduce(  # noqa: N802  (MPI's name)
        self,
        sendbuf: Any,
        recvbuf: Any,
        op: Any = None,
        algorithm: str | None = None,
        *,
        narrow: str | None = None,
        scale: float | None = None,
    ) -> None:
        """Allreduce, blocking: :meth:`Iallreduce` waited on (``"mpi"``: ``comm.Allreduce``)."""
        name = _check_algorithm(algorithm or self.algorithm)
        if narrow is None and name in ("auto", "mpi"):
            src, dst = check_pair(sendbuf, recvbuf, "allreduce")
            if name == "auto":
                name = self._auto_choose(dst.nbytes)
                if name in NODE_ALGORITHMS and self._in_node(dst) is None:
                    name = self._auto_ordinary(dst.nbytes)
            if name == "mpi":
                _check_scale(dst, scale)
                red = self._reduction(op, dst)
                self._seq += 1
                self.comm.Allreduce(self._in_place if src is dst else src, dst, op=red.op)
                if scale is not None:
                    scale_in_place(dst, scale)
                return
        self.Iallreduce(sendbuf, recvbuf, op, name, narrow=narrow, scale=scale).Wait()

    def _start_widening(self, src: Any, dst: Any, op: Any, wire: str) -> CollRequest:
        want = widening.WIRE_FORMATS.get(wire)
        if want is None:
            raise ValueError(f"narrow must be one of {tuple(widening.WIRE_FORMATS)} (got {wire!r})")
        if dst.dtype != want:
            raise ValueError(f"narrow={wire!r} needs buffers of {want} (got {dst.dtype})")
        if op is not None and op is not self._sum:
            raise ValueError(f"narrow={wire!r} sums (op=hpcdl.comm.SUM); got {op!r}")
        name = f"allreduce[widening {wire}]"
        return self._start(
            name, lambda c, tag, alloc: widening.allreduce(c, src, dst, tag, wire, alloc=alloc)
        )

    def _reduction(self, op: Any, buf: Any) -> Reduction:
        """``op`` (None: SUM) with its ufunc for ``buf``'s array module.

        Raises:
            ValueError: ``op`` is not SUM, MAX or MIN.
        """
        if op is None:
            op = self._sum
        for mpi, ufunc in self._ops:
            if op is mpi:
                return Reduction(op, getattr(get_array_module(buf), ufunc))
        raise ValueError(f"collectives reduce with hpcdl.comm.SUM, MAX or MIN (got {op!r})")

    # -- reduce-scatter and allgather (ring) -----------------------------------------------------

    def Ireduce_scatter(self, sendbuf: Any, recvbuf: Any, op: Any = None) -> CollRequest:  # noqa: N802
        """Start a ring reduce-scatter: rank r receives chunk r of the reduction of ``sendbuf``.

        Chunk sizes are :func:`chunk_counts` ``(sendbuf.size, size)`` (the first
        ``sendbuf.size % size`` chunks one longer; MPI's ``Reduce_scatter`` with these
        ``recvcounts``).

        Args:
            sendbuf: this rank's full vector; ``hpcdl.comm.IN_PLACE`` to take it from
                ``recvbuf``, which then receives the result in its first elements (MPI's
                in-place reduce-scatter).
            recvbuf: this rank's chunk (or the full vector, in place).
            op: ``hpcdl.comm.SUM`` (default), ``MAX`` or ``MIN``.

        Returns:
            The request of the operation.

        Raises:
            ValueError: ``recvbuf`` is not the size of this rank's chunk, the dtypes differ,
                or ``op`` is not supported.
        """
        comm = self.comm
        dst = flat(recvbuf, "reduce_scatter recvbuf")
        src = dst if is_in_place(sendbuf, recvbuf) else flat(sendbuf, "reduce_scatter sendbuf")
        count = chunk_counts(src.size, comm.Get_size())[comm.Get_rank()]
        if src is dst:
            dst = dst[:count]
        elif dst.size != count or dst.dtype != src.dtype:
            raise ValueError(
                f"reduce_scatter: recvbuf ({dst.size} x {dst.dtype}) must hold rank "
                f"{comm.Get_rank()}'s chunk of sendbuf: {count} x {src.dtype} "
                f"({src.size} elements over {comm.Get_size()} ranks)"
            )
        red = self._reduction(op, src)
        return self._start(
            "reduce_scatter", lambda c, tag, alloc: ring.reduce_scatter(c, src, dst, red, tag, alloc=alloc)
        )

    def Reduce_scatter(self, sendbuf: Any, recvbuf: Any, op: Any = None) -> None:  # noqa: N802
        """Reduce-scatter, blocking: :meth:`Ireduce_scatter` waited on."""
        self.Ireduce_scatter(sendbuf, recvbuf, op).Wait()

    def Iallgather(self, sendbuf: Any, recvbuf: Any) -> CollRequest:  # noqa: N802
        """Start a ring allgather: every rank's ``sendbuf``, in rank order, into every ``recvbuf``.

        Rank r's part is chunk r of ``recvbuf``, of :func:`chunk_counts` ``(recvbuf.size,
        size)[r]`` elements (equal parts, as MPI's ``Allgather``, when ``size`` divides it).

        Args:
            sendbuf: this rank's part; ``hpcdl.comm.IN_PLACE`` when it is already in place
                in ``recvbuf``.
            recvbuf: the concatenation of every rank's part.

        Returns:
            The request of the operation.

        Raises:
            ValueError: ``sendbuf`` is not the size of this rank's part, or the dtypes differ.
        """
        comm = self.comm
        dst = flat(recvbuf, "allgather recvbuf")
        mine = None
        if not is_in_place(sendbuf, recvbuf):
            mine = flat(sendbuf, "allgather sendbuf")
            count = chunk_counts(dst.size, comm.Get_size())[comm.Get_rank()]
            if mine.size != count or mine.dtype != dst.dtype:
                raise ValueError(
                    f"allgather: sendbuf ({mine.size} x {mine.dtype}) must be rank "
                    f"{comm.Get_rank()}'s part of recvbuf: {count} x {dst.dtype} "
                    f"({dst.size} elements over {comm.Get_size()} ranks)"
                )
        return self._start("allgather", lambda c, tag, alloc: ring.allgather(c, mine, dst, tag))

    def Allgather(self, sendbuf: Any, recvbuf: Any) -> None:  # noqa: N802
        """Allgather, blocking: :meth:`Iallgather` waited on."""
        self.Iallgather(sendbuf, recvbuf).Wait()

    # -- reduce and broadcast (binomial tree) ----------------------------------------------------

    def Ireduce(self, sendbuf: Any, recvbuf: Any | None, op: Any = None, root: int = 0) -> CollRequest:  # noqa: N802
        """Start a binomial-tree reduce of every rank's ``sendbuf`` into ``root``'s ``recvbuf``.

        Args:
            sendbuf: this rank's contribution; on the root, ``recvbuf`` itself or
                ``hpcdl.comm.IN_PLACE`` to reduce in place.
            recvbuf: the result on the root, same size and dtype as ``sendbuf``; ignored
                (``None`` allowed) elsewhere.
            op: ``hpcdl.comm.SUM`` (default), ``MAX`` or ``MIN``.
            root: the rank receiving the result.

        Returns:
            The request of the operation.

        Raises:
            ValueError: ``root`` is out of range, the buffers do not match, or ``op`` is
                not supported.
        """
        comm = self.comm
        root = _check_root(root, comm)
        if comm.Get_rank() == root:
            src, dst = check_pair(sendbuf, recvbuf, "reduce")
        else:
            src, dst = flat(sendbuf, "reduce sendbuf"), None
        red = self._reduction(op, src)
        return self._start(
            f"reduce[root={root}]",
            lambda c, tag, alloc: tree.reduce(c, src, dst, red, root, tag, alloc=alloc),
        )

    def Reduce(self, sendbuf: Any, recvbuf: Any | None, op: Any = None, root: int = 0) -> None:  # noqa: N802
        """Reduce, blocking: :meth:`Ireduce` waited on."""
        self.Ireduce(sendbuf, recvbuf, op, root).Wait()

    def Ibcast(self, buf: Any, root: int = 0) -> CollRequest:  # noqa: N802
        """Start a binomial-tree broadcast of ``root``'s ``buf`` into every rank's ``buf``.

        Raises:
            ValueError: ``root`` is out of range.
        """
        comm = self.comm
        root = _check_root(root, comm)
        view = flat(buf, "bcast buf")
        return self._start(f"bcast[root={root}]", lambda c, tag, alloc: tree.bcast(c, view, root, tag))

    def Bcast(self, buf: Any, root: int = 0) -> None:  # noqa: N802
        """Broadcast, blocking: :meth:`Ibcast` waited on."""
        self.Ibcast(buf, root).Wait()


def _check_scale(dst: Any, scale: float | None) -> None:
    """Raise unless ``scale`` is None or ``dst`` holds floats.

    Raises:
        ValueError: a scale for integers (it would truncate, unlike a multiplication after).
    """
    if scale is not None and dst.dtype.kind != "f":
        raise ValueError(f"allreduce: scale= multiplies floats, not {dst.dtype} (got scale={scale})")


def _scaled(schedule: Schedule, dst: Any, scale: float) -> Schedule:
    """``schedule``, then ``dst *= scale``."""
    yield from schedule
    scale_in_place(dst, scale)


def _check_algorithm(name: str) -> str:
    if name not in ALGORITHMS and name not in NODE_ALGORITHMS and name != "auto":
        raise ConfigError(
            f"unknown allreduce algorithm {name!r}: choose one of "
            f"{', '.join((*ALGORITHMS, *NODE_ALGORITHMS))} or auto"
        )
    return name


def _check_root(root: int, comm: Communicator) -> int:
    size = comm.Get_size()
    if not 0 <= root < size:
        raise ValueError(f"root must be a rank in [0, {size}) (got {root})")
    return int(root)
