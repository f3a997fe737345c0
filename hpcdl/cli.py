"""What every ``python -m hpcdl.X`` entry point does around ``main(argv)``.

Only these entry points may call ``sys.exit``, install signal handlers or abort
the MPI job (DESIGN.md): ``main(argv) -> int`` itself stays callable in-process,
by tests and by the simulator.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import NoReturn

from hpcdl.errors import ConfigError, HpcdlError

__all__ = ["entry", "parse_args", "EXIT_USAGE"]

#: exit status of a user error (bad config, missing file, wrong rank count)
EXIT_USAGE = 2


def _world_rank_size() -> tuple[int, int]:
    from hpcdl.comm import world

    comm = world()
    return comm.Get_rank(), comm.Get_size()


def entry(main: Callable[[list[str]], int], prog: str) -> NoReturn:
    """Run ``main(sys.argv[1:])`` and exit with its status.

    A :class:`~hpcdl.errors.HpcdlError` prints one line ``prog: error: ...`` and
    exits 2. Any other exception prints ``[rank R]`` and the traceback on that
    rank's stderr. Under mpiexec with more than one rank both end the whole job
    with ``MPI_Abort`` (a plain exit of one rank would leave the others
    waiting in a collective forever); rank 0 reports first, so that an error
    every rank hits is printed once.
    """
    try:
        code = main(sys.argv[1:])
    except HpcdlError as err:
        rank, size = _world_rank_size()
        if size > 1 and rank != 0:
            time.sleep(1.0)  # if rank 0 hit it too, its Abort ends us before we print it again
        where = f" (rank {rank})" if size > 1 and rank != 0 else ""
        print(f"{prog}: error{where}: {err}", file=sys.stderr, flush=True)
        _end(EXIT_USAGE, size)
    except BaseException as err:  # noqa: BLE001  (any failure must end every rank)
        if isinstance(err, SystemExit):
            raise
        from hpcdl.comm import abort_on_exception

        abort_on_exception(err)  # prints "[rank R] Traceback ..."; aborts the job if size > 1
        sys.exit(1)
    sys.exit(code)


def _end(code: int, size: int) -> NoReturn:
    if size > 1:
        from hpcdl.comm import world

        world().Abort(code)
    sys.exit(code)


def parse_args(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """``parser.parse_args`` that raises :class:`ConfigError` (exit 2) instead of exiting."""
    try:
        args, extra = parser.parse_known_args(argv)
    except argparse.ArgumentError as err:
        raise ConfigError(f"{err} (see --help)") from None
    if extra:
        raise ConfigError(f"unrecognized arguments: {' '.join(extra)} (see --help)")
    return args
