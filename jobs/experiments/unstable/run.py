"""Training over an unstable network: "Distributed K-FAC Over Unstable Networks" (issue 25, item 5).

Every rank trains its own replica (``parallel.strategy = "local"``) and the ranks online every
τ = 4 steps average their weights; the instability model (``[fault]``) takes ranks offline.
The model is digits-mlp (3 × 256), batch 32 per rank, ``data.sampler = "random"`` (N × 32
exceeds the 1,437 training images), the preset's cosine schedule (2 warm-up epochs) ending at
the sample budget, ``schedule.scale = "sqrt"`` (the preset's linear rule, × 16, diverges at
N = 16 even under sync), evaluated every 4 steps (every round). SGD is the preset's (lr 0.05,
momentum 0.9); K-FAC is the kfac study's best (lr 0.002, damping 0.01, inv_every 10). Parts:

* ``profile``: the cost table the simulated runs charge compute from: one real process,
  K-FAC, ``profile.layers = true`` (the layers and K-FAC's ops; SGD's runs use its layers).
* ``sweep``: simulated N = 16 (``eth10g``, compute from the table), one factor at a time
  about the centre point (p = 0.1 per step, max duration 5 steps, at most N/2 = 8 ranks offline
  at once): p ∈ {0, 0.02, 0.05, 0.1, 0.2, 0.4}, duration ∈ {1, 5, 20}, cap ∈ {1, 4, 8, 15};
  K-FAC and SGD, seeds 0-2 (a seed moves the initial weights, the batches and the schedule).
* ``scale``: the centre point and p = 0 at real N = 4 (``mpiexec -n 4``) and simulated N = 64.
* ``time``: time to the target accuracy, ``local`` against ``sync`` waiting out the same
  schedule, at the centre point on ``eth10g``, N = 16 and 64. Sync runs without faults first;
  its median step time is the hold of sync under faults (``fault.step_s``: an offline rank
  holds back its gradients for a whole step), and the wait model — the fault-free run's
  time plus one step time at each step some rank is offline — is compared with the
  simulated time.

Accuracy is compared at the budget of :data:`BUDGET` samples processed (80 steps at N = 16,
20 at N = 64, 320 at N = 4), where p = 0 is below 98 %; the training loss at the budget (mean
of the last round's 4 steps) is beside it, as it separates what 360 test images cannot.

    python jobs/experiments/unstable/run.py --work /tmp/unstable                  # every part
    python jobs/experiments/unstable/run.py --work /tmp/unstable --parts time
    python jobs/experiments/unstable/run.py --tables                              # the README's tables
    python jobs/experiments/unstable/run.py --reproduce small --work /tmp/unstable  # make reproduce

Rows go to ``results.json`` beside this script (each part replaces its own entry), figures to
``*.png`` beside it; run files stay in ``--work``. With ``--reproduce SIZE`` everything goes to
``--work`` with ``summary.json``.
"""

from __future__ import annotations

import math
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import h5py
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from reproduce import env, experiment_parser, open_results, row, run_parts, sets, write_summary  # noqa: E402

PYTHON = sys.executable
MPIEXEC = str(Path(sys.executable).with_name("mpiexec"))
PARTS = ("profile", "sweep", "scale", "time")
BATCH = 32
BUDGET = 40_960  # samples processed: 80 steps at N = 16
TAU = 4
TARGET = 0.95  # time to 95 % test accuracy (342 of the 360 test images)
TEST_IMAGES = 360
SEEDS = (0, 1, 2)
NETWORK = "eth10g"
BASE = [
    "data.sampler=random",
    "schedule.scale=sqrt",
    "checkpoint.every=0",
    f"train.eval_every={TAU}",
    "train.log_every=100000",
]
OPTIMIZERS = {
    "kfac": ["optimizer.name=kfac", "optimizer.lr=0.002", "kfac.damping=0.01", "kfac.inv_every=10"],
    "sgd": ["optimizer.name=sgd"],
}
LABELS = {"kfac": "K-FAC", "sgd": "SGD (momentum 0.9)"}
CENTRE = {"p": 0.1, "duration": 5, "cap": "N/2"}
#: the one-factor sweeps at N = 16: factor -> values (the others at the centre)
SWEEP = {"p": [0.0, 0.02, 0.05, 0.1, 0.2, 0.4], "duration": [1, 5, 20], "cap": [1, "N/4", "N/2", "N-1"]}
SIZES: dict[str, dict[str, Any]] = {
    "full": {
        "parts": list(PARTS),
        "sweep": SWEEP,
        "seeds": list(SEEDS),
        "real": [4],
        "sim": [64],
        "time": [16, 64],
    },
    # make reproduce: p = 0 and the centre at N = 16, and the time part at N = 16 (about 3 minutes)
    "small": {
        "parts": ["profile", "sweep", "time"],
        "sweep": {"p": [0.0, 0.1]},
        "seeds": list(SEEDS),
        "real": [],
        "sim": [],
        "time": [16],
    },
}
OUT = HERE  # where results.json and the figures go (--reproduce: --work)
JOBS = 2  # simulated runs at once: this machine's cores (their times are virtual)


def cap_of(cap: Any, n: int) -> int:
    """A cap in the study's terms (``N/2``) on ``n`` ranks."""
    if isinstance(cap, int):
        return cap
    return {"N/4": n // 4, "N/2": n // 2, "N-1": n - 1}[cap]


def fault_sets(p: float, duration: int, cap: Any, n: int) -> list[str]:
    if p == 0:
        return []
    return [f"fault.p={p}", f"fault.max_duration={duration}", f"fault.max_concurrent={cap_of(cap, n)}"]


def point(p: float = CENTRE["p"], duration: int = CENTRE["duration"], cap: Any = CENTRE["cap"]) -> dict:
    return {"p": p, "duration": duration, "cap": cap}


def point_name(pt: dict[str, Any]) -> str:
    cap = str(pt["cap"]).replace("/", "").replace("-", "m")
    return f"p{pt['p']}-d{pt['duration']}-c{cap}"


def run_one(work: Path, name: str, n: int, world: str, settings: list[str]) -> dict[str, Any]:
    """One training run (``world``: ``sim`` on ``eth10g`` with the cost table, or ``real``); what the
    study keeps of it."""
    out = work / f"{name}.h5"
    for old in work.glob(f"{name}.*h5"):
        old.unlink()
    train = [
        "-m",
        "hpcdl.train",
        "--config",
        "digits-mlp",
        *sets([*BASE, *settings]),
        "--progress",
        "none",
        "--out",
        str(out),
    ]
    if world == "sim":
        cmd = [
            PYTHON,
            "-m",
            "hpcdl.simulate",
            "-n",
            str(n),
            "--network",
            NETWORK,
            "--compute",
            f"table:{work / 'profile.h5'}",
            *train,
        ]
    else:
        cmd = [MPIEXEC, "-n", str(n), PYTHON, *train]
    t0 = time.monotonic()
    done = subprocess.run(cmd, env=env(), capture_output=True, text=True, check=False)
    r: dict[str, Any] = {
        "name": name,
        "n": n,
        "world": world,
        "settings": settings,
        "exit": done.returncode,
        "wall_s": round(time.monotonic() - t0, 2),
    }
    if done.returncode:
        r["error"] = (done.stderr or done.stdout).strip().splitlines()[-3:]
    if out.exists():
        r.update(read(out))
    return r


def read(path: Path) -> dict[str, Any]:
    """A run file's evaluations, training loss at the end, realised offline fraction and times."""
    with h5py.File(path, "r") as f:
        m = {
            k: f["metrics"][k][...] for k in ("step", "samples", "time", "loss", "test_accuracy", "step_time")
        }
        online = f["ranks/online"][...] if "online" in f["ranks"] else None
        held = f["ranks/held_s"][...] if "held_s" in f["ranks"] else None
    at = np.isfinite(m["test_accuracy"])
    curve = {
        k: m[src][at].tolist()
        for k, src in (
            ("step", "step"),
            ("samples", "samples"),
            ("time", "time"),
            ("accuracy", "test_accuracy"),
        )
    }
    reached = next((i for i, a in enumerate(curve["accuracy"]) if a >= TARGET - 1e-9), None)
    r = {
        "curve": curve,
        "accuracy": curve["accuracy"][-1] if curve["step"] else math.nan,
        "loss": float(np.mean(m["loss"][-TAU:])),
        "offline": float((online == 0).mean()) if online is not None else 0.0,
        "time": float(m["time"][-1]),
        "samples": int(m["samples"][-1]),
        "step_s": float(np.median(m["step_time"])),
        "time_to": curve["time"][reached] if reached is not None else math.inf,
        "samples_to": curve["samples"][reached] if reached is not None else math.inf,
    }
    if online is not None:
        r["offline_steps"] = int((online == 0).any(axis=1).sum())  # steps with some rank offline
    if held is not None:
        r["held_s"] = float(np.nanmax(held, axis=1).sum())
    return r


def many(work: Path, jobs: list[tuple[str, int, str, list[str]]]) -> list[dict[str, Any]]:
    """Run ``jobs`` (name, n, world, settings): simulated ones :data:`JOBS` at a time, real ones alone."""
    sims = [j for j in jobs if j[2] == "sim"]
    with ThreadPoolExecutor(JOBS) as pool:
        done = list(pool.map(lambda j: run_one(work, *j), sims))
    done += [run_one(work, *j) for j in jobs if j[2] != "sim"]
    for r in done:
        if r["exit"]:
            print(f"! {r['name']}: exit {r['exit']}: {r.get('error')}", file=sys.stderr)
    return done


def steps_at(n: int) -> int:
    return BUDGET // (n * BATCH)


def part_profile(work: Path, size: dict[str, Any], results: dict[str, Any]) -> dict[str, Any]:
    """The cost table: one real process, K-FAC, 100 steps with ``profile.layers = true``."""
    r = run_one(work, "profile", 1, "real", [*OPTIMIZERS["kfac"], "train.steps=100", "profile.layers=true"])
    with h5py.File(work / "profile.h5", "r") as f:
        fwd, bwd = f["profile/forward_s"][...], f["profile/backward_s"][...]
        ops = {
            f"{op.decode()} {d.decode()}": float(s)
            for op, d, s in zip(
                f["profile/ops/op"][...], f["profile/ops/dims"][...], f["profile/ops/seconds"][...]
            )
        }
    return {"exit": r["exit"], "forward_backward_s": float(fwd.sum() + bwd.sum()), "ops_s": ops}


def part_sweep(work: Path, size: dict[str, Any], results: dict[str, Any]) -> dict[str, Any]:
    """N = 16, one factor at a time about the centre, K-FAC and SGD, the seeds."""
    n = 16
    points: list[tuple[str, dict[str, Any]]] = []
    for factor, values in size["sweep"].items():
        points += [(factor, point(**{factor: v})) for v in values]
    jobs, meta = [], []
    for opt, opt_sets in OPTIMIZERS.items():
        for factor, pt in points:
            for seed in size["seeds"]:
                name = f"sweep-n{n}-{opt}-{point_name(pt)}-s{seed}"
                settings = [
                    "parallel.strategy=local",
                    f"local.average_every={TAU}",
                    f"train.steps={steps_at(n)}",
                    f"seed={seed}",
                    *opt_sets,
                    *fault_sets(pt["p"], pt["duration"], pt["cap"], n),
                ]
                if name not in {j[0] for j in jobs}:
                    jobs.append((name, n, "sim", settings))
                meta.append((name, {"opt": opt, "factor": factor, **pt, "seed": seed}))
    done = {r["name"]: r for r in many(work, jobs)}
    return {"n": n, "runs": [{**m, **done[name]} for name, m in meta]}


def part_scale(work: Path, size: dict[str, Any], results: dict[str, Any]) -> dict[str, Any]:
    """The centre point and p = 0 at real N = 4 and simulated N = 64."""
    jobs, meta = [], []
    for world, ns in (("real", size["real"]), ("sim", size["sim"])):
        for n in ns:
            for opt, opt_sets in OPTIMIZERS.items():
                for pt in (point(p=0.0), point()):
                    for seed in size["seeds"]:
                        name = f"scale-{world}-n{n}-{opt}-{point_name(pt)}-s{seed}"
                        settings = [
                            "parallel.strategy=local",
                            f"local.average_every={TAU}",
                            f"train.steps={steps_at(n)}",
                            f"seed={seed}",
                            *opt_sets,
                            *fault_sets(pt["p"], pt["duration"], pt["cap"], n),
                        ]
                        jobs.append((name, n, world, settings))
                        meta.append({"opt": opt, **pt, "seed": seed, "world": world, "n": n})
    return {"runs": [{**m, **r} for m, r in zip(meta, many(work, jobs))]}


def part_time(work: Path, size: dict[str, Any], results: dict[str, Any]) -> dict[str, Any]:
    """Centre point at N = 16 and 64 on eth10g: local, sync waiting out the schedule, sync without
    faults; K-FAC and SGD, the seeds."""
    cases = [(n, opt, seed) for n in size["time"] for opt in OPTIMIZERS for seed in size["seeds"]]

    def job(kind: str, n: int, opt: str, seed: int, *more: str) -> tuple[str, int, str, list[str]]:
        centre = fault_sets(CENTRE["p"], CENTRE["duration"], CENTRE["cap"], n)
        settings = {
            "local": ["parallel.strategy=local", f"local.average_every={TAU}", *centre],
            "sync": ["parallel.strategy=sync", *centre],
            "sync-free": ["parallel.strategy=sync"],
        }[kind]
        common = [f"train.steps={steps_at(n)}", f"seed={seed}", *OPTIMIZERS[opt]]
        return f"time-n{n}-{opt}-{kind}-s{seed}", n, "sim", [*settings, *common, *more]

    first = many(work, [job(kind, *c) for c in cases for kind in ("sync-free", "local")])
    runs = [
        {"n": n, "opt": opt, "seed": seed, "kind": kind, **r}
        for (n, opt, seed), kind, r in zip(
            [c for c in cases for _ in range(2)], ["sync-free", "local"] * len(cases), first
        )
    ]
    free = {(r["n"], r["opt"], r["seed"]): r for r in runs if r["kind"] == "sync-free"}
    holds = {c: free[c]["step_s"] for c in cases}
    synced = many(work, [job("sync", *c, f"fault.step_s={holds[c]!r}") for c in cases])
    for c, r in zip(cases, synced):
        r.update(n=c[0], opt=c[1], seed=c[2], kind="sync", hold_s=holds[c])
        if "offline_steps" in r:
            r["model_time"] = free[c]["time"] + holds[c] * r["offline_steps"]
        runs.append(r)
    return {"runs": runs}


# -- tables and figures -------------------------------------------------------------------------


def med(values: list[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return statistics.median(finite) if finite else math.nan


def sweep_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Per optimizer, factor and value: medians over seeds of accuracy, loss and offline fraction."""
    rows: dict[tuple, dict[str, Any]] = {}
    for r in results.get("sweep", {}).get("runs", []):
        key = (r["opt"], r["factor"], r["p"], r["duration"], str(r["cap"]))
        rows.setdefault(
            key,
            {
                "opt": r["opt"],
                "factor": r["factor"],
                "p": r["p"],
                "duration": r["duration"],
                "cap": r["cap"],
                "runs": [],
            },
        )["runs"].append(r)
    out = []
    for row_ in rows.values():
        rs = row_.pop("runs")
        row_.update(
            accuracy=med([r["accuracy"] for r in rs]),
            loss=med([r["loss"] for r in rs]),
            offline=med([r["offline"] for r in rs]),
            seeds=len(rs),
            accuracies=[r["accuracy"] for r in rs],
        )
        out.append(row_)
    return out


def baseline(rows: list[dict[str, Any]], opt: str) -> dict[str, Any] | None:
    return next((r for r in rows if r["opt"] == opt and r["p"] == 0), None)


def tables(results: dict[str, Any]) -> str:
    lines = []
    rows = sweep_rows(results)
    if rows:
        lines += [
            f"Simulated N = 16, `{NETWORK}`, {BUDGET:,} samples; medians of {len(SEEDS)} seeds "
            "(accuracy: each seed's in brackets)",
            "",
            "| optimizer | varied | p | max duration | cap | offline fraction | test accuracy % | "
            "vs p = 0 (points) | training loss |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in sorted(
            rows,
            key=lambda r: (
                r["opt"],
                list(SWEEP).index(r["factor"]),
                r["p"],
                r["duration"],
                _cap_order(r["cap"]),
            ),
        ):
            base = baseline(rows, r["opt"])
            diff = 100 * (r["accuracy"] - base["accuracy"]) if base else math.nan
            each = ", ".join(f"{100 * a:.2f}" for a in r["accuracies"])
            lines.append(
                f"| {LABELS[r['opt']]} | {r['factor']} | {r['p']} | {r['duration']} | {r['cap']} | "
                f"{r['offline']:.3f} | {100 * r['accuracy']:.2f} ({each}) | {diff:+.2f} | "
                f"{r['loss']:.4f} |"
            )
    scale = results.get("scale", {}).get("runs", [])
    if scale:
        lines += [
            "",
            f"Centre point and p = 0 at {BUDGET:,} samples, medians of {len(SEEDS)} seeds",
            "",
            "| world | N | optimizer | p | offline fraction | test accuracy % | vs p = 0 (points) | "
            "training loss |",
            "|---|---|---|---|---|---|---|---|",
        ]
        groups: dict[tuple, list] = {}
        for r in scale:
            groups.setdefault((r["world"], r["n"], r["opt"], r["p"]), []).append(r)
        for (world, n, opt, p), rs in sorted(groups.items()):
            base = groups.get((world, n, opt, 0.0), [])
            diff = 100 * (med([r["accuracy"] for r in rs]) - med([r["accuracy"] for r in base]))
            lines.append(
                f"| {world} | {n} | {LABELS[opt]} | {p} | {med([r['offline'] for r in rs]):.3f} | "
                f"{100 * med([r['accuracy'] for r in rs]):.2f} | {diff:+.2f} | "
                f"{med([r['loss'] for r in rs]):.4f} |"
            )
    timed = results.get("time", {}).get("runs", [])
    if timed:
        lines += [
            f"Time to {100 * TARGET:.0f} % test accuracy (simulated, `{NETWORK}`, centre point), and sync's "
            f"time against the wait model; medians of {len(SEEDS)} seeds",
            "",
            "| N | optimizer | local | sync waiting | sync without faults | sync waiting: whole run, "
            "simulated | wait model | model error |",
            "|---|---|---|---|---|---|---|---|",
        ]
        groups = {}
        for r in timed:
            groups.setdefault((r["n"], r["opt"]), {}).setdefault(r["kind"], []).append(r)
        for (n, opt), kinds in sorted(groups.items()):
            sync = kinds.get("sync", [])
            err = med([r["time"] / r["model_time"] - 1 for r in sync if "model_time" in r])
            to = {
                k: _s(med([r["time_to"] for r in kinds.get(k, [])])) for k in ("local", "sync", "sync-free")
            }
            lines.append(
                f"| {n} | {LABELS[opt]} | {to['local']} | {to['sync']} | {to['sync-free']} | "
                f"{_s(med([r['time'] for r in sync]))} | {_s(med([r['model_time'] for r in sync]))} | "
                f"{100 * err:+.2f} % |"
            )
    return "\n".join(lines)


def _cap_order(cap: Any) -> int:
    return cap if isinstance(cap, int) else {"N/4": 100, "N/2": 200, "N-1": 300}[cap]


def _s(x: float) -> str:
    return "not reached" if math.isinf(x) else f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s"


def figures(results: dict[str, Any]) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    rows = sweep_rows(results)
    if rows:
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
        for ax, opt in zip(axes, OPTIMIZERS):
            for factor, marker in zip(SWEEP, "os^"):
                mine = sorted(
                    (r for r in rows if r["opt"] == opt and r["factor"] == factor), key=lambda r: r["offline"]
                )
                if not mine:
                    continue
                ax.plot(
                    [r["offline"] for r in mine],
                    [100 * r["accuracy"] for r in mine],
                    marker + "-",
                    label=f"{factor} varied",
                )
                for r in mine:
                    ax.annotate(
                        str(r[factor]),
                        (r["offline"], 100 * r["accuracy"]),
                        fontsize="x-small",
                        xytext=(3, 3),
                        textcoords="offset points",
                    )
            ax.set_title(f"{LABELS[opt]}, N = 16 simulated, {BUDGET:,} samples", fontsize="medium")
            ax.set_xlabel("realised offline fraction of rank-steps (median of 3 seeds)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize="small")
        axes[0].set_ylabel("test accuracy % (median of 3 seeds)")
        fig.tight_layout()
        fig.savefig(OUT / "accuracy-offline.png", dpi=110)
        plt.close(fig)
    timed = results.get("time", {}).get("runs", [])
    if timed:
        ns = sorted({r["n"] for r in timed})
        fig, axes = plt.subplots(len(OPTIMIZERS), len(ns), figsize=(6 * len(ns), 8), squeeze=False)
        for i, opt in enumerate(OPTIMIZERS):
            for j, n in enumerate(ns):
                ax = axes[i][j]
                for kind, style in (("local", "-"), ("sync", "--"), ("sync-free", ":")):
                    r = next(
                        (r for r in timed if (r["n"], r["opt"], r["kind"], r["seed"]) == (n, opt, kind, 0)),
                        None,
                    )
                    if r is not None and r.get("curve"):
                        ax.plot(
                            r["curve"]["time"],
                            [100 * a for a in r["curve"]["accuracy"]],
                            style,
                            marker=".",
                            label=f"{kind} ({r['offline']:.0%} offline)",
                        )
                ax.axhline(100 * TARGET, color="grey", lw=0.8)
                ax.set_ylim(80, 100)
                ax.set_title(f"{LABELS[opt]}, N = {n}, seed 0", fontsize="medium")
                ax.set_xlabel(f"simulated time (s), {NETWORK}")
                ax.set_ylabel("test accuracy %")
                ax.grid(alpha=0.3)
                ax.legend(fontsize="small")
        fig.tight_layout()
        fig.savefig(OUT / "accuracy-time.png", dpi=110)
        plt.close(fig)


def schedule_figure(work: Path) -> None:
    """``schedule.png``: the report's fault figure (:func:`hpcdl.parallel.fault.faults_figure`) for
    seed 0 of K-FAC at N = 16: local at the centre point, local at p = 0, and sync waiting out
    the same schedule (its trajectory is sync's without faults)."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    from hpcdl.parallel.fault import faults_figure  # noqa: PLC0415
    from hpcdl.report import load  # noqa: PLC0415

    centre = point_name(point())
    names = {
        f"sweep-n16-kfac-{centre}-s0": "local, centre",
        f"sweep-n16-kfac-{point_name(point(p=0.0))}-s0": "local, p = 0",
        "time-n16-kfac-sync-s0": "sync waiting, centre",
    }
    runs = [(load(work / f"{n}.h5"), label) for n, label in names.items() if (work / f"{n}.h5").exists()]
    fig = faults_figure(runs) if runs else None
    if fig is not None:
        fig.tight_layout()
        fig.savefig(OUT / "schedule.png", dpi=100)
        plt.close(fig)


def comparisons(results: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    rows = sweep_rows(results)
    for opt in OPTIMIZERS:
        base = baseline(rows, opt)
        centre = next(
            (r for r in rows if r["opt"] == opt and r["factor"] == "p" and r["p"] == CENTRE["p"]), None
        )
        if base and centre:
            diff = 100 * (centre["accuracy"] - base["accuracy"])
            out.append(
                row(
                    "sweep table",
                    f"{LABELS[opt]} local, centre point vs p = 0, N = 16 sim, {BUDGET} samples (points)",
                    round(diff, 2),
                    "within 1 point" if opt == "kfac" else "(reported)",
                    diff >= -1 if opt == "kfac" else None,
                    "median of 3 seeds",
                )
            )
    for world, n in {(r["world"], r["n"]) for r in results.get("scale", {}).get("runs", [])}:
        rs = [r for r in results["scale"]["runs"] if (r["world"], r["n"], r["opt"]) == (world, n, "kfac")]
        diff = 100 * (
            med([r["accuracy"] for r in rs if r["p"]]) - med([r["accuracy"] for r in rs if not r["p"]])
        )
        out.append(
            row(
                "scale table",
                f"K-FAC local, centre vs p = 0, {world} N = {n} (points)",
                round(diff, 2),
                "within 1 point",
                diff >= -1,
                "median of 3 seeds",
            )
        )
    for r in results.get("time", {}).get("runs", []):
        if r["kind"] == "sync" and "model_time" in r and r["seed"] == 0:
            err = r["time"] / r["model_time"] - 1
            out.append(
                row(
                    "time table",
                    f"sync under faults, simulated vs wait model, N = {r['n']}, {LABELS[r['opt']]}, seed 0",
                    f"{100 * err:+.2f} %",
                    "within 2 %",
                    abs(err) <= 0.02,
                    "|simulated / model - 1|",
                )
            )
    return out


def main(argv: list[str] | None = None) -> int:
    global OUT
    parser = experiment_parser(__doc__, list(PARTS), list(PARTS), list(SIZES))
    args = parser.parse_args(argv)
    size, OUT, results_path, results = open_results(args, SIZES, OUT)
    if args.tables:
        print(tables(results))
        return 0
    if not args.figures_only:
        if args.work is None:
            parser.error("--work is needed to run parts")
        args.work.mkdir(parents=True, exist_ok=True)
        if "profile" not in args.parts and not (args.work / "profile.h5").exists():
            args.parts = ["profile", *args.parts]
        work = args.work

        def part(name: str) -> dict[str, Any]:
            return globals()[f"part_{name}"](work, size, results)

        run_parts(args.parts, results, results_path, part)
    figures(results)
    if args.work is not None and args.work.exists():
        schedule_figure(args.work)
    if args.reproduce:
        write_summary(args.work, HERE.name, args.reproduce, comparisons(results), sizes=size)
    print(tables(results))
    for r in comparisons(results):
        print(f"{r['verdict']:>14}: {r['figure']}: {r['quantity']}: {r['measured']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
