"""Re-run every experiment in ``jobs/experiments/`` and say which of its results still hold.

    python jobs/experiments/reproduce.py                 # every experiment at its small size (make reproduce)
    python jobs/experiments/reproduce.py --full          # at the sizes of the experiments' READMEs
    python jobs/experiments/reproduce.py --only pipeline --work /tmp/reproduce
    python jobs/experiments/reproduce.py --collect       # the table again, from the summaries in --work

**The interface an experiment implements** (a new one joins by adding its ``run.py``):

    python jobs/experiments/NAME/run.py --reproduce {small,full} --work DIR

runs the experiment at that size with everything it writes (run files, ``results.json``,
figures) under ``DIR``, never beside the script, and writes ``DIR/summary.json``::

    {"experiment": "NAME", "size": "small", "rows": [
        {"figure": "the README's figure or table", "quantity": "what is compared",
         "measured": "...", "target": "the paper's or the target's value",
         "verdict": "holds" | "does not hold" | "not comparable", "rule": "how the verdict is decided"}]}

``small`` takes at most 5 minutes here (2 cores), ``full`` the sizes its README states.
:func:`row` and :func:`write_summary` below build it. This script runs each ``run.py`` in turn
(its output to ``DIR/run.log``), then collects the rows into one table, printed and written as
``WORK/summary.md`` and ``WORK/summary.json``. An experiment that fails or writes no summary
gets one row saying so.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hpcdl.comm.machine import describe

HERE = Path(__file__).resolve().parent
SIZES = ("small", "full")
VERDICTS = ("holds", "does not hold", "not comparable")
COLUMNS = ("experiment", "figure", "quantity", "measured", "target", "verdict", "rule")


def row(
    figure: str, quantity: str, measured: Any, target: Any, holds: bool | None, rule: str
) -> dict[str, Any]:
    """One comparison: ``holds`` True, False, or None when the measurement cannot be compared."""
    verdict = "not comparable" if holds is None else "holds" if holds else "does not hold"
    return {"figure": figure, "quantity": quantity, "measured": measured, "target": target,
            "verdict": verdict, "rule": rule}  # fmt: skip


def env() -> dict[str, str]:
    """The environment of an experiment's runs: one BLAS and OpenMP thread per process."""
    return {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}


def sets(items: list[str]) -> list[str]:
    """``key=value`` items as ``--set`` arguments, a value that is not a number, a boolean or a
    list quoted as a TOML string."""
    out = []
    for item in items:
        key, _, value = item.partition("=")
        if value and not re.fullmatch(r"[-+0-9.e]+|true|false|\[.*\]", value):
            value = json.dumps(value)  # a TOML string
        out += ["--set", f"{key}={value}"]
    return out


def write_summary(work: Path, experiment: str, size: str, rows: list[dict[str, Any]], **extra: Any) -> Path:
    """``work/summary.json``: an experiment's comparisons at ``size`` (the interface above)."""
    path = work / "summary.json"
    path.write_text(
        json.dumps({"experiment": experiment, "size": size, **extra, "rows": rows}, indent=1) + "\n"
    )
    return path


def experiment_parser(
    doc: str, parts: list[str], default: list[str], sizes: list[str]
) -> argparse.ArgumentParser:
    """The options every experiment's ``run.py`` takes: ``--work``, ``--parts``, ``--figures-only``,
    ``--tables`` and ``--reproduce`` (the interface above)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--work", type=Path, help="directory for run files")
    parser.add_argument("--parts", nargs="*", choices=parts, default=default)
    parser.add_argument("--figures-only", action="store_true", help="redraw from results.json")
    parser.add_argument("--tables", action="store_true", help="print the README's tables from results.json")
    parser.add_argument("--reproduce", choices=sizes, help="every part at this size; results, figures, "
                        "summary.json in --work")  # fmt: skip
    return parser


def open_results(
    args: argparse.Namespace, sizes: dict[str, dict[str, Any]], out: Path
) -> tuple[dict[str, Any], Path, Path, dict[str, Any]]:
    """An experiment's size, output directory, ``results.json`` and its results so far: with
    ``--reproduce`` that size (its ``parts``), ``--work`` and a fresh file; else ``full`` and ``out``'s."""
    size = sizes["full"]
    if args.reproduce:
        size, out = sizes[args.reproduce], args.work
        args.parts = size["parts"]
        args.work.mkdir(parents=True, exist_ok=True)
        (out / "results.json").unlink(missing_ok=True)
    path = out / "results.json"
    return size, out, path, (json.loads(path.read_text()) if path.exists() else {})


def run_parts(names: list[str], results: dict[str, Any], path: Path, part: Any) -> None:
    """Run each part (``part(name)`` -> its entry), timing it into ``results["wall_s"]`` with the
    machine, and write ``results`` to ``path`` after each (an interrupted study keeps its parts)."""
    for name in names:
        t0 = time.monotonic()
        results[name] = part(name)
        results.setdefault("wall_s", {})[name] = round(time.monotonic() - t0, 1)
        results["machine"] = describe()
        path.write_text(json.dumps(results, indent=1) + "\n")
        print(f"{name}: {results['wall_s'][name]} s", flush=True)


#: a timed comparison is made only when other processes kept fewer cores busy than this meanwhile
QUIET_CORES = 0.25


def _busy_s() -> float:
    """Busy seconds of all CPUs since boot (``/proc/stat``, without idle and iowait)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return sum(u.ru_utime + u.ru_stime for u in usage)


@contextmanager
def other_cores() -> Iterator[dict[str, float]]:
    """Measure the cores other processes kept busy while the block ran (``["other_cores"]``).

    All CPUs' busy time less this process's and its waited-for children's (so run the timed
    commands to completion inside the block), over the wall time.
    """
    out: dict[str, float] = {}
    b0, c0, t0 = _busy_s(), _own_cpu_s(), time.monotonic()
    yield out
    wall = max(time.monotonic() - t0, 1e-9)
    out["other_cores"] = round(max(0.0, (_busy_s() - b0 - (_own_cpu_s() - c0)) / wall), 3)


def experiments(root: Path = HERE) -> dict[str, Path]:
    """Each experiment's name and its ``run.py``."""
    return {p.parent.name: p for p in sorted(root.glob("*/run.py"))}


def run_one(name: str, script: Path, size: str, work: Path) -> float:
    """Run ``script --reproduce size --work work/name``; its wall seconds (its output in ``run.log``)."""
    out = work / name
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").unlink(missing_ok=True)
    cmd = [sys.executable, str(script), "--reproduce", size, "--work", str(out)]
    print(f"+ {' '.join(cmd)}", flush=True)
    t0 = time.monotonic()
    with open(out / "run.log", "w") as log:
        done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=False)
    wall = time.monotonic() - t0
    print(f"  {name}: exit {done.returncode}, {wall:.0f} s", flush=True)
    if done.returncode:
        (out / "failed").write_text(f"exit {done.returncode}; see run.log\n")
    return wall


def collect(work: Path, names: list[str]) -> list[dict[str, Any]]:
    """The rows of every experiment's ``work/NAME/summary.json``, each with its experiment's name.

    Raises:
        ValueError: a summary's row lacks a column or has a verdict outside ``VERDICTS``.
    """
    rows: list[dict[str, Any]] = []
    for name in names:
        path = work / name / "summary.json"
        failed = work / name / "failed"
        if failed.exists() or not path.exists():
            why = failed.read_text().strip() if failed.exists() else "no summary.json"
            rows.append(
                {"experiment": name, **row("–", "the run", why, "a summary", None, "the script must finish")}
            )
            continue
        summary = json.loads(path.read_text())
        for i, r in enumerate(summary["rows"]):
            lacking = [c for c in COLUMNS[1:] if c not in r]
            if lacking:
                raise ValueError(f"{path}: row {i} lacks {lacking}")
            if r["verdict"] not in VERDICTS:
                raise ValueError(f"{path}: row {i} has verdict {r['verdict']!r}, not one of {VERDICTS}")
            rows.append({"experiment": summary.get("experiment", name), **{c: r[c] for c in COLUMNS[1:]}})
    return rows


def _cell(value: Any) -> str:
    text = f"{value:.4g}" if isinstance(value, float) else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(rows: list[dict[str, Any]], size: str, walls: dict[str, float] | None = None) -> str:
    """The one table, with a line counting the verdicts (and each experiment's wall time when given)."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cell(r[c]) for c in COLUMNS) + " |" for r in rows]
    counts = {v: sum(r["verdict"] == v for r in rows) for v in VERDICTS}
    tail = f"\n{len(rows)} rows at the {size} size: " + ", ".join(f"{n} {v}" for v, n in counts.items())
    if walls:
        total = sum(walls.values())
        tail += "; wall " + ", ".join(f"{k} {w:.0f} s" for k, w in walls.items()) + f", {total:.0f} s in all"
    return "\n".join(lines) + "\n" + tail + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--full", action="store_true", help="the sizes of the experiments' READMEs (default: small)"
    )
    parser.add_argument(
        "--work", type=Path, default=Path("build/reproduce"), help="run files and the summaries"
    )
    parser.add_argument("--only", nargs="+", metavar="NAME", help="these experiments only")
    parser.add_argument(
        "--collect", action="store_true", help="only build the table from the summaries in --work"
    )
    args = parser.parse_args(argv)
    size = "full" if args.full else "small"
    found = experiments()
    names = args.only or list(found)
    unknown = sorted(set(names) - set(found))
    if unknown:
        parser.error(f"no jobs/experiments/NAME/run.py for {unknown} (there are {sorted(found)})")
    args.work.mkdir(parents=True, exist_ok=True)
    walls: dict[str, float] = {}
    load = [os.getloadavg()[0]]
    if not args.collect:
        for name in names:
            walls[name] = run_one(name, found[name], size, args.work)
        load.append(os.getloadavg()[0])
    rows = collect(args.work, names)
    table = markdown(rows, size, walls)
    if not args.collect:  # other jobs on the machine move the timed comparisons
        table += (
            f"load average (1 min) before and after: {load[0]:.2f}, {load[1]:.2f} on {os.cpu_count()} cores\n"
        )
    print(table)
    (args.work / "summary.md").write_text(table)
    summary = {"size": size, "wall_s": {k: round(w, 1) for k, w in walls.items()}, "load": load, "rows": rows}
    (args.work / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"written: {args.work / 'summary.md'}, {args.work / 'summary.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
