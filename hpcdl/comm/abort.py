"""One failing rank ends the whole job: print its traceback with its rank, then Abort."""

from __future__ import annotations

import sys
import time
import traceback
from typing import TextIO

from hpcdl.comm.context import world
from hpcdl.comm.contract import Communicator

__all__ = ["abort_on_exception", "format_rank_traceback"]


def format_rank_traceback(exc: BaseException, rank: int | str) -> str:
    """The traceback of ``exc``, each line prefixed with ``[rank R] ``."""
    prefix = f"[rank {rank}] "
    lines = "".join(traceback.format_exception(exc)).splitlines(keepends=True)
    return "".join(prefix + line for line in lines)


def abort_on_exception(
    exc: BaseException, comm: Communicator | None = None, file: TextIO | None = None, drain_s: float = 0.0
) -> None:
    """Report ``exc`` as this rank's failure and end the job if other ranks exist.

    Prints ``[rank R] Traceback ...`` to ``file`` (stderr by default) and flushes; then,
    when the communicator has more than one rank, calls ``comm.Abort(1)`` so that the
    other ranks do not hang in a collective (what ``python -m mpi4py`` does). In a world
    of one it returns, and the entry point returns its exit status. It installs no signal
    handler and never calls ``sys.exit``: the ``__main__`` entry points call it.

    Args:
        exc: the exception that ended this rank's work.
        comm: communicator to abort; the current :func:`hpcdl.comm.world` by default.
        file: stream for the traceback; ``sys.stderr`` by default.
        drain_s: seconds to wait between printing and aborting, so that the launcher
            forwards the traceback before the job is torn down (entry points pass 0.5).
    """
    stream = sys.stderr if file is None else file
    try:
        comm = world() if comm is None else comm
        rank: int | str = comm.Get_rank()
        size = comm.Get_size()
    except Exception:  # the world itself is broken: still show the traceback
        comm, rank, size = None, "?", 1
    sys.stdout.flush()
    stream.write(format_rank_traceback(exc, rank))
    stream.flush()
    if comm is not None and size > 1:
        if drain_s > 0:
            time.sleep(drain_s)  # the abort path only: the process ends right after
        comm.Abort(1)
