"""Simulator fidelity: ``bench train`` step time under mpiexec against the simulator, in alternating pairs.

For each pair and config: a real run (``mpiexec -n N python -m hpcdl.bench train``), the
simulated run on the network (``python -m hpcdl.simulate -n N --network NET -m
hpcdl.bench train``, same arguments) and the same without the network's compute
contention (NET with its ``[compute]`` section removed); the order flips every pair, so a
drift of the machine hits both sides. Each run waits for the machine to be quiet
(``--wait-quiet``) and records how many cores other processes kept busy meanwhile
(``/proc/stat`` less this run's own CPU time): the summary gives the medians of all pairs
and of the quiet ones (other processes below ``--quiet`` cores during every run of the
pair). The error is that of the medians: ``median(sim) / median(real) - 1``.

    python jobs/experiments/sim-fidelity/run.py --pairs 5 --out runs/sim-fidelity.jsonl

Rows go to ``--out`` as JSON lines (appended); the summary is printed, and
``--summary FILE`` prints it for rows already there. With ``--reproduce SIZE --work DIR``
(``jobs/experiments/reproduce.py``'s interface) the rows go to ``DIR/rows.jsonl`` and
``DIR/summary.json`` holds the comparisons of :func:`comparisons`; ``SIZES`` gives the sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

#: config -> bench train arguments (steps long enough that a step's noise averages out)
CONFIGS: dict[str, list[str]] = {
    "mlp32-synthetic": ["--repeat", "5", "--steps", "10"],
    "digits-cnn": ["--repeat", "5", "--steps", "100"],
}
KINDS = ("real", "sim", "sim-nocontention")
#: --reproduce's sizes: full is the README's first batch (10 pairs, waiting up to 300 s for quiet
#: before each run); small one pair, waiting up to 20 s (on a busy machine the pair is not quiet)
SIZES: dict[str, dict[str, Any]] = {
    "full": {"pairs": 10, "wait_quiet": 300.0},
    "small": {"pairs": 1, "wait_quiet": 20.0},
}
TARGET = 0.05  # issue 12: the simulated step time within 5 % of the real one
#: the README's batches, error of the medians per config (the four of 2026-11-24, and those of
#: 2026-11-27 once the simulator priced shm)
README_ERRORS = {"mlp32-synthetic": "−4.5 to +1.5 %", "digits-cnn": "−2.5 to −16.9 %"}


def busy_jiffies() -> int:
    """Busy time of all CPUs since boot, in clock ticks (``/proc/stat``, without idle and iowait)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return sum(fields) - fields[3] - fields[4]


def children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def wait_quiet(cores: float, timeout_s: float, window_s: float = 3.0) -> bool:
    """Wait until other processes keep fewer than ``cores`` busy over ``window_s`` (at most ``timeout_s``)."""
    hz = os.sysconf("SC_CLK_TCK")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        b0 = busy_jiffies()
        time.sleep(window_s)
        if (busy_jiffies() - b0) / hz / window_s < cores:
            return True
    return False


def run(cmd: list[str], env: dict[str, str]) -> dict[str, Any]:
    """Run ``cmd`` (a bench train writing ``--json``); its row plus wall time and other processes' load."""
    with tempfile.TemporaryDirectory() as tmp:
        rows = Path(tmp) / "rows.json"
        hz = os.sysconf("SC_CLK_TCK")
        b0, c0, t0 = busy_jiffies(), children_cpu(), time.perf_counter()
        subprocess.run([*cmd, "--json", str(rows)], env=env, check=True, stdout=subprocess.DEVNULL)
        wall = time.perf_counter() - t0
        others = (busy_jiffies() - b0) / hz - (children_cpu() - c0)
        row = json.loads(rows.read_text())[0]
    return {
        **{k: row[k] for k in ("step_s", "compute_s", "comm_s", "exposed_comm_s")},
        "wall_s": wall,
        "other_cores": max(0.0, others / wall),
    }


def network_without_contention(network: str, path: Path) -> Path:
    """``network`` (a preset or file) written to ``path`` without its ``[compute]`` section."""
    from hpcdl.sim.network import load_network, network_toml

    d = load_network(network).describe()
    d.pop("compute", None)
    d.pop("file", None)
    path.write_text(network_toml(d, ["sim-fidelity: the network without its compute contention"]))
    return path


def measure(args: argparse.Namespace) -> None:
    py = sys.executable
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    mpiexec = args.mpiexec or str(Path(py).with_name("mpiexec"))
    tmp = Path(tempfile.mkdtemp(prefix="sim-fidelity-"))
    plain = network_without_contention(args.network, tmp / "nocontention.toml")
    sim = [py, "-m", "hpcdl.simulate", "-n", str(args.ranks)]
    lines = args.out.read_text().splitlines() if args.out.exists() else []
    first = max((json.loads(line)["pair"] for line in lines if line.strip()), default=-1) + 1  # number on
    for pair in range(first, first + args.pairs):
        for config in args.configs:
            bench = ["-m", "hpcdl.bench", "train", "--config", config, *CONFIGS[config]]
            cmds = {
                "real": [mpiexec, "-n", str(args.ranks), py, *bench],
                "sim": [*sim, "--network", args.network, *bench],
                "sim-nocontention": [*sim, "--network", str(plain), *bench],
            }
            order = list(KINDS) if pair % 2 == 0 else list(reversed(KINDS))
            for kind in order:
                if args.wait_quiet > 0:
                    wait_quiet(args.quiet, args.wait_quiet)
                print("+", shlex.join(cmds[kind]), file=sys.stderr, flush=True)
                row = {"pair": pair, "config": config, "kind": kind, "ranks": args.ranks}
                row |= {"network": args.network, **run(cmds[kind], env)}
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
                print(
                    f"  {kind:<17} step {1e3 * row['step_s']:7.2f} ms  compute "
                    f"{1e3 * row['compute_s']:7.2f} ms  other processes {row['other_cores']:.2f} cores",
                    file=sys.stderr,
                    flush=True,
                )


def summary(path: Path, quiet: float) -> None:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    print(
        f"{path}: {len(rows)} runs; medians; err: median(sim) / median(real) - 1; paired: the median "
        "of each pair's sim / real - 1 (robust to drifts between pairs)"
    )
    head = f"{'config':<17}{'pairs':<12}{'n':>3}{'real ms':>9}{'sim ms':>8}{'err':>8}{'paired':>8}"
    print(head + f"{'no-cont ms':>11}{'err':>8}{'paired':>8}{'compute real/sim/no-cont ms':>30}")
    for config in dict.fromkeys(r["config"] for r in rows):
        mine = [r for r in rows if r["config"] == config]
        pairs = sorted({r["pair"] for r in mine})
        loud = {r["pair"] for r in mine if r["other_cores"] >= quiet}
        for label, keep in (("all", pairs), (f"quiet<{quiet:g}", [p for p in pairs if p not in loud])):
            by = {k: [r for r in mine if r["kind"] == k and r["pair"] in keep] for k in KINDS}
            if not all(by.values()):
                print(f"{config:<17}{label:<12}  0")
                continue
            step = {k: statistics.median(r["step_s"] for r in v) for k, v in by.items()}
            comp = {k: statistics.median(r["compute_s"] for r in v) for k, v in by.items()}
            err = {k: step[k] / step["real"] - 1 for k in KINDS}
            real = {r["pair"]: r["step_s"] for r in by["real"]}
            paired = {
                k: statistics.median(r["step_s"] / real[r["pair"]] - 1 for r in by[k] if r["pair"] in real)
                for k in KINDS
            }
            print(
                f"{config:<17}{label:<12}{len(keep):>3}{1e3 * step['real']:>9.2f}{1e3 * step['sim']:>8.2f}"
                f"{100 * err['sim']:>+7.1f}%{100 * paired['sim']:>+7.1f}%"
                f"{1e3 * step['sim-nocontention']:>11.2f}"
                f"{100 * err['sim-nocontention']:>+7.1f}%{100 * paired['sim-nocontention']:>+7.1f}%"
                f"{1e3 * comp['real']:>12.2f} /{1e3 * comp['sim']:>6.2f}"
                f" /{1e3 * comp['sim-nocontention']:>6.2f}"
            )


def comparisons(path: Path, quiet: float) -> list[dict[str, Any]]:
    """Issue 12's target per config, from the rows in ``path``: rows for ``reproduce.py``."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from reproduce import row

    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    out = []
    for config in dict.fromkeys(r["config"] for r in rows):
        mine = [r for r in rows if r["config"] == config]
        loud = {r["pair"] for r in mine if r["other_cores"] >= quiet}
        calm = [r for r in mine if r["pair"] not in loud]
        pairs, kept = len({r["pair"] for r in mine}), len({r["pair"] for r in calm})
        errs = {}
        for label, some in (("quiet", calm), ("all", mine)):
            step = {k: [r["step_s"] for r in some if r["kind"] == k] for k in ("real", "sim")}
            if all(step.values()):
                errs[label] = statistics.median(step["sim"]) / statistics.median(step["real"]) - 1
        measured = ", ".join(f"{100 * e:+.1f} % ({label})" for label, e in errs.items())
        measured += f"; {kept} of {pairs} pairs quiet"
        err = errs.get("quiet")
        out.append(row(f"step time, {config}", "median(sim) / median(real) − 1, 2 ranks, shm-local", measured,
                       f"within ±5 % (issue 12); README: {README_ERRORS.get(config, '–')}",
                       None if err is None else abs(err) <= TARGET,
                       "|error| ≤ 5 % over the quiet pairs; none quiet: not comparable"))  # fmt: skip
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=5, help="alternating real/simulated pairs per config")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--network", default="shm-local", help="the simulator's network (with its contention)")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--mpiexec", default=None, help="default: the mpiexec beside this Python")
    p.add_argument("--out", type=Path, default=Path("runs/sim-fidelity.jsonl"), help="JSON lines, appended")
    p.add_argument(
        "--quiet", type=float, default=0.1, help="other processes' cores below which a pair is quiet"
    )
    p.add_argument(
        "--wait-quiet",
        type=float,
        default=300.0,
        metavar="S",
        help="before each run, wait up to S seconds for other processes to go below --quiet (0: do not wait)",
    )
    p.add_argument("--summary", action="store_true", help="only print the summary of --out")
    p.add_argument("--reproduce", choices=list(SIZES), help="at this size, rows and summary.json in --work")
    p.add_argument("--work", type=Path, help="with --reproduce: the directory for the rows and summary.json")
    args = p.parse_args()
    if args.reproduce:
        if args.work is None:
            p.error("--reproduce needs --work")
        args.work.mkdir(parents=True, exist_ok=True)
        args.out = args.work / "rows.jsonl"
        args.out.unlink(missing_ok=True)
        vars(args).update(SIZES[args.reproduce], summary=False)
    if not args.summary:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        measure(args)
    summary(args.out, args.quiet)
    if args.reproduce:
        rows = comparisons(args.out, args.quiet)
        from reproduce import write_summary  # on the path since comparisons()

        write_summary(args.work, "sim-fidelity", args.reproduce, rows, sizes=SIZES[args.reproduce])
    return 0


if __name__ == "__main__":
    sys.exit(main())
