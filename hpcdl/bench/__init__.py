"""``python -m hpcdl.bench SUBCOMMAND``: benchmarks, printed and written as JSON rows.

Benchmarks are not tests: each prints its figures beside a reference measured in the
same run (MPI's own collective, a memcpy, PyTorch), as medians of interleaved
repetitions. Each subcommand is a module here with ``add_parser(subparsers)`` and
``run(args) -> rows``; every one accepts ``--json PATH``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from hpcdl.bench import allreduce, calibrate, pack, step, train
from hpcdl.cli import ArgumentParser, parse_args
from hpcdl.comm import world

__all__ = ["main", "SUBCOMMANDS"]

#: subcommand name -> module with add_parser(sub) and run(args) -> rows
SUBCOMMANDS: dict[str, ModuleType] = {
    "step": step,
    "train": train,
    "pack": pack,
    "allreduce": allreduce,
    "calibrate": calibrate,
}


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="python -m hpcdl.bench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for module in SUBCOMMANDS.values():
        module.add_parser(sub)
    for p in sub.choices.values():
        p.add_argument("--json", type=Path, default=None, help="write the rows as a JSON list")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run a benchmark; returns the exit status."""
    args = parse_args(build_parser(), list(argv or []))
    rows: list[dict[str, Any]] = SUBCOMMANDS[args.command].run(args)
    if args.json is not None and world().Get_rank() == 0:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
        print(f"rows written to {args.json}", file=sys.stderr)
    return 0
