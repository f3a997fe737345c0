"""``python -m hpcdl.bench SUBCOMMAND``: benchmarks, printed and written as JSON rows.

Benchmarks are not tests: each prints its figures beside a reference measured in the
same run (MPI's own collective, a memcpy, PyTorch), as medians of interleaved
repetitions. Each subcommand is a module here with ``add_parser(subparsers)`` and
``run(args) -> rows``; every one accepts ``--json PATH``, which rank 0 writes
atomically (checked for writability before the benchmark starts). Every row written names the
machine it ran on (``"machine"``: :func:`hpcdl.comm.machine.describe`: CPU, cores, BLAS and its
kernel, MPI library, ranks and ranks per node), and rank 0 prints it under the table.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from hpcdl.atomic import check_writable, write_text_atomic
from hpcdl.bench import allreduce, calibrate, exchange, ops, pack, pipeline, planner, step, switch, train
from hpcdl.comm import host_ranks, on_root, world
from hpcdl.comm.machine import describe, machine_line
from hpcdl.driver.cli import ArgumentParser, parse_args

__all__ = ["main", "build_parser", "SUBCOMMANDS", "DESCRIPTION"]

#: subcommand name -> module with add_parser(sub) and run(args) -> rows
SUBCOMMANDS: dict[str, ModuleType] = {
    "step": step,
    "train": train,
    "pipeline": pipeline,
    "pack": pack,
    "allreduce": allreduce,
    "calibrate": calibrate,
    "planner": planner,
    "ops": ops,
    "switch": switch,
    "exchange": exchange,
}

#: the one-line description ``--help`` shows
DESCRIPTION = "Benchmarks of hpcdl's compute and communication, each beside a reference timed alike."

_EPILOG = """\
Every subcommand prints a table (on rank 0) and, with --json PATH, writes its rows
as a JSON list. Figures are medians of interleaved repetitions. Run the ones that
communicate under mpiexec; each subcommand's --help lists its options:

  mpiexec -n 2 python -m hpcdl.bench allreduce --sizes 4K 1M
  python -m hpcdl.bench step --help"""

_JSON_WHAT = "the JSON rows"


def build_parser() -> ArgumentParser:
    """The parser of ``python -m hpcdl.bench`` and its subcommands."""
    parser = ArgumentParser(prog="python -m hpcdl.bench", description=DESCRIPTION, epilog=_EPILOG)
    sub = parser.add_subparsers(dest="command", required=True, metavar="SUBCOMMAND", title="subcommands")
    for module in SUBCOMMANDS.values():
        module.add_parser(sub)
    for p in sub.choices.values():
        p.add_argument(
            "--json",
            type=Path,
            default=None,
            metavar="PATH",
            help="also write the rows to PATH as a JSON list (default: not written)",
        )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run a benchmark; returns the exit status.

    Raises:
        ConfigError: a usage error or a bad option value.
        FileError: ``--json`` cannot be written (checked before the benchmark runs, on
            every rank); an existing file is left as it was.
    """
    args = parse_args(build_parser(), list(argv or []))
    comm = world()
    if args.json is not None:
        on_root(comm, lambda: check_writable(args.json, what=_JSON_WHAT))
    rows: list[dict[str, Any]] = SUBCOMMANDS[args.command].run(args)
    where = describe(comm, len(host_ranks(comm)))  # collective: every rank is here
    on_root(comm, lambda: print(f"machine: {machine_line(where)}"))
    if args.json is not None:
        rows = [{**r, "machine": where} for r in rows]

        def write() -> None:
            write_text_atomic(args.json, json.dumps(rows, indent=1) + "\n", what=_JSON_WHAT)
            print(f"rows written to {args.json}", file=sys.stderr)

        on_root(comm, write)
    return 0
