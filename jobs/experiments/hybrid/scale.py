"""How far the simulator scales a hybrid run: replicated pipeline stages on up to 1,024 virtual ranks.

Each point is one ``python -m hpcdl.simulate -n N ... -m hpcdl.train`` of 10 steps:
``parallel.strategy = "pipeline"`` with ``pipeline.stages = 8`` (N / 8 replicas of each
stage), ``pipeline.microbatches = 128`` of ``data.batch_size = 8`` (a global batch of 1,024),
GPipe or 1F1B, on ``ib-hdr``, compute charged from a cost table (``--compute table:``)
profiled here first by a one-process run with ``profile.layers = true`` at the same batch.
The model is ``mlp`` at depth 32, width 256 on the ``mlp32-synthetic`` preset's data
(8,192 synthetic 28x28 samples): mlp32's 64 top-level layers at half its width, 8 a stage.
mlp32 itself (8.3 M parameters) would hold about 22 MB a rank (its stage's weights,
gradients, microbatch sum, momentum and exchange bucket: 5 x 4 MB), 22 GiB at 1,024 ranks:
more than this 24 GiB machine has beside its other jobs (5.9 GiB at 256 ranks).

Recorded per point: the wall time, CPU time and peak resident set of the simulating
process (``os.wait4``'s rusage of that child alone), the busy time of the other cores over
the run (the machine is shared: wall time above CPU time is waiting for a core), the
simulator's ``--stats`` (virtual makespan, messages), and from the run file the simulated
step time and samples/s (medians over the steps; with a cost table every step is alike) and
the final test accuracy. The run evaluates once, at its end (``train.eval_every`` past the
last step): the test set's 1,024 images through replica 0 of each stage, in two messages;
the run also writes its final checkpoint (each stage's piece once). Both are in the wall time.

    python jobs/experiments/hybrid/scale.py --work /tmp/hybrid-scale                  # 1,024, 1F1B
    python jobs/experiments/hybrid/scale.py --work /tmp/hybrid-scale --ranks 64 256 1024 \\
        --schedules 1f1b gpipe --record                                               # the table

Rows go to ``WORK/scale.json`` (with ``--record``, to ``scale.json`` beside this script);
run files and the cost table stay in ``--work``. The table is measured on this machine at the
time, so the simulated figures move with its load from one profile to the next; ``--table
FILE`` reuses one (``WORK/profile.h5`` of an earlier run) to compare code, not machines.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import h5py
import numpy as np

HERE = Path(__file__).resolve().parent
PYTHON = sys.executable
STEPS = 10
STAGES = 8
MICROBATCHES = 128
BATCH = 8
NETWORK = "ib-hdr"
#: the model and data: mlp (32 Linear layers of 256) on the mlp32-synthetic preset's data
MODEL = ["model.name=mlp", "model.depth=32", "model.width=256", f"data.batch_size={BATCH}"]
#: what every run sets besides the model: no periodic checkpoint or evaluation, few log rows
BASE = ["checkpoint.every=0", f"train.eval_every={10 * STEPS}", "train.log_every=100000"]
#: the simulator's closing line (``--stats``)
STATS = re.compile(
    r"virtual makespan (?P<makespan>[\d.]+) s, wall (?P<wall>[\d.]+) s \((?P<compute>[\d.]+) s of it"
    r".*?(?P<messages>[\d,]+) messages"
)


def env() -> dict[str, str]:
    return {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}


def sets(items: list[str]) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


def fresh(out: Path) -> Path:
    """``out`` with no run file or checkpoint of an earlier run beside it."""
    for old in out.parent.glob(f"{out.stem}.*h5"):
        old.unlink()
    return out


def profile(work: Path) -> Path:
    """The cost table: a one-process run of the model with ``profile.layers = true`` (its ``profile/``)."""
    out = fresh(work / "profile.h5")
    cmd = [PYTHON, "-m", "hpcdl.train", "--config", "mlp32-synthetic",
           *sets([*MODEL, *BASE, "train.steps=6", "profile.layers=true"]),
           "--progress", "none", "--out", str(out)]  # fmt: skip
    done = subprocess.run(cmd, env=env(), capture_output=True, text=True, check=False)
    if done.returncode:
        sys.stderr.write(done.stderr[-2000:])
        raise SystemExit(f"failed ({done.returncode}): {shlex.join(cmd)}")
    return out


def command(ranks: int, schedule: str, table: Path, out: Path) -> list[str]:
    """The simulated run of one point."""
    settings = [*MODEL, *BASE, f"train.steps={STEPS}", "parallel.strategy=pipeline",
                f"pipeline.stages={STAGES}", f"pipeline.microbatches={MICROBATCHES}",
                f"pipeline.schedule={schedule}"]  # fmt: skip
    return [PYTHON, "-m", "hpcdl.simulate", "-n", str(ranks), "--network", NETWORK,
            "--compute", f"table:{table}", "--stats", "-m", "hpcdl.train", "--config", "mlp32-synthetic",
            *sets(settings), "--progress", "none", "--out", str(out)]  # fmt: skip


def measured(cmd: list[str], log: Path) -> tuple[dict[str, Any], str]:
    """Run ``cmd`` to its end, its output to ``log``: its wall and CPU seconds and its peak RSS
    (``os.wait4``: that child's own rusage), the other cores' load meanwhile; and its output."""
    sys.path.insert(0, str(HERE.parent))
    from reproduce import other_cores

    with other_cores() as load, open(log, "w") as sink:
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, env=env(), stdout=sink, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.monotonic() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
    text = log.read_text()
    if proc.returncode:
        sys.stderr.write(text[-3000:])
        raise SystemExit(f"failed ({proc.returncode}): {shlex.join(cmd)}")
    figures = {
        "wall_s": round(wall, 1),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
        "peak_rss_mib": round(usage.ru_maxrss / 1024),  # Linux: KiB
        **load,
    }
    return figures, text


def point(work: Path, table: Path, ranks: int, schedule: str) -> dict[str, Any]:
    out = fresh(work / f"scale-n{ranks}-{schedule}.h5")
    cmd = command(ranks, schedule, table, out)
    print(f"+ {shlex.join(cmd)}", flush=True)
    figures, text = measured(cmd, out.with_suffix(".log"))
    stats = STATS.search(text)
    with h5py.File(out, "r") as f:
        step_time = f["metrics/step_time"][...]
        rate = f["metrics/samples_per_s"][...]
        accuracy = float(f.attrs["final_test_accuracy"])
    row = {
        "ranks": ranks,
        "stages": STAGES,
        "replicas": ranks // STAGES,
        "schedule": schedule,
        "microbatches": MICROBATCHES,
        "batch": BATCH,
        "steps": STEPS,
        **figures,
        "sim_step_time_ms": round(1e3 * statistics.median(step_time), 4),
        "sim_samples_per_s": round(float(statistics.median(rate))),
        "sim_makespan_s": float(stats["makespan"]) if stats else None,
        "messages": int(stats["messages"].replace(",", "")) if stats else None,
        "final_test_accuracy": round(accuracy, 4),
        "steps_alike": bool(np.ptp(step_time) <= 1e-6 * step_time.max()),
        "command": "python " + shlex.join(cmd[1:]).replace(str(work), "WORK"),
    }
    print(json.dumps(row), flush=True)
    return row


def git_commit() -> str:
    cmd = ["git", "rev-parse", "--short", "HEAD"]
    done = subprocess.run(cmd, cwd=HERE, capture_output=True, text=True, check=False)
    return done.stdout.strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, required=True, help="run files and the cost table go here")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1024], help="virtual ranks (multiples of 8)")
    parser.add_argument("--schedules", nargs="+", default=["1f1b"], choices=("1f1b", "gpipe"))
    parser.add_argument("--record", action="store_true", help="write scale.json beside this script")
    parser.add_argument("--table", type=Path, help="a cost table to use instead of profiling one here")
    args = parser.parse_args(argv)
    bad = [n for n in args.ranks if n % STAGES or MICROBATCHES % (n // STAGES)]
    if bad:
        parser.error(f"--ranks {bad}: each must be 8 x r with r dividing {MICROBATCHES}")
    args.work.mkdir(parents=True, exist_ok=True)
    table = args.table.resolve() if args.table else profile(args.work)
    rows = [point(args.work, table, n, s) for s in args.schedules for n in args.ranks]
    result = {
        "commit": git_commit(),
        "cpus": os.cpu_count(),
        "model": MODEL,
        "network": NETWORK,
        "cost_table": str(args.table) if args.table else "profiled here: one process, 6 steps of batch 8",
        "rows": rows,
    }
    path = (HERE if args.record else args.work) / "scale.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
