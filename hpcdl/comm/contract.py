"""The communicator contract: the subset of mpi4py's ``Comm`` that hpcdl uses, as Protocols.

Names and argument order are mpi4py's, so an ``MPI.Intracomm`` satisfies
:class:`Communicator` as is, and code written against it reads like mpi4py code. Upper-case
methods take buffers (NumPy arrays; CuPy arrays after their stream is synchronised), lower-case
ones take small Python objects. Defaults shown as ``...`` are mpi4py's (``ANY_SOURCE``,
``ANY_TAG``, ``SUM``, root ``0``, tag ``0``).

A simulated world implements the same methods, and may add the optional hooks of
:class:`WorldHooks` that :mod:`hpcdl.comm` looks for (its clock, its ``Status`` objects,
its sub-communicators).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__ = ["Communicator", "Request", "Status", "WorldHooks"]

#: A buffer: a NumPy/CuPy array, or an mpi4py buffer spec such as ``[array, MPI.FLOAT]``
#: (the simulated world accepts arrays only).
Buffer = Any
#: A reduction operation: ``hpcdl.comm.SUM``, ``MAX`` or ``MIN``.
Op = Any


@runtime_checkable
class Status(Protocol):
    """What a receive or probe learnt about the matched message."""

    def Get_source(self) -> int:
        """Rank of the sender."""
        ...

    def Get_tag(self) -> int:
        """Tag of the message."""
        ...

    def Get_count(self, datatype: Any = ...) -> int:
        """Size of the message; without ``datatype``, in bytes (mpi4py's default ``BYTE``)."""
        ...


@runtime_checkable
class Request(Protocol):
    """A pending nonblocking operation (point-to-point or collective).

    Completed with ``Wait()``, polled with ``Test()``; :func:`hpcdl.comm.waitall` and
    :func:`hpcdl.comm.waitany` take lists of them. ``Test()`` must make progress (hpcdl's
    own requests advance their steps in it, simulated ones let the engine run). Like
    mpi4py's, a request that is inactive (already completed and released) is falsy, and
    ``waitany``/``waitall`` skip it.
    """

    def Wait(self, status: Any = None) -> Any:
        """Block until the operation completes; fill ``status`` if given."""
        ...

    def Test(self, status: Any = None) -> bool:
        """True when the operation has completed; fill ``status`` if given."""
        ...


@runtime_checkable
class Communicator(Protocol):
    """The subset of ``mpi4py.MPI.Intracomm`` that hpcdl uses."""

    @property
    def rank(self) -> int:
        """This process's rank (``Get_rank()``)."""
        ...

    @property
    def size(self) -> int:
        """Number of ranks (``Get_size()``)."""
        ...

    def Get_rank(self) -> int:
        """This process's rank in ``[0, size)``."""
        ...

    def Get_size(self) -> int:
        """Number of ranks."""
        ...

    # -- point-to-point, buffers ----------------------------------------------------------

    def Send(self, buf: Buffer, dest: int, tag: int = ...) -> None:
        """Blocking send of ``buf`` to ``dest``."""
        ...

    def Recv(self, buf: Buffer, source: int = ..., tag: int = ..., status: Status | None = None) -> None:
        """Blocking receive into ``buf``."""
        ...

    def Isend(self, buf: Buffer, dest: int, tag: int = ...) -> Request:
        """Nonblocking send; ``buf`` must not change until the request completes."""
        ...

    def Irecv(self, buf: Buffer, source: int = ..., tag: int = ...) -> Request:
        """Nonblocking receive into ``buf``."""
        ...

    def Sendrecv(  # noqa: PLR0917  (mpi4py's signature)
        self,
        sendbuf: Buffer,
        dest: int,
        sendtag: int = ...,
        recvbuf: Buffer | None = None,
        source: int = ...,
        recvtag: int = ...,
        status: Status | None = None,
    ) -> None:
        """Send to ``dest`` and receive from ``source`` at once (deadlock-free exchange)."""
        ...

    def Iprobe(self, source: int = ..., tag: int = ..., status: Status | None = None) -> bool:
        """True when a matching message can be received now; fill ``status`` then."""
        ...

    # -- collectives, buffers -------------------------------------------------------------

    def Barrier(self) -> None:
        """Wait until every rank has entered the barrier."""
        ...

    def Bcast(self, buf: Buffer, root: int = ...) -> None:
        """Copy ``root``'s ``buf`` into every rank's ``buf``."""
        ...

    def Reduce(self, sendbuf: Buffer, recvbuf: Buffer | None, op: Op = ..., root: int = ...) -> None:
        """Reduce elementwise into ``root``'s ``recvbuf`` (``None`` elsewhere is allowed)."""
        ...

    def Allreduce(self, sendbuf: Buffer, recvbuf: Buffer, op: Op = ...) -> None:
        """Reduce elementwise into every rank's ``recvbuf`` (``sendbuf`` may be ``IN_PLACE``)."""
        ...

    def Iallreduce(self, sendbuf: Buffer, recvbuf: Buffer, op: Op = ...) -> Request:
        """Nonblocking :meth:`Allreduce`."""
        ...

    def Allgather(self, sendbuf: Buffer, recvbuf: Buffer) -> None:
        """Concatenate every rank's ``sendbuf`` in rank order into every ``recvbuf``."""
        ...

    def Gather(self, sendbuf: Buffer, recvbuf: Buffer | None, root: int = ...) -> None:
        """Concatenate every rank's ``sendbuf`` in rank order into ``root``'s ``recvbuf``."""
        ...

    # -- collectives, Python objects ------------------------------------------------------

    def bcast(self, obj: Any, root: int = ...) -> Any:
        """``root``'s object, on every rank."""
        ...

    def gather(self, sendobj: Any, root: int = ...) -> list[Any] | None:
        """The list of every rank's object on ``root``, ``None`` elsewhere."""
        ...

    def allgather(self, sendobj: Any) -> list[Any]:
        """The list of every rank's object, on every rank."""
        ...

    def allreduce(self, sendobj: Any, op: Op = ...) -> Any:
        """The reduction of every rank's object, on every rank."""
        ...

    # -- communicator management ----------------------------------------------------------

    def Split(self, color: int = ..., key: int = ...) -> Communicator:
        """Sub-communicators of the ranks sharing ``color``, ordered by ``(key, rank)``."""
        ...

    def Dup(self) -> Communicator:
        """A communicator of the same ranks whose messages never match this one's."""
        ...

    def Free(self) -> None:
        """Release the communicator (collective over its ranks)."""
        ...

    def Abort(self, errorcode: int = ...) -> Any:
        """End every process of the job with ``errorcode``; does not return."""
        ...


class WorldHooks(Protocol):
    """Optional methods a non-MPI world communicator provides to :mod:`hpcdl.comm`.

    All are looked up with ``getattr``; a world without them falls back to MPI's.

    * ``wtime()``: the rank's clock, used by :func:`hpcdl.comm.wtime` (virtual time);
    * ``new_status()``: a fresh status object, used by :func:`hpcdl.comm.Status`;
    * ``subcomm(ranks)``: the sub-communicator of ``ranks``, used by
      :func:`hpcdl.comm.subcomm` (on any communicator, not only the world);
    * ``waitall(reqs) -> bool`` and ``waitany(reqs, status) -> (bool, index)``: block on
      the world's own requests in :func:`hpcdl.comm.waitall`/:func:`~hpcdl.comm.waitany`
      (False: some request is not the world's own; the caller polls them all);
    * ``sleep(seconds)``: spend time on purpose, used by :func:`hpcdl.comm.sleep` (a
      simulated world moves the rank's virtual clock);
    * ``slow_down(factor) -> bool``: make the rank's compute ``factor`` times as slow, used
      by :func:`hpcdl.comm.slow_down` for ``debug.slowdown`` (a simulated world scales
      its compute model's costs for the rank);
    * ``notes() -> dict``, ``long_wait(reason)`` and ``due(req, since)``: the stall
      watchdog's notes of what the rank is doing, its mark for waits that are long by
      design, and a request's time since it is due, used by :func:`hpcdl.comm.notes`,
      :func:`hpcdl.comm.long_wait` and :func:`hpcdl.comm.due` (MPI's world under
      :func:`hpcdl.comm.watch`, whose requests' ``Wait()`` is watched too);
    * ``run_rounds(schedule, pending)``: wait for each round of a collective schedule and
      advance it until it ends, used by ``CollRequest.Wait``
      (:mod:`hpcdl.comm.collectives.schedule`) instead of its own loop;
    * ``host_ranks()``: the ranks that share this rank's memory, used by
      :func:`hpcdl.comm.host_ranks` (a simulated world: all of them, one process);
    * ``node_segments(nbytes) -> (segments, sync, free)``: every rank's segment of memory
      they all read directly (collective), used by :func:`hpcdl.comm.node_memory` (a
      simulated world: arrays of its one process);
    * ``alpha_beta(ranks) -> (alpha, beta)``: a modelled network's latency (s) and inverse
      bandwidth (s/byte), used by ``auto`` in place of timing the algorithms
      (:func:`hpcdl.comm.collectives.tune.tuned_table`; the simulator's communicators).
    * ``memory_beta() -> float | None`` and ``memory_pass(work, nbytes)``: a modelled node's
      seconds per byte of memory read or written (None: not modelled here), by which ``auto``
      prices the allreduce ``"shm"``, and the call that runs its pass charged at that rate
      instead of measured (:mod:`hpcdl.comm.collectives.shm`; the simulator's communicators).
    """

    def wtime(self) -> float:
        """Seconds on this rank's clock."""
        ...

    def new_status(self) -> Status:
        """A fresh status to pass to ``Recv``/``Iprobe``/``Wait``."""
        ...

    def subcomm(self, ranks: list[int]) -> Communicator:
        """The communicator of ``ranks`` (in that order); only members call it."""
        ...

    def run_rounds(self, schedule: Any, pending: Any) -> None:
        """Wait for ``pending``, advance ``schedule`` to its next round's requests, until it ends."""
        ...
