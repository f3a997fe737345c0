"""``python -m hpcdl.simulate -n N [options] -m MODULE [args]``: an hpcdl command on N virtual ranks.

Runs ``MODULE.main(args)`` (``hpcdl.train``, ``hpcdl.bench``, ...) on N virtual ranks of
the hybrid simulator (:mod:`hpcdl.sim`), exactly as ``mpiexec -n N python -m MODULE args``
runs it on N processes: the same code, real compute, virtual time. Exit status: the
largest of the ranks' statuses; 2 for a user error (one line, as the command itself
gives it); 1 when a rank raised (its number and traceback are shown); the error code of
an ``Abort``; 3 for a deadlock (which rank waits for what).
"""

from __future__ import annotations

import importlib
import shlex
import sys
import time
import traceback
from typing import Any

from hpcdl.driver.cli import (
    EXIT_USAGE,
    ArgumentParser,
    HelpRequested,
    nonnegative_float,
    out_of_memory,
    parse_args,
    positive_float,
    positive_int,
    python_command,
)
from hpcdl.driver.runlog import peak_rss_mb
from hpcdl.errors import ConfigError, HpcdlError, file_error

__all__ = ["main", "build_parser", "EXIT_DEADLOCK"]

#: exit status of a simulation that stalled (every rank waiting, nothing in flight)
EXIT_DEADLOCK = 3


#: examples shown under ``--help``
_EPILOG = """\
The command after -m runs on every virtual rank exactly as under mpiexec; its run
file, rows and errors are those of a real run (world = "sim"). For example:

  python -m hpcdl.simulate -n 64 --network ib-hdr -m hpcdl.train --config digits-mlp \\
      --set train.steps=20 --set 'data.sampler="random"'
  python -m hpcdl.simulate -n 16 --compute none -m hpcdl.bench allreduce --sizes 4K 1M

Exit status: the command's own; 3 when the ranks deadlock (each rank's wait is
printed)."""


def build_parser() -> ArgumentParser:
    """The parser of the simulator's own options (those before ``-m MODULE``)."""
    parser = ArgumentParser(
        prog="python -m hpcdl.simulate",
        description="Run an hpcdl command on N virtual ranks in one process, in virtual time.",
        epilog=_EPILOG,
    )
    parser.add_argument("-n", dest="ranks", type=positive_int, required=True, help="number of virtual ranks")
    parser.add_argument(
        "--network",
        default="shm-local",
        metavar="PRESET|FILE",
        help="the network model: a preset (shm-local, eth10g, eth40g, ib-edr, ib-hdr) or a TOML file",
    )
    parser.add_argument(
        "--compute",
        default="measured",
        metavar="MODE",
        help="what a compute segment costs: measured (its wall time / speed, times the network file's "
        "contention for ranks sharing a node), none (nothing: communication only), or table:FILE "
        "(per-layer costs from a run file, TOML or CSV)",
    )
    parser.add_argument(
        "--speed",
        type=positive_float,
        default=1.0,
        help="compute speed factor; 2 stands for a device twice as fast",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the compute jitter")
    parser.add_argument(
        "--jitter",
        type=float,
        default=0.0,
        help="relative standard deviation of a lognormal factor on each compute charge; 0.05 = 5%%",
    )
    parser.add_argument(
        "--straggler",
        action="append",
        default=[],
        metavar="RANK:FACTOR",
        help="rank RANK computes FACTOR times slower, e.g. 3:2.0 (repeatable; default: none)",
    )
    parser.add_argument(
        "--poll-cost-us",
        type=nonnegative_float,
        default=0.1,
        metavar="US",
        help="virtual microseconds a failed Test or Iprobe costs",
    )
    parser.add_argument(
        "--stall-s",
        type=positive_float,
        default=10.0,
        metavar="S",
        help="virtual seconds of polling with nothing delivered after which the run stops as deadlocked",
    )
    parser.add_argument(
        "--stats",
        action="store_true",
        help="print the virtual makespan, wall time, messages per second and peak memory at the end",
    )
    parser.add_argument(
        "-m",
        dest="module",
        required=True,
        metavar="MODULE",
        help="the hpcdl command to run (hpcdl.train, hpcdl.bench); the arguments after it are the command's",
    )
    return parser


def _stragglers(items: list[str]) -> dict[int, float]:
    out = {}
    for item in items:
        rank, sep, factor = item.partition(":")
        try:
            out[int(rank)] = float(factor)
            if not sep or float(factor) <= 0:
                raise ValueError
        except ValueError:
            raise ConfigError(
                f"--straggler takes RANK:FACTOR with FACTOR > 0, e.g. 3:2.0 (got {item!r})"
            ) from None
    return out


def _command(module: str) -> Any:
    try:
        mod = importlib.import_module(module)
    except ImportError as err:
        raise ConfigError(
            f"-m {module}: cannot import it ({err}); give an hpcdl command such as hpcdl.train"
        ) from None
    main = getattr(mod, "main", None)
    if not callable(main):
        raise ConfigError(f"-m {module}: it has no main(argv) to run on the virtual ranks")
    return main


def main(argv: list[str] | None = None) -> int:
    """Run the simulation described by ``argv``; returns the exit status."""
    from hpcdl.sim.compute import Contention, make_compute
    from hpcdl.sim.engine import RankFailure, SimAbort, SimDeadlock, simulate
    from hpcdl.sim.network import load_network

    argv = list(argv or [])
    split = argv.index("-m") + 2 if "-m" in argv else len(argv)  # after -m MODULE: the command's own
    args = parse_args(build_parser(), argv[:split])
    cmd_args = argv[split:]
    command = _command(args.module)
    stragglers = _stragglers(args.straggler)
    bad = [r for r in stragglers if not 0 <= r < args.ranks]
    if bad:
        raise ConfigError(f"--straggler names ranks {bad} outside [0, {args.ranks})")
    network = load_network(args.network, args.ranks)
    try:
        compute = make_compute(
            args.compute,
            speed=args.speed,
            seed=args.seed,
            jitter=args.jitter,
            stragglers=stragglers,
            contention=Contention.of_network(network, args.ranks),  # the network file's [compute]
        )
    except OSError as err:  # a cost table that cannot be read (permissions, ...)
        raise file_error(
            None, err, what="the compute table", verb="read", fix="make it readable or use another"
        ) from None
    t0 = time.perf_counter()
    try:
        result = simulate(
            args.ranks,
            lambda: command(list(cmd_args)),
            network=network,
            compute=compute,
            poll_cost_s=args.poll_cost_us * 1e-6,
            stall_s=args.stall_s,
            launcher=" ".join([python_command(), "-m hpcdl.simulate", shlex.join(argv[:split])]),
        )
    except RankFailure as failure:
        exc = failure.exc
        if isinstance(exc, HelpRequested):  # the command's --help, printed by the first rank
            return exc.status
        if isinstance(exc, OSError) and exc.filename is not None:  # a file-system error no one named
            exc = file_error(None, exc, verb="use")
        if isinstance(exc, MemoryError):  # one line naming the rank and what failed to allocate
            exc = out_of_memory(exc, failure.rank)
        if isinstance(exc, HpcdlError):
            print(f"{args.module}: error: {exc}", file=sys.stderr, flush=True)
            return EXIT_USAGE
        print(f"[rank {failure.rank}] Traceback (most recent call last):", file=sys.stderr)
        print("".join(traceback.format_exception(exc)[1:]), file=sys.stderr, end="", flush=True)
        return 1
    except SimAbort as abort:
        print(
            f"hpcdl.simulate: rank {abort.rank} called Abort({abort.errorcode})", file=sys.stderr, flush=True
        )
        return abort.errorcode or 1
    except SimDeadlock as err:
        print(f"hpcdl.simulate: {err}", file=sys.stderr, flush=True)
        return EXIT_DEADLOCK
    codes = [c if isinstance(c, int) else 0 for c in result.results]
    if args.stats:
        wall = time.perf_counter() - t0
        engine_s = max(wall - result.compute_wall_s, 0.0)
        per_msg = (
            f", {1e6 * engine_s / result.messages:.1f} us of engine per message" if result.messages else ""
        )
        print(
            f"hpcdl.simulate: {args.ranks} virtual ranks, virtual makespan {result.makespan_s:.6f} s, "
            f"wall {wall:.2f} s ({result.compute_wall_s:.2f} s of it the ranks' compute), "
            f"{result.messages:,} messages ({result.messages / max(wall, 1e-9):,.0f}/s{per_msg}), "
            f"{result.events:,} events, peak RSS {peak_rss_mb():,.0f} MiB",
            file=sys.stderr,
            flush=True,
        )
    return max(codes, default=0)


if __name__ == "__main__":
    from hpcdl.driver.cli import entry

    entry(main, "hpcdl.simulate")
