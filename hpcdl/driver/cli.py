"""What every ``python -m hpcdl.X`` entry point does around ``main(argv)``.

Only these entry points may call ``sys.exit``, install signal handlers or abort
the MPI job (docs/design.md, the communicator contract): ``main(argv) -> int``
itself stays callable in-process, by tests and by the simulator.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import textwrap
import time
from collections.abc import Callable
from typing import Any, NoReturn

from hpcdl.errors import ConfigError, HpcdlError, file_error

__all__ = [
    "python_command",
    "entry",
    "parse_args",
    "ArgumentParser",
    "HelpFormatter",
    "HelpRequested",
    "EXIT_USAGE",
    "EXIT_PIPE",
    "positive_int",
    "nonnegative_int",
    "positive_float",
    "nonnegative_float",
    "parse_size",
    "out_of_memory",
]

#: exit status of a user error (bad config, missing file, wrong rank count)
EXIT_USAGE = 2
#: exit status when the reader of stdout has gone (``| head``): 128 + SIGPIPE, as a shell
#: reports a Unix tool that SIGPIPE ended
EXIT_PIPE = 141


def _world_rank_size() -> tuple[int, int]:
    from hpcdl.comm import world

    try:
        comm = world()
    except HpcdlError:  # MPI itself cannot start: report as a process of one
        return 0, 1
    return comm.Get_rank(), comm.Get_size()


def entry(main: Callable[[list[str]], int], prog: str, *, stop_signals: bool = False) -> NoReturn:
    """Run ``main(sys.argv[1:])`` and exit with its status.

    A :class:`~hpcdl.errors.HpcdlError` prints one line ``prog: error: ...`` and
    exits 2; so does an ``OSError`` about a path that no caller turned into one (a
    file-system error: permissions, a full disk), and a ``MemoryError`` (NumPy's
    ``_ArrayMemoryError`` included: :func:`out_of_memory` names the rank, the layer and
    what failed to allocate; the run file was marked failed on the way). Any other exception prints
    ``[rank R]`` and the traceback on that rank's stderr. Under mpiexec with more
    than one rank both end the whole job with ``MPI_Abort`` (a plain exit of one
    rank would leave the others waiting in a collective forever); rank 0 reports first, so that an error
    every rank hits is printed once. When the reader of stdout has gone (``... | head``),
    the command ends quietly, as Unix tools do, with status 141 (:data:`EXIT_PIPE`).
    """
    if stop_signals:  # SIGUSR1/SIGTERM/SIGINT ask the loop for a checkpoint and a clean exit
        from hpcdl.driver.signals import StopRequest, install_handlers, set_stop_request

        request = StopRequest()
        install_handlers(request)
        set_stop_request(request)
    try:
        code = main(sys.argv[1:])
    except HelpRequested as done:
        code = done.status
    except BrokenPipeError:
        _reader_gone()
    except (HpcdlError, OSError, MemoryError) as err:
        if isinstance(err, MemoryError):
            err = out_of_memory(err, _world_rank_size()[0])
        elif isinstance(err, OSError) and not isinstance(err, HpcdlError):
            if err.filename is None:  # not about a path: a failure to show with its traceback
                _abort(err)
            err = file_error(None, err, verb="use")  # a file-system error no caller named: still one line
        rank, size = _world_rank_size()
        if size > 1 and rank != 0 and err.exit_status == EXIT_USAGE:
            # A heuristic, not a protocol: if rank 0 hit the same error (a bad config is
            # seen by every rank), its Abort usually ends this rank before it prints the
            # line a second time. An error only this rank sees is printed after the pause.
            time.sleep(1.0)
        where = f" (rank {rank})" if size > 1 and rank != 0 else ""
        print(f"{prog}: error{where}: {err}", file=sys.stderr, flush=True)
        _end(err.exit_status, size)
    except BaseException as err:  # noqa: BLE001  (any failure must end every rank)
        if isinstance(err, SystemExit):
            raise
        _abort(err)
    try:
        sys.stdout.flush()  # what is left to write goes now: a reader gone is seen here, not at exit
    except BrokenPipeError:
        _reader_gone()
    sys.exit(code)


def _reader_gone() -> NoReturn:
    """stdout's reader has gone (``| head`` read what it wanted): exit quietly with :data:`EXIT_PIPE`.

    Python's own flush at exit would fail again and print ``Exception ignored ...``:
    stdout is pointed at /dev/null first (the recipe of Python's ``signal`` docs).
    """
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    _end(EXIT_PIPE, _world_rank_size()[1] if "mpi4py.MPI" in sys.modules else 1)


def out_of_memory(err: MemoryError, rank: int) -> HpcdlError:
    """A ``MemoryError`` of ``rank`` as one line: where it happened and what failed to allocate.

    NumPy's message names the allocation ("Unable to allocate 10.3 GiB for an array with
    shape ..."); the innermost layer's forward or backward on the way is named too.
    """
    what = str(err).strip().rstrip(".") or "an allocation failed"
    return HpcdlError(
        f"rank {rank} ran out of memory{_where(err.__traceback__)}: {what[0].lower()}{what[1:]}; lower "
        "data.batch_size or give the ranks more memory (python -m hpcdl.train --plan estimates each rank's)"
    )


def _where(tb: Any) -> str:
    """`` in the backward of layer features.3 (Conv2d)``: the innermost layer's call in ``tb``; else
    the innermost hpcdl function (`` in hpcdl/parallel/ps.py, _init_worker``); else ''."""
    from hpcdl.nn.layer import Layer

    layer, code = "", ""
    while tb is not None:
        frame = tb.tb_frame
        owner = frame.f_locals.get("self")
        name = frame.f_code.co_name
        if name in ("forward", "backward") and isinstance(owner, Layer) and owner.name:
            layer = f" in the {name} of layer {owner.name} ({type(owner).__name__})"
        filename = frame.f_code.co_filename.replace("\\", "/")
        if "/hpcdl/" in filename:
            code = f" in hpcdl/{filename.rsplit('/hpcdl/', 1)[1]}, {name}"
        tb = tb.tb_next
    return layer or code


def _abort(err: BaseException) -> NoReturn:
    from hpcdl.comm import abort_on_exception

    abort_on_exception(err, drain_s=DRAIN_S)  # "[rank R] Traceback ..."; aborts if size > 1
    sys.exit(1)


#: seconds a rank waits after writing its last words and before MPI_Abort: the launcher
#: forwards output asynchronously, and an abort that comes too soon can lose it
DRAIN_S = 0.5


def _end(code: int, size: int) -> NoReturn:
    if size > 1:
        time.sleep(DRAIN_S)
        from hpcdl.comm import world

        world().Abort(code)
    sys.exit(code)


class HelpFormatter(argparse.HelpFormatter):
    """Help that shows each option's default and keeps the layout of examples.

    In descriptions and epilogs, lines that start with a space (examples, commands)
    are kept as written; the other lines are wrapped as paragraphs (a blank line
    separates them). ``(default: X)`` is added to an option's help unless the help already says
    ``default:``, the option is required, or it has no default to show (``None``,
    a flag's ``False``, an empty list); a list default is shown as its items
    separated by spaces, as they are typed. An option whose default is ``None``
    should say in its help what happens without it, e.g. ``(default: not written)``.
    """

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        out: list[str] = []
        para: list[str] = []

        def flush() -> None:
            if para:
                out.append(super(HelpFormatter, self)._fill_text(" ".join(para), width, indent))
                para.clear()

        for line in text.splitlines():
            if not line.strip():
                flush()
                out.append("")
            elif line[0].isspace():
                flush()
                out.append(indent + line)
            else:
                para.append(line.strip())
        flush()
        return "\n".join(out)

    def _split_lines(self, text: str, width: int) -> list[str]:
        # as argparse does, but without breaking words at hyphens ("shm-local", "--out")
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if "%(default)" in text or "default:" in text or action.required:
            return text
        if not (action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE)):
            return text
        if default is None or default is argparse.SUPPRESS or isinstance(default, bool):
            return text
        if isinstance(default, (list, tuple)):
            if not default:
                return text
            shown = " ".join(str(v) for v in default)
        else:
            shown = str(default)
        return f"{text} (default: {shown.replace('%', '%%')})"


class ArgumentParser(argparse.ArgumentParser):
    """An ``argparse`` parser for ``main(argv)``: errors raise, nothing calls ``sys.exit``.

    A usage error (missing or unknown argument, bad choice) raises
    :class:`ConfigError`, which the entry point prints as one line with exit
    status 2; ``--help`` raises :class:`HelpRequested` after printing the help.
    Help is formatted by :class:`HelpFormatter` unless ``formatter_class`` says otherwise
    (subcommands' parsers too).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{message} (see {self.prog} --help)")

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        if message:
            sys.stderr.write(message)
        raise HelpRequested(status)


class HelpRequested(Exception):  # noqa: N818  (not an error: --help was answered)
    """``--help`` (or ``--version``) printed its text; ``main`` returns ``status``."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


def parse_args(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """``parser.parse_args(argv)`` raising :class:`ConfigError` (exit 2) instead of exiting.

    Raises:
        ConfigError: a usage error.
        HelpRequested: ``--help`` was given and answered.
    """
    try:
        return parser.parse_args(argv)
    except argparse.ArgumentError as err:
        raise ConfigError(f"{err} (see {parser.prog} --help)") from None


def _number(kind: type, strict: bool) -> Callable[[str], Any]:
    """An argparse ``type=``: ``kind`` (int or a finite float) above 0 (``strict``) or from 0.

    A value out of range is an ``ArgumentTypeError``, which :class:`ArgumentParser` reports
    as one line naming the option and the value (``argument -n: expected ...``), exit 2.
    """
    words = ("a whole number" if kind is int else "a number") + (" above 0" if strict else ", 0 or more")

    def convert(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or value < 0 or (strict and value == 0):
            raise argparse.ArgumentTypeError(f"expected {words} (got {text!r})")
        return value

    convert.__name__ = f"{'positive' if strict else 'nonnegative'}_{kind.__name__}"
    return convert


#: ``type=`` of an option counting things (ranks, repetitions, threads): 1, 2, ...
positive_int = _number(int, strict=True)
#: ``type=`` of an option counting things where 0 means none or all: 0, 1, ...
nonnegative_int = _number(int, strict=False)
#: ``type=`` of a size or duration: a finite number above 0
positive_float = _number(float, strict=True)
#: ``type=`` of a cost or fraction that may be 0: a finite number, 0 or more
nonnegative_float = _number(float, strict=False)


_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}


def parse_size(text: str, what: str = "--sizes") -> int:
    """Bytes from ``4096``, ``4K``, ``16M``, ``1G``, ``2T`` (binary units; ``B``/``iB`` optional).

    Raises:
        ConfigError: not a positive byte count (the message names ``what``).
    """
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = t[-1:] if t[-1:] in _UNITS else ""
    try:
        value = int(t[: len(t) - len(unit)]) * _UNITS[unit]
    except ValueError:
        raise ConfigError(f"{what} takes byte counts such as 4096, 64K or 16M (got {text!r})") from None
    if value <= 0:
        raise ConfigError(f"{what} must be positive (got {text!r})")
    return value


def python_command() -> str:
    """How a printed command names this interpreter: ``python`` when that is it on PATH.

    Otherwise its full path (quoted for a shell), so that a command printed for the user to
    paste (how to continue a run) works as printed.
    """
    import shlex
    import shutil

    found = shutil.which("python")
    if found is not None and os.path.realpath(found) == os.path.realpath(sys.executable):
        return "python"
    return shlex.quote(sys.executable)
