"""What the benchmarks share: a user error on one rank raised on every rank."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from hpcdl.comm import Communicator
from hpcdl.errors import HpcdlError

__all__ = ["agree"]

T = TypeVar("T")


def agree(comm: Communicator, action: Callable[[], T]) -> T:
    """Run ``action`` on every rank; if it raised a user error anywhere, raise it everywhere (collective).

    Rank 0's error wins (it is the rank that reads and writes files); otherwise the
    lowest rank's. Other exceptions are not caught: they end the job as failures.

    Returns:
        What ``action`` returned on this rank.

    Raises:
        HpcdlError: the error (of the same class) raised on some rank.
    """
    error: HpcdlError | None = None
    result: T | None = None
    try:
        result = action()
    except HpcdlError as err:
        error = err
    errors = comm.allgather(None if error is None else (type(error), str(error)))
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        kind, message = first
        try:
            again = kind(message)
        except TypeError:  # a class that takes other arguments: the message is what counts
            again = HpcdlError(message)
        raise again from None
    return result  # type: ignore[return-value]
