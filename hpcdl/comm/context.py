"""The current world communicator, its clock, and helpers that work in both worlds."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar, Token
from typing import Any

from hpcdl.comm.contract import Communicator, Request
from hpcdl.comm.contract import Status as StatusLike

__all__ = [
    "Status",
    "due",
    "host_ranks",
    "long_wait",
    "node_memory",
    "notes",
    "reset_world",
    "set_world",
    "sleep",
    "subcomm",
    "use_world",
    "waitall",
    "waitany",
    "world",
    "wtime",
]

# The simulator sets one per virtual rank (inside each greenlet); unset means MPI's world.
_WORLD: ContextVar[Communicator | None] = ContextVar("hpcdl_world", default=None)


def world() -> Communicator:
    """The current world communicator.

    Returns:
        The communicator set by :func:`set_world` in this context (a virtual rank's in the
        simulator), else MPI's ``COMM_WORLD`` (a world of one without mpiexec).
    """
    comm = _WORLD.get()
    if comm is not None:
        return comm
    from hpcdl.comm import mpi

    return mpi.comm_world()


def set_world(comm: Communicator | None) -> Token[Communicator | None]:
    """Make ``comm`` the world of the current context (``None``: back to MPI's).

    Args:
        comm: the communicator :func:`world` returns from now on in this context.

    Returns:
        A token for :func:`reset_world`, which restores the previous world.
    """
    return _WORLD.set(comm)


def reset_world(token: Token[Communicator | None]) -> None:
    """Restore the world that was current before the :func:`set_world` giving ``token``."""
    _WORLD.reset(token)


@contextlib.contextmanager
def use_world(comm: Communicator | None) -> Iterator[Communicator]:
    """Context manager: ``comm`` is the world inside the ``with`` block.

    Yields:
        The world inside the block (``comm``, or MPI's when ``comm`` is ``None``).
    """
    token = set_world(comm)
    try:
        yield world()
    finally:
        reset_world(token)


def wtime() -> float:
    """Seconds on the current world's clock.

    Returns:
        The world's ``wtime()`` when it has one (virtual time in the simulator), else
        ``MPI.Wtime()`` (wall time). Event times in hpcdl come from here, never from ``time``.
    """
    comm = _WORLD.get()
    clock = getattr(comm, "wtime", None) if comm is not None else None
    if clock is not None:
        return float(clock())
    from hpcdl.comm import mpi

    return mpi.wtime()


def sleep(seconds: float) -> None:
    """Spend ``seconds`` on purpose: a real sleep under MPI, the rank's clock moved on in the simulator.

    What a rank does that takes time without computing or communicating (a modelled
    slowdown, a pause): in the simulator a loop waiting on the clock would never end
    under ``--compute none`` or a cost table, since only the models move its clock.

    Args:
        seconds: how long (>= 0).
    """
    if seconds <= 0:
        return
    hook = _world_hook("sleep")
    if hook is not None:
        hook(seconds)
    else:
        time.sleep(seconds)


def slow_down(factor: float) -> bool:
    """Ask the world to make this rank's compute ``factor`` times as slow (``debug.slowdown``).

    A simulated world does it in its compute model (as its stragglers: a cost table's layer
    costs are scaled too) and returns True; under MPI nothing happens and the caller slows
    the rank itself (a sleep after each layer), returning False.
    """
    hook = _world_hook("slow_down")
    return bool(hook(factor)) if hook is not None else False


def Status() -> StatusLike:  # noqa: N802  (named like the mpi4py class it creates)
    """A fresh status object for ``Recv``/``Iprobe``/``Sendrecv``/``Wait``.

    Returns:
        The current world's ``new_status()`` when it has one, else an ``MPI.Status``.
    """
    comm = _WORLD.get()
    factory = getattr(comm, "new_status", None) if comm is not None else None
    if factory is not None:
        return factory()
    from hpcdl.comm import mpi

    return mpi.new_status()


def _world_hook(name: str) -> Any:
    """The current world's optional hook ``name`` (:class:`~hpcdl.comm.contract.WorldHooks`), or None."""
    comm = _WORLD.get()
    return getattr(comm, name, None) if comm is not None else None


def notes() -> dict[str, Any]:
    """Where code notes what this rank is doing (step, phase, buckets) for stall reports.

    Returns:
        The stall watchdog's notes when the world has one (:func:`hpcdl.comm.watch`):
        keys and values are shown as ``key value`` in its reports. Elsewhere a fresh
        dict that nobody reads, so that noting costs a dict assignment either way.
    """
    hook = _world_hook("notes")
    return hook() if hook is not None else {}


def long_wait(reason: str, limit_s: float | None = None) -> contextlib.AbstractContextManager[None]:
    """Waits inside this block are long by design: the stall watchdog lets them last.

    For a parameter server idle between pushes, a worker held back by a staleness bound,
    ranks waiting while rank 0 writes a checkpoint. Such waits still answer a stalled
    rank's questions (as "by design: REASON").

    Args:
        reason: what the wait is, for reports.
        limit_s: seconds after which such a wait stalls all the same (a checkpoint write
            that never ends); None: never.

    Returns:
        A context manager (does nothing in a world without a watchdog).
    """
    hook = _world_hook("long_wait")
    return hook(reason, limit_s) if hook is not None else contextlib.nullcontext()


def due(req: Request, since: float) -> None:
    """Tell the stall watchdog that ``req`` has been due since ``since`` (a :func:`wtime`).

    Waits for it then count from ``since``, however many waits it outlives: a parameter
    server serving other workers' pushes still stalls when one worker's push, due since its
    pull was answered, has not come for ``debug.stall_s``. Does nothing in a world without
    a watchdog, or for a request that is not the world's own.
    """
    hook = _world_hook("due")
    if hook is not None:
        hook(req, since)


def _active(reqs: Sequence[Request | None]) -> list[int]:
    return [i for i, r in enumerate(reqs) if r is not None and r]


def waitall(reqs: Sequence[Request | None]) -> None:
    """Wait until every request of ``reqs`` has completed.

    MPI's requests only: ``MPI.Request.Waitall``. Otherwise (hpcdl's own or simulated
    requests, possibly mixed with MPI's) the active ones are polled with ``Test()`` in
    turn, and the last one is waited on with ``Wait()``.

    Args:
        reqs: requests; ``None`` and inactive (falsy) entries are skipped.
    """
    waiter()(reqs)


def waiter() -> Callable[[Sequence[Request | None]], None]:
    """:func:`waitall` for the current world, resolved once (for a loop that waits many times)."""
    hook = _world_hook("waitall")
    if hook is None:
        return _waitall_mpi

    def wait(reqs: Sequence[Request | None]) -> None:
        if not hook(reqs):  # a simulated world blocks in virtual time when it can
            _waitall_polling(reqs)

    return wait


def _waitall_mpi(reqs: Sequence[Request | None]) -> None:
    from hpcdl.comm import mpi

    if mpi.all_requests(reqs):
        mpi.waitall(reqs)
    else:
        _waitall_polling(reqs)


def _waitall_polling(reqs: Sequence[Request | None]) -> None:
    pending = [reqs[i] for i in _active(reqs)]
    while len(pending) > 1:
        pending = [r for r in pending if not r.Test()]
    if pending:
        pending[0].Wait()


def waitany(reqs: Sequence[Request | None], status: StatusLike | None = None) -> int | None:
    """Wait until one request of ``reqs`` completes and return its index.

    MPI's requests only: ``MPI.Request.Waitany`` (the completed request becomes
    ``REQUEST_NULL``). Otherwise the active ones are polled with ``Test()`` in turn.
    Callers that loop over ``waitany`` should set ``reqs[i] = None`` after each completion:
    that works for every kind of request.

    Args:
        reqs: requests; ``None`` and inactive (falsy) entries are skipped.
        status: filled with the completed operation's status, if given.

    Returns:
        The index of a completed request, or ``None`` when no request is active.
    """
    hook = _world_hook("waitany")
    if hook is not None:
        handled, index = hook(reqs, status)
        if handled:
            return index
    else:
        from hpcdl.comm import mpi

        if mpi.all_requests(reqs):
            return mpi.waitany(reqs, status)
    active = _active(reqs)
    if not active:
        return None
    while True:
        for i in active:
            if reqs[i].Test(status):
                return i


def host_ranks(comm: Communicator) -> list[int]:
    """The ranks of ``comm`` that run on this rank's host and share its memory, in rank order.

    Collective over ``comm``. Under MPI, ``comm.Split_type(COMM_TYPE_SHARED)``'s members; a
    simulated communicator provides ``host_ranks()``: all its ranks, which run in one process.

    Args:
        comm: the communicator.

    Returns:
        Ranks of ``comm``, this rank's among them.
    """
    own = getattr(comm, "host_ranks", None)
    if own is not None:
        return list(own())
    from hpcdl.comm import mpi

    return mpi.host_ranks(comm)


def node_memory(comm: Communicator, nbytes: int) -> Any:
    """``nbytes`` per rank of memory that every rank of ``comm`` reads directly, when all of them
    run on one node (collective): a :class:`~hpcdl.comm.collectives.shm.NodeMemory`, or None.

    Under MPI, a shared window (:func:`hpcdl.comm.mpi.node_segments`); a simulated
    communicator provides ``node_segments(nbytes)`` (its ranks share one process). Free it
    with its ``free()`` (collective).
    """
    from hpcdl.comm.collectives.shm import NodeMemory

    own = getattr(comm, "node_segments", None)
    if own is not None:
        found = own(nbytes)
    else:
        from hpcdl.comm import mpi

        found = mpi.node_segments(comm, nbytes)
    if found is None:
        return None
    segments, sync, free = found
    return NodeMemory(segments, comm.Get_rank(), sync, free)


def subcomm(comm: Communicator, ranks: Sequence[int]) -> Communicator:
    """The communicator of ``ranks`` of ``comm``; only the members call it.

    The new ranks follow the order of ``ranks``. In MPI this is ``comm.Create_group`` over
    ``comm.Get_group().Incl(ranks)``, collective over the members only; a simulated
    communicator provides ``subcomm(ranks)`` instead. Free the result when done.

    Args:
        comm: the parent communicator.
        ranks: distinct ranks of ``comm``, including the caller's.

    Returns:
        The sub-communicator.

    Raises:
        ValueError: ``ranks`` is empty, has duplicates or out-of-range ranks, or the caller
            is not a member.
    """
    ranks = [int(r) for r in ranks]
    size, rank = comm.Get_size(), comm.Get_rank()
    if not ranks or len(set(ranks)) != len(ranks):
        raise ValueError(f"subcomm needs distinct ranks (got {ranks})")
    bad = [r for r in ranks if not 0 <= r < size]
    if bad:
        raise ValueError(f"subcomm ranks {bad} are outside [0, {size})")
    if rank not in ranks:
        raise ValueError(f"subcomm is called by the members only: rank {rank} is not in {ranks}")
    own = getattr(comm, "subcomm", None)
    if own is not None:
        return own(ranks)
    from hpcdl.comm import mpi

    return mpi.subcomm(comm, ranks)
