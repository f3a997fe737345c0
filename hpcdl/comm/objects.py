"""Python objects between ranks beyond the contract's collectives, and errors every rank raises.

* :func:`on_root` — rank 0 decides (reads a file, writes one), every rank learns the result
  or raises the same error: what a command does before and after a collective that only
  rank 0 can prepare, so that no rank is left waiting in it.
* :func:`send_object` / :func:`recv_object` / :func:`scatter_objects` — pickles over the
  contract's buffer ``Send``/``Recv`` (a length, then the bytes), for data one rank sends to
  some ranks only (each rank's part of a checkpoint).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from hpcdl.comm.contract import Communicator
from hpcdl.errors import HpcdlError

__all__ = ["on_root", "recv_object", "scatter_objects", "send_object"]

T = TypeVar("T")

#: the tag of the pickles :func:`scatter_objects` sends when the caller gives none
SCATTER_TAG = 31_000


def _raise(kind: type[BaseException], message: str) -> None:
    try:
        again = kind(message)
    except TypeError:  # a class that takes other arguments: the message is what counts
        again = HpcdlError(message)
    raise again from None


def on_root(comm: Communicator, action: Callable[[], T], *, root: int = 0) -> T:
    """Run ``action`` on ``root`` only; every rank gets its result, or raises its user error.

    Args:
        comm: the ranks that learn the outcome (collective over them).
        action: what ``root`` does (read a file, decide, write).
        root: the rank that acts.

    Returns:
        ``action()``'s result on every rank (pickled from ``root``).

    Raises:
        HpcdlError: the error ``action`` raised on ``root`` (its class), on every rank.
    """
    outcome: tuple[bool, Any] | None = None
    if comm.Get_rank() == root:
        try:
            outcome = (True, action())
        except HpcdlError as err:
            outcome = (False, (type(err), str(err)))
    ok, value = comm.bcast(outcome, root=root)
    if not ok:
        _raise(*value)
    return value


def send_object(comm: Communicator, obj: Any, dest: int, tag: int) -> None:
    """Send ``obj`` pickled to ``dest`` (its length, then its bytes); :func:`recv_object` takes it."""
    data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
    comm.Send(np.array([data.size], dtype=np.int64), dest, tag)
    comm.Send(data, dest, tag)


def recv_object(comm: Communicator, source: int, tag: int) -> Any:
    """The object :func:`send_object` sent from ``source`` with ``tag``."""
    n = np.zeros(1, dtype=np.int64)
    comm.Recv(n, source, tag)
    data = np.empty(int(n[0]), dtype=np.uint8)
    comm.Recv(data, source, tag)
    return pickle.loads(data.tobytes())


def scatter_objects(
    comm: Communicator, objs: Sequence[Any] | None, *, root: int = 0, tag: int = SCATTER_TAG
) -> Any:
    """Rank ``r`` gets ``objs[r]`` from ``root`` (collective): each rank holds its own part only.

    Unlike a broadcast of the whole list, no rank but ``root`` ever holds the others' parts:
    a checkpoint of 1,024 ranks is not copied 1,024 times.

    Args:
        comm: the ranks.
        objs: on ``root``, one object per rank; ignored elsewhere.
        root: the rank that has them.
        tag: the tag of the messages (keep it apart from other traffic in flight).

    Returns:
        This rank's object.
    """
    if comm.Get_rank() != root:
        return recv_object(comm, root, tag)
    assert objs is not None and len(objs) == comm.Get_size()
    for r, obj in enumerate(objs):
        if r != root:
            send_object(comm, obj, r, tag)
    return objs[root]
