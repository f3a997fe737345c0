"""K-FAC against SGD with momentum and Adam on the digits (issue 24, item 4).

Every training run is ``mpiexec -n 2 python -m hpcdl.train`` (real, this machine's two cores),
``parallel.strategy = "sync"``, evaluated every 10 steps (``train.eval_every = 10``); every
timing of K-FAC's step is ``python -m hpcdl.bench train --set optimizer.name=kfac`` (K-FAC's
share split beside an SGD twin), under ``mpiexec -n 2`` or simulated (``python -m
hpcdl.simulate -n N --compute table:...``). Parts:

* ``look``: the quick look that chose the grids' ranges: digits-cnn, one seed, 8 epochs, each
  optimizer at learning rates a decade apart (:data:`LOOK`).
* ``grid``: digits-cnn and digits-mlp, each optimizer with the same budget of 6 settings
  (:data:`GRIDS`: SGD 6 learning rates, K-FAC 3 learning rates x 2 dampings, Adam 6 learning
  rates), seeds 0-2, :data:`EPOCHS` epochs (the preset's cosine schedule with 2 warm-up
  epochs, linear scaling: the rate x 2 at -n 2). Per setting: the median over seeds of the
  samples (and training seconds) to 98 % test accuracy, the first evaluation from which 353 of
  the 360 test images are right for three evaluations in a row.
* ``wall``: the timed comparison on digits-cnn: the grid's best SGD and best K-FAC (at
  ``inv_every = 10``), K-FAC at ``inv_every = 100``, and at 100 with ``factor_every = 10``; per
  seed one run of each in turn (the machine's drifts hit them alike).
* ``split``: K-FAC's share of a digits-cnn step at -n 2 (``inv_every``, ``factor_every``) in
  :data:`SPLIT_VARIANTS` x ``grad_workers`` 1 and 2, beside SGD's step in the same run.
* ``profile``: a cost table: one process, K-FAC, ``profile.layers = true`` (layers and K-FAC's
  ops, measured at the sizes digits-cnn has).
* ``sim``: ``bench train`` on N = 8 and 32 simulated ranks, ``eth10g`` and ``ib-hdr``, compute
  from that table, ``grad_workers`` 1, 2, 4 and N: step time, K-FAC's split, the bytes factors,
  eigenbases and gradients move.

    python jobs/experiments/kfac/run.py --work /tmp/kfac                     # every part
    python jobs/experiments/kfac/run.py --work /tmp/kfac --parts split sim
    python jobs/experiments/kfac/run.py --tables                             # the README's tables
    python jobs/experiments/kfac/run.py --reproduce small --work /tmp/kfac   # make reproduce

Rows go to ``results.json`` beside this script (each part replaces its own entry), figures to
``*.png`` beside it; run files stay in ``--work``. With ``--reproduce SIZE`` everything goes to
``--work`` with ``summary.json``, the comparisons of :func:`comparisons`.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import h5py
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from reproduce import (  # noqa: E402
    QUIET_CORES,
    env,
    experiment_parser,
    open_results,
    other_cores,
    row,
    run_parts,
    sets,
    write_summary,
)

#: the parts bench train splits K-FAC's share of a step into (its JSON's ``<part>_s`` keys)
SPLIT_PARTS = ("factors", "exchange", "fold", "decompose", "broadcast_eigen", "precondition",
               "broadcast_grads", "update", "other")  # fmt: skip
PYTHON = sys.executable
MPIEXEC = str(Path(sys.executable).with_name("mpiexec"))
PARTS = ("look", "grid", "wall", "split", "profile", "sim")
RANKS = 2  # real runs: mpiexec -n 2 (this machine's cores)
TEST_IMAGES, NEED, NEED_97 = 360, 353, 350  # 98 % and 97 % of the digits' 360 test images, rounded up
IN_A_ROW = 3
EPOCHS = 15
SEEDS = (0, 1, 2)
MODELS = ("digits-cnn", "digits-mlp")
BASE = ["checkpoint.every=0", "train.log_every=100000", "train.eval_every=10"]
#: the quick look: a decade apart, one seed, 8 epochs, digits-cnn
LOOK: dict[str, list[list[str]]] = {
    "sgd": [[f"optimizer.lr={lr}"] for lr in (0.005, 0.05, 0.5)],
    "adam": [[f"optimizer.lr={lr}"] for lr in (1e-4, 1e-3, 1e-2)],
    "kfac": [[f"optimizer.lr={lr}", "kfac.damping=0.001"] for lr in (0.005, 0.05, 0.5)],
}
#: the grids: 6 settings each (chosen from the look: the README says how)
GRIDS: dict[str, list[list[str]]] = {
    "sgd": [[f"optimizer.lr={lr}"] for lr in (0.00625, 0.0125, 0.025, 0.05, 0.1, 0.2)],
    "kfac": [
        [f"optimizer.lr={lr}", f"kfac.damping={d}"] for lr in (0.002, 0.005, 0.0125) for d in (1e-3, 1e-2)
    ],
    "adam": [[f"optimizer.lr={lr}"] for lr in (1.25e-3, 2.5e-3, 5e-3, 1e-2, 2e-2, 4e-2)],
}
OPTIMIZER = {"sgd": ["optimizer.name=sgd"], "adam": ["optimizer.name=adam"], "kfac": ["optimizer.name=kfac"]}
LABELS = {"sgd": "SGD (momentum 0.9)", "adam": "Adam", "kfac": "K-FAC"}
#: split: K-FAC's share at -n 2; sim: N x networks x grad_workers
INV_EVERY = (10, 100)
#: (inv_every, factor_every) of the split: the issue's two, and factors collected every 10 steps
SPLIT_VARIANTS = ((10, 1), (100, 1), (100, 10))
SPLIT = {"repeat": 5, "steps": 20}  # 100 measured steps: 10 and 1 decompositions, exactly amortised
SIM_RANKS = (8, 32)
NETWORKS = ("eth10g", "ib-hdr")
SIM = {"repeat": 1, "steps": 20}  # t = 3 .. 22 measured: 2 decompositions at inv_every 10
#: what the small size (make reproduce) takes from the full run: each optimizer's best setting
BEST = {"sgd": ["optimizer.lr=0.025"], "kfac": ["optimizer.lr=0.002", "kfac.damping=0.01"]}
#: full: the README's (about 25 minutes here); small: digits-cnn's timed comparison alone, with
#: the grid's best settings (BEST), 8 epochs (98 % comes after 3 to 6), the split at grad_workers
#: 1, and N = 8 on eth10g (about 3 minutes)
SIZES: dict[str, dict[str, Any]] = {
    "full": {"parts": ["grid", "wall", "split", "profile", "sim"], "models": list(MODELS),
             "seeds": list(SEEDS),
             "epochs": EPOCHS, "split_variants": SPLIT_VARIANTS, "split_workers": [1, RANKS],
             "sim_ranks": list(SIM_RANKS), "networks": list(NETWORKS), "grid": True},
    "small": {"parts": ["wall", "split", "profile", "sim"], "models": ["digits-cnn"], "seeds": list(SEEDS),
              "epochs": 8, "split_variants": SPLIT_VARIANTS[:2], "split_workers": [1], "sim_ranks": [8],
              "networks": ["eth10g"], "grid": False},
}  # fmt: skip
OUT = HERE  # where results.json and the figures go (--reproduce: --work)


def tag(settings: list[str]) -> str:
    return ",".join(s.split(".", 1)[1] for s in settings)


def run(cmd: list[str]) -> tuple[subprocess.CompletedProcess, float, float]:
    """Run ``cmd`` to completion; its result, wall seconds and the cores other processes kept busy."""
    with other_cores() as busy:
        t0 = time.monotonic()
        done = subprocess.run(cmd, env=env(), capture_output=True, text=True, check=False)
        wall = time.monotonic() - t0
    if done.returncode:
        print(done.stderr[-2000:], file=sys.stderr, flush=True)
    return done, wall, busy["other_cores"]


# -- training runs ---------------------------------------------------------------------------------


def train(work: Path, name: str, model: str, settings: list[str]) -> dict[str, Any]:
    """One ``mpiexec -n 2 python -m hpcdl.train`` run; what the study keeps of it."""
    out = work / f"{name}.h5"
    for old in work.glob(f"{name}.*h5"):  # the run file and checkpoints of an interrupted run
        old.unlink()
    cmd = [
        MPIEXEC,
        "-n",
        str(RANKS),
        PYTHON,
        "-m",
        "hpcdl.train",
        "--config",
        model,
        *sets([*BASE, *settings]),
        "--progress",
        "none",
        "--out",
        str(out),
    ]
    done, wall, busy = run(cmd)
    r: dict[str, Any] = {
        "name": name,
        "model": model,
        "settings": settings,
        "exit": done.returncode,
        "wall_s": round(wall, 2),
        "other_cores": busy,
    }
    if out.exists():
        r.update(read(out))
    return r


def read(path: Path) -> dict[str, Any]:
    """The evaluations of a run file: samples, seconds since the start, training seconds (the
    steps' own times summed: evaluations left out), test accuracy; and what the study derives."""
    with h5py.File(path, "r") as f:
        m = {k: f["metrics"][k][...] for k in ("step", "samples", "time", "step_time", "test_accuracy")}
        status = str(f.attrs.get("status"))
    at = np.isfinite(m["test_accuracy"])
    curve = {
        "step": m["step"][at].tolist(),
        "samples": m["samples"][at].tolist(),
        "time": m["time"][at].tolist(),
        "train_time": np.cumsum(m["step_time"])[at].tolist(),
        "accuracy": m["test_accuracy"][at].tolist(),
    }
    return {
        "status": status,
        "curve": curve,
        "final_accuracy": curve["accuracy"][-1] if curve["step"] else math.nan,
        "step_s": float(np.median(m["step_time"])) if len(m["step_time"]) else math.nan,
        **reached(curve),
    }


def reached(curve: dict[str, list[float]], need: int = NEED) -> dict[str, float]:
    """Samples, seconds since the start and training seconds at the first evaluation from which
    at least ``need`` of the TEST_IMAGES are right for IN_A_ROW evaluations in a row (inf: never)."""
    good = [round(a * TEST_IMAGES) >= need for a in curve["accuracy"]]
    for i in range(len(good) - IN_A_ROW + 1):
        if all(good[i : i + IN_A_ROW]):
            return {
                "samples_to": curve["samples"][i],
                "time_to": curve["time"][i],
                "train_time_to": curve["train_time"][i],
                "step_to": curve["step"][i],
            }
    return {"samples_to": math.inf, "time_to": math.inf, "train_time_to": math.inf, "step_to": math.inf}


def median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else math.nan


def setting_rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (model, optimizer, setting, inv_every): the medians over its seeds."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault(
            (r["model"], r["optimizer"], tag(r["grid_settings"]), r.get("inv_every")), []
        ).append(r)
    out = []
    for (model, opt, setting, inv), rs in groups.items():
        out.append(
            {
                "model": model,
                "optimizer": opt,
                "setting": setting,
                "inv_every": inv,
                "seeds": len(rs),
                "reached": sum(math.isfinite(r["samples_to"]) for r in rs),
                **{
                    k: median([r[k] for r in rs])
                    for k in (
                        "samples_to",
                        "time_to",
                        "train_time_to",
                        "final_accuracy",
                        "step_s",
                        "other_cores",
                    )
                },
                "max_other_cores": max(r["other_cores"] for r in rs),
                # 97 % (350 of 360): digits-mlp holds 98 % rarely
                "samples_to_97": median(
                    [reached(r["curve"], NEED_97)["samples_to"] for r in rs if "curve" in r]
                ),
            }
        )
    return out


def best(
    settings: list[dict[str, Any]], model: str, optimizer: str, inv: int | None = None
) -> dict[str, Any]:
    """The setting with the fewest median samples to 98 % (then the higher median final accuracy)."""
    mine = [
        s for s in settings if s["model"] == model and s["optimizer"] == optimizer and s["inv_every"] == inv
    ]
    return min(mine, key=lambda s: (s["samples_to"], -s["final_accuracy"]))


def grid_runs(
    work: Path,
    model: str,
    grids: dict[str, list[list[str]]],
    seeds: list[int],
    epochs: int,
    prefix: str,
    inv_every: int | None = None,
) -> list[dict[str, Any]]:
    runs = []
    for opt, grid in grids.items():
        for settings in grid:
            for seed in seeds:
                extra = [f"kfac.inv_every={inv_every}"] if inv_every and opt == "kfac" else []
                inv = f"-inv{inv_every}" if extra else ""
                name = f"{prefix}-{model}-{opt}-{tag(settings)}{inv}-s{seed}"
                r = train(
                    work,
                    name,
                    model,
                    [*OPTIMIZER[opt], *settings, *extra, f"train.epochs={epochs}", f"seed={seed}"],
                )
                r.update(
                    optimizer=opt,
                    grid_settings=settings,
                    seed=seed,
                    inv_every=(inv_every or 10) if opt == "kfac" else None,
                )
                print(
                    f"{name}: exit {r['exit']} samples to 98 % {r.get('samples_to')} train s "
                    f"{r.get('train_time_to', math.nan):.2f} final {r.get('final_accuracy', math.nan):.4f} "
                    f"wall {r['wall_s']} s, other cores {r['other_cores']}",
                    flush=True,
                )
                runs.append(r)
    return runs


def part_look(work: Path, size: dict[str, Any]) -> dict[str, Any]:
    runs = grid_runs(work, "digits-cnn", LOOK, [0], 8, "look")
    return {"epochs": 8, "runs": runs, "settings": setting_rows(runs)}


def part_grid(work: Path, size: dict[str, Any]) -> dict[str, Any]:
    grids = GRIDS if size["grid"] else {k: [v] for k, v in BEST.items()}
    runs = []
    for model in size["models"]:
        runs += grid_runs(work, model, grids, size["seeds"], size["epochs"], "grid")
    return {"epochs": size["epochs"], "grids": grids, "runs": runs, "settings": setting_rows(runs)}


def part_wall(work: Path, size: dict[str, Any], results: dict[str, Any]) -> dict[str, Any]:
    """The timed comparison, digits-cnn at -n 2: the best SGD and the best K-FAC of the grid (at
    inv_every 10), K-FAC at inv_every 100, and at 100 with factors every 10 steps; per seed one
    run of each in turn, so that a drift of the machine hits them alike."""
    sgd, kfac = best_settings(results, "sgd"), best_settings(results, "kfac")
    variants = [("sgd", sgd, None), ("kfac", kfac, 10), ("kfac", kfac, 100),
                ("kfac", [*kfac, "kfac.factor_every=10"], 100)]  # fmt: skip
    runs = []
    for seed in size["seeds"]:
        for opt, settings, inv in variants:
            runs += grid_runs(
                work, "digits-cnn", {opt: [settings]}, [seed], size["epochs"], "wall", inv_every=inv
            )
    return {"epochs": size["epochs"], "runs": runs, "settings": setting_rows(runs)}


# -- K-FAC's step --------------------------------------------------------------------------------


def bench(work: Path, name: str, settings: list[str], sim: list[str] | None, counts: dict[str, int]) -> dict:
    """``bench train`` on digits-cnn with K-FAC (beside its SGD twin): the K-FAC row, the SGD step."""
    out = work / f"{name}.json"
    out.unlink(missing_ok=True)
    args = [
        "-m",
        "hpcdl.bench",
        "train",
        "--config",
        "digits-cnn",
        *sets(["optimizer.name=kfac", *settings]),
        "--repeat",
        str(counts["repeat"]),
        "--steps",
        str(counts["steps"]),
        "--json",
        str(out),
    ]
    cmd = [PYTHON, "-m", "hpcdl.simulate", *sim, *args] if sim else [MPIEXEC, "-n", str(RANKS), PYTHON, *args]
    done, wall, busy = run(cmd)
    r: dict[str, Any] = {
        "name": name,
        "settings": settings,
        "sim": sim,
        "exit": done.returncode,
        "wall_s": round(wall, 2),
        "other_cores": busy,
    }
    if out.exists():
        rows = {x["impl"]: x for x in json.loads(out.read_text())}
        r.update(kfac=rows["hpcdl-kfac"], sgd_step_s=rows["hpcdl"]["step_s"])
    k = r.get("kfac", {})
    print(
        f"{name}: exit {r['exit']} step {1e3 * k.get('step_s', math.nan):.2f} ms (SGD "
        f"{1e3 * r.get('sgd_step_s', math.nan):.2f}), K-FAC share {1e3 * k.get('kfac_s', math.nan):.2f} ms, "
        f"wall {r['wall_s']} s, other cores {busy}",
        flush=True,
    )
    return r


def best_settings(results: dict[str, Any], optimizer: str) -> list[str]:
    """The best digits-cnn setting of ``optimizer`` in the grid (BEST's at the small size)."""
    grid = results.get("grid")
    if not grid or len(grid["grids"][optimizer]) == 1:
        return BEST[optimizer]
    top = best(grid["settings"], "digits-cnn", optimizer, 10 if optimizer == "kfac" else None)
    return next(
        r["grid_settings"]
        for r in grid["runs"]
        if r["optimizer"] == optimizer
        and r["model"] == "digits-cnn"
        and tag(r["grid_settings"]) == top["setting"]
    )


def best_kfac(results: dict[str, Any]) -> list[str]:
    return best_settings(results, "kfac")


def part_split(work: Path, size: dict[str, Any], results: dict[str, Any]) -> dict[str, Any]:
    rows = []
    for inv, every in size["split_variants"]:
        for k in size["split_workers"]:
            settings = [*best_kfac(results), f"kfac.inv_every={inv}", f"kfac.factor_every={every}"]
            r = bench(
                work, f"split-inv{inv}-f{every}-k{k}", [*settings, f"kfac.grad_workers={k}"], None, SPLIT
            )
            r.update(ranks=RANKS, inv_every=inv, factor_every=every, grad_workers=k, network="real")
            rows.append(r)
    return {"rows": rows}


def part_profile(work: Path, size: dict[str, Any], results: dict[str, Any]) -> dict[str, Any]:
    """The cost table: one process, K-FAC, 40 steps with ``profile.layers = true``."""
    out = work / "profile.h5"
    out.unlink(missing_ok=True)
    cmd = [
        PYTHON,
        "-m",
        "hpcdl.train",
        "--config",
        "digits-cnn",
        *sets(
            [
                "optimizer.name=kfac",
                *best_kfac(results),
                "train.steps=40",
                "profile.layers=true",
                "checkpoint.every=0",
                "train.eval_every=100000",
            ]
        ),
        "--progress",
        "none",
        "--out",
        str(out),
    ]
    done, wall, busy = run(cmd)
    with h5py.File(out) as f:
        layers = {k: float(np.sum(f["profile"][k][...])) for k in ("forward_s", "backward_s")}
        ops = {k: _plain(f["profile/ops"][k][...]) for k in f["profile/ops"]} if "ops" in f["profile"] else {}
    return {
        "table": str(out),
        "exit": done.returncode,
        "wall_s": round(wall, 2),
        "other_cores": busy,
        "layers_s": layers,
        "ops": ops,
    }


def _plain(values: np.ndarray) -> list[Any]:
    """A dataset's values for JSON (strings decoded)."""
    return [v.decode() if isinstance(v, bytes) else v for v in values.tolist()]


def part_sim(work: Path, size: dict[str, Any], results: dict[str, Any]) -> dict[str, Any]:
    rows = []
    table = f"table:{work / 'profile.h5'}"
    for n in size["sim_ranks"]:
        workers = sorted({1, 2, 4, n}) if size["grid"] else [1, n]
        for net in size["networks"]:
            for k in workers:
                sim = ["-n", str(n), "--network", net, "--compute", table]
                settings = [
                    *best_kfac(results),
                    "kfac.inv_every=10",
                    f"kfac.grad_workers={k}",
                    "data.sampler=random",
                ]
                r = bench(work, f"sim-n{n}-{net}-k{k}", settings, sim, SIM)
                r.update(ranks=n, inv_every=10, grad_workers=k, network=net)
                rows.append(r)
    return {"rows": rows}


# -- figures and tables ---------------------------------------------------------------------------


def curves(results: dict[str, Any], model: str, opt: str, setting: str, inv: int | None, part: str = "grid"):
    runs = [
        r
        for r in results.get(part, {}).get("runs", [])
        if r["model"] == model
        and r["optimizer"] == opt
        and tag(r["grid_settings"]) == setting
        and r.get("inv_every") == inv
        and "curve" in r
    ]
    if not runs:
        return None
    n = min(len(r["curve"]["accuracy"]) for r in runs)
    pick = {
        k: np.median([r["curve"][k][:n] for r in runs], axis=0) for k in ("samples", "train_time", "accuracy")
    }
    pick["lo"] = np.min([r["curve"]["accuracy"][:n] for r in runs], axis=0)
    pick["hi"] = np.max([r["curve"]["accuracy"][:n] for r in runs], axis=0)
    return pick


def figures(results: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = results.get("grid")
    if grid:
        settings = grid["settings"]
        models = [m for m in MODELS if any(s["model"] == m for s in settings)]
        for xkey, xlabel, fname in (
            ("samples", "training samples", "accuracy-samples.png"),
            ("train_time", "training seconds (-n 2, evaluations left out)", "accuracy-time.png"),
        ):
            fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.2), squeeze=False)
            for ax, model in zip(axes[0], models):
                lines = [
                    (opt, best(settings, model, opt, 10 if opt == "kfac" else None), "grid")
                    for opt in GRIDS
                    if any(s["model"] == model and s["optimizer"] == opt for s in settings)
                ]
                wall = results.get("wall")
                if wall and model == "digits-cnn" and xkey == "train_time":  # the timed runs
                    lines = [(w["optimizer"], w, "wall") for w in wall["settings"]]
                for opt, s, part in lines:
                    c = curves(results, model, opt, s["setting"], s["inv_every"], part)
                    if c is None:
                        continue
                    label = f"{LABELS[opt]} {s['setting']}" + (
                        f", inv_every {s['inv_every']}" if s["inv_every"] else ""
                    )
                    (line,) = ax.plot(c[xkey], 100 * c["accuracy"], label=label, lw=1.3)
                    ax.fill_between(c[xkey], 100 * c["lo"], 100 * c["hi"], color=line.get_color(), alpha=0.15)
                ax.axhline(100 * NEED / TEST_IMAGES, color="grey", ls=":", lw=1)
                ax.set_ylim(90, 100)
                ax.set_xlabel(xlabel)
                ax.set_ylabel("test accuracy %")
                ax.set_title(
                    f"{model}: each optimizer's best setting (median of {len(SEEDS)} seeds; band: min-max)",
                    fontsize=9,
                )
                ax.legend(fontsize=7, loc="lower right")
                ax.grid(alpha=0.3)
            fig.tight_layout()
            fig.savefig(OUT / fname, dpi=110)
            plt.close(fig)
    rows = [*results.get("split", {}).get("rows", []), *results.get("sim", {}).get("rows", [])]
    rows = [r for r in rows if "kfac" in r and r["inv_every"] == 10 and r.get("factor_every", 1) == 1]
    if rows:
        groups = sorted({(r["ranks"], r["network"]) for r in rows}, key=lambda g: (g[0], g[1]))
        fig, axes = plt.subplots(1, len(groups), figsize=(3.2 * len(groups), 4.2), squeeze=False)
        parts = ("factors", "exchange", "decompose", "broadcast_eigen", "precondition", "broadcast_grads")
        colors = plt.get_cmap("tab10").colors
        for ax, (n, net) in zip(axes[0], groups):
            mine = sorted(
                (r for r in rows if (r["ranks"], r["network"]) == (n, net)), key=lambda r: r["grad_workers"]
            )
            x = np.arange(len(mine))
            bottom = np.zeros(len(mine))
            for i, p in enumerate(parts):
                h = np.array([1e3 * r["kfac"][p + "_s"] for r in mine])
                ax.bar(x, h, bottom=bottom, color=colors[i], label=p if ax is axes[0][0] else None)
                bottom += h
            rest = np.array([1e3 * (r["kfac"]["step_s"]) for r in mine]) - bottom
            ax.bar(
                x,
                rest,
                bottom=bottom,
                color="lightgrey",
                label="rest of the step" if ax is axes[0][0] else None,
            )
            ax.scatter(
                x,
                [1e3 * r["sgd_step_s"] for r in mine],
                marker="_",
                s=400,
                color="k",
                label="SGD's step" if ax is axes[0][0] else None,
                zorder=3,
            )
            ax.set_xticks(x, [str(r["grad_workers"]) for r in mine])
            ax.set_xlabel("kfac.grad_workers")
            ax.set_title(f"N = {n}, {'mpiexec' if net == 'real' else net}", fontsize=9)
            for xi, r in zip(x, mine):
                mib = (r["kfac"]["bytes_eigen_per_step"] + r["kfac"]["bytes_grads_per_step"]) / 2**20
                ax.annotate(
                    f"{mib:.2f}", (xi, 1e3 * r["kfac"]["step_s"]), ha="center", va="bottom", fontsize=6
                )
        axes[0][0].set_ylabel("ms per step (rank 0's split; inv_every 10)")
        fig.legend(loc="lower center", ncol=8, fontsize=7)
        fig.suptitle(
            "K-FAC's step by grad_workers (above each bar: MiB of eigenbases + gradients per step)",
            fontsize=9,
        )
        fig.tight_layout(rect=(0, 0.08, 1, 0.95))
        fig.savefig(OUT / "grad-workers.png", dpi=110)
        plt.close(fig)


def _inv(r: dict[str, Any]) -> str:
    every = r.get("factor_every", 1)
    return f"{r['inv_every']}" + (f" (factors every {every})" if every != 1 else "")


def _s(x: float) -> str:
    return f"{x:.2f}" if math.isfinite(x) else "–"


def _ms(x: float) -> str:
    x = 0.0 if abs(x) < 5e-6 else x  # no "-0.00" of rounding (virtual time: exact zeros)
    return f"{1e3 * x:.2f}" if math.isfinite(x) else "–"


def _k(x: float) -> str:
    return f"{x:,.0f}" if math.isfinite(x) else "not reached"


def tables(results: dict[str, Any]) -> str:
    lines = []
    for part in ("look", "grid", "wall"):
        settings = results.get(part, {}).get("settings", [])
        if not settings:
            continue
        lines += [
            f"\n### {part}\n",
            "| model | optimizer | setting | inv_every | reached (seeds) | samples to 98 % | to 97 % "
            "| training s to 98 % | s since start to 98 % | final acc % | step ms | other cores (max) |",
            "|" + "---|" * 12,
        ]
        for s in settings:
            lines.append(
                f"| {s['model']} | {s['optimizer']} | `{s['setting']}` | {s['inv_every'] or '–'} | "
                f"{s['reached']}/{s['seeds']} | {_k(s['samples_to'])} | "
                f"{_k(s.get('samples_to_97', math.nan))} | {_s(s['train_time_to'])} | "
                f"{_s(s['time_to'])} | {100 * s['final_accuracy']:.2f} | {_ms(s['step_s'])} | "
                f"{s['max_other_cores']:.2f} |"
            )
    rows = [*results.get("split", {}).get("rows", []), *results.get("sim", {}).get("rows", [])]
    if rows:
        lines += [
            "\n### K-FAC's step\n",
            "| N | network | inv_every | grad_workers | step ms | SGD ms | ratio | "
            "factors | exchange | fold | eigh | bc eigen | precond | bc grads | update | other | K-FAC ms "
            "| KiB factors / eigen / grads per step | other cores |",
            "|" + "---|" * 19,
        ]
        for r in rows:
            k = r.get("kfac")
            if not k:
                lines.append(
                    f"| {r['ranks']} | {r['network']} | {r['inv_every']} | {r['grad_workers']} | failed |"
                )
                continue
            parts = " | ".join(_ms(k[p + "_s"]) for p in SPLIT_PARTS)
            kib = " / ".join(
                f"{k[c] / 1024:,.0f}"
                for c in ("bytes_factors_per_step", "bytes_eigen_per_step", "bytes_grads_per_step")
            )
            lines.append(
                f"| {r['ranks']} | {r['network']} | {_inv(r)} | {r['grad_workers']} | "
                f"{_ms(k['step_s'])} | {_ms(r['sgd_step_s'])} | {k['step_s'] / r['sgd_step_s']:.2f} | "
                f"{parts} | {_ms(k['kfac_s'])} | "
                f"{kib} | {r['other_cores'] if r['sim'] is None else '– (virtual)'} |"
            )
    return "\n".join(lines)


# -- the targets --------------------------------------------------------------------------------


def factor_bytes(n: int) -> float:
    """A ring allreduce's bytes sent per step over all ranks for digits-cnn's factors (float32)."""
    from hpcdl.config import load_config
    from hpcdl.models import build_model
    from hpcdl.optim.kfac import factor_sizes
    from hpcdl.rng import generator

    cfg = load_config("digits-cnn", [])
    model = build_model(cfg["model.name"], (1, 8, 8), 10, rng=generator(0, "init"), **_model_kwargs(cfg))
    total = sum(4 * (a * a + g * g) for _, a, g in factor_sizes(model))
    return total * 2 * (n - 1)  # each of n ranks sends 2 (n - 1) / n of the buffer


def _model_kwargs(cfg: Any) -> dict[str, Any]:
    return {"channels": cfg["model.channels"]}


def comparisons(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, measured: rows for ``reproduce.py`` (its :func:`row`)."""
    out = []
    grid = results.get("grid") or results.get("wall")  # small: the timed runs of BEST's settings
    if grid:
        settings = grid["settings"]
        sgd, kfac = best(settings, "digits-cnn", "sgd"), best(settings, "digits-cnn", "kfac", 10)
        ratio = kfac["samples_to"] / sgd["samples_to"] if math.isfinite(sgd["samples_to"]) else math.nan
        measured = (
            f"{ratio:.2f} (K-FAC `{kfac['setting']}` {_k(kfac['samples_to'])} vs SGD `{sgd['setting']}` "
            f"{_k(sgd['samples_to'])}, median of {kfac['seeds']} seeds)"
        )
        out.append(
            row(
                "accuracy-samples.png, digits-cnn",
                "samples to 98 % test accuracy: K-FAC / the best SGD",
                measured,
                "≤ 0.7 (the issue)",
                ratio <= 0.7 if math.isfinite(ratio) else False,
                "353 of 360 for 3 evaluations in a row (every 10 steps, -n 2); the best of each grid "
                f"({'the grid' if 'grid' in results else 'the full run'}'s); median of the seeds",
            )
        )
        candidates = [kfac]
        wall = results.get("wall")
        if wall:  # the timed runs: the same settings again, interleaved by seed
            sgd = next(w for w in wall["settings"] if w["optimizer"] == "sgd")
            candidates = [w for w in wall["settings"] if w["optimizer"] == "kfac"]
        for k in candidates:
            busy = max(sgd["max_other_cores"], k["max_other_cores"])
            ratio = k["train_time_to"] / sgd["train_time_to"]
            measured = (
                f"{ratio:.2f} ({k['train_time_to']:.2f} s vs {sgd['train_time_to']:.2f} s; since the start: "
                f"{k['time_to']:.2f} s vs {sgd['time_to']:.2f} s; other processes up to {busy:.2f} cores)"
            )
            out.append(
                row(
                    f"accuracy-time.png, K-FAC `{k['setting']}`, inv_every {k['inv_every']}",
                    "training seconds to 98 % at -n 2: K-FAC / that SGD",
                    measured,
                    "≤ 1 (the issue)",
                    (ratio <= 1 if math.isfinite(ratio) else False) if busy < QUIET_CORES else None,
                    "the steps' own times summed (evaluations left out), median of the seeds; timed: other "
                    f"processes < {QUIET_CORES} cores, else not comparable",
                )
            )
    for r in [*results.get("split", {}).get("rows", []), *results.get("sim", {}).get("rows", [])]:
        k = r.get("kfac")
        if not k or r["grad_workers"] != 1 or r.get("factor_every", 1) != 1:
            continue
        want = factor_bytes(r["ranks"])
        got = k["bytes_factors_per_step"]
        out.append(
            row(
                f"grad-workers.png, N = {r['ranks']} {r['network']}, inv_every {r['inv_every']}",
                "bytes the factors' allreduce sends per step, all ranks",
                f"{got:,.0f}",
                f"{want:,.0f} (2 (N − 1) x the factors' bytes)",
                abs(got - want) <= 8 * r["ranks"] * 64,
                "a ring's sends; integer division per bucket",
            )
        )
        parts = sum(k[p + "_s"] for p in SPLIT_PARTS)
        out.append(
            row(
                f"K-FAC's step, N = {r['ranks']} {r['network']}, inv_every {r['inv_every']}",
                "K-FAC's share of a step (rank 0) and its split",
                f"{1e3 * k['kfac_s']:.2f} ms of "
                f"{1e3 * k['step_s']:.2f} ms (SGD {1e3 * r['sgd_step_s']:.2f}); parts sum "
                f"{1e3 * parts:.2f} ms",
                "the parts add up to the share",
                abs(parts - k["kfac_s"]) <= 1e-9 + 1e-9 * k["kfac_s"],
                "reported, not a target",
            )
        )
    return out


def main(argv: list[str] | None = None) -> int:
    global OUT
    parser = experiment_parser(__doc__, list(PARTS), [p for p in PARTS if p != "look"], list(SIZES))
    args = parser.parse_args(argv)
    size, OUT, results_path, results = open_results(args, SIZES, OUT)
    if args.tables:
        print(tables(results))
        return 0
    if not args.figures_only:
        if args.work is None:
            parser.error("--work is needed to run parts")
        args.work.mkdir(parents=True, exist_ok=True)

        def part(name: str) -> dict[str, Any]:
            fn = globals()[f"part_{name}"]
            return fn(args.work, size) if name in ("look", "grid") else fn(args.work, size, results)

        run_parts(args.parts, results, results_path, part)
    for part in ("look", "grid", "wall"):  # the medians again, from the runs (new columns reach old results)
        if part in results:
            results[part]["settings"] = setting_rows(results[part]["runs"])
    if args.figures_only:
        results_path.write_text(json.dumps(results, indent=1) + "\n")
    figures(results)
    if args.reproduce:
        write_summary(args.work, HERE.name, args.reproduce, comparisons(results), sizes=size)
    for r in comparisons(results):
        print(f"{r['verdict']:>14}: {r['figure']}: {r['quantity']}: {r['measured']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
