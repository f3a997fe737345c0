"""The microbatch study of "Evaluation of an Implementation Method for Pipeline Parallelism
Distributed Deep Learning" (Takizawa, Yazaki, Ishihata; IPSJ 2022), on the pipeline strategy.

Every run is ``python -m hpcdl.train`` with ``parallel.strategy = "pipeline"`` (or its one-process
reference with ``exchange.accumulate = m``), simulated (``python -m hpcdl.simulate``, ``ib-edr``,
compute from a cost table profiled here from real single-process runs) or real (``mpiexec``).

* ``profile``: single-process runs with ``profile.layers = true`` (one BLAS thread): mlp32 at
  its microbatch of 128 rows, VGG16 and ResNet-50 on 3x32x32 inputs at width 0.25, microbatch
  32. Their ``profile/`` groups are the cost tables of the simulated parts.
* ``real``: mlp32 at 2 stages under ``mpiexec -n 2``, m in {1, 2, 4, 8, 16, 32} microbatches
  of 128: ``python -m hpcdl.bench pipeline`` (samples/s of the pipelined step beside one
  process's on the same batches, and torch.distributed.pipelining's when PyTorch is here;
  medians of alternating repetitions).
* ``sim``: mlp32 at 2, 4 and 8 stages (time-balanced) and 1 (the one-process reference on
  the same table), the same m: speed-up = the one stage's step time / the p stages', beside
  the closed form p m / (m + p - 1) of equal stages and the analytic timeline of the
  partition's own stage costs (:func:`hpcdl.parallel.pipe_plan.simulate`).
* ``cnn``: VGG16 and ResNet-50 at 2, 4 and 8 stages, m = 8: ``uniform`` against ``time``
  partitions; the slowest stage's profiled time and the simulated step time of each.
* ``trace``: one traced real run (2 stages, 1F1B, m = 8) and one simulated (4 stages,
  GPipe and 1F1B, m = 8) for the Gantt charts (``python -m hpcdl.report``).

    python jobs/experiments/pipeline/run.py --work /tmp/pipeline            # everything
    python jobs/experiments/pipeline/run.py --work /tmp/pipeline --parts sim cnn
    python jobs/experiments/pipeline/run.py --reproduce small --work /tmp/pipeline   # make reproduce

Rows go to ``results.json`` beside this script (each part replaces its own entry), the
figures to ``*.png`` beside it; run files stay in ``--work``. With ``--reproduce SIZE``
(``jobs/experiments/reproduce.py``'s interface) everything goes to ``--work`` instead, with
``summary.json``: the comparisons of :func:`comparisons`. ``SIZES`` gives the sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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
MPIEXEC = str(Path(sys.executable).with_name("mpiexec"))
PARTS = ("profile", "real", "sim", "cnn", "trace")
MICROBATCHES = (1, 2, 4, 8, 16, 32)
STAGES = (2, 4, 8)
CNN_STAGES = STAGES
REPS = 5
#: --reproduce's sizes, setting the constants above: full is the README's (about 11 minutes),
#: small about 3 (4 on a busy machine)
SIZES: dict[str, dict[str, Any]] = {
    "full": {"microbatches": MICROBATCHES, "stages": STAGES, "cnn_stages": CNN_STAGES, "reps": REPS},
    "small": {"microbatches": (8,), "stages": (2, 4), "cnn_stages": (4,), "reps": 3},
}
#: where results.json and the figures go: beside this script, or --work under --reproduce
OUT = HERE
NETWORK = "ib-edr"
#: model -> the settings of its runs (on the mlp32-synthetic preset: synthetic data)
MODELS: dict[str, list[str]] = {
    "mlp32": [],
    "vgg16": ["model.name=vgg16", "model.width_mult=0.25", "data.shape=[3,32,32]", "data.batch_size=32"],
    "resnet50": [
        "model.name=resnet50",
        "model.width_mult=0.25",
        "data.shape=[3,32,32]",
        "data.batch_size=32",
    ],
}
BASE = ["checkpoint.every=0", "train.log_every=100000", "data.test_size=128", "train.eval_every=100000"]


def env() -> dict[str, str]:
    return {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}


def sets(items: list[str]) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


def run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(cmd, env=env(), capture_output=True, text=True, check=False)
    if done.returncode:
        sys.stderr.write(done.stderr[-2000:])
        raise SystemExit(f"failed ({done.returncode}): {' '.join(cmd)}")
    return done


def train(work: Path, name: str, settings: list[str], ranks: int = 1, sim: list[str] | None = None) -> Path:
    """One run of ``hpcdl.train`` (simulated on ``ranks`` virtual ranks when ``sim`` is given)."""
    out = work / f"{name}.h5"
    for old in work.glob(f"{name}.*h5"):
        old.unlink()
    args = ["-m", "hpcdl.train", "--config", "mlp32-synthetic", *sets([*BASE, *settings]),
            "--progress", "none", "--out", str(out)]  # fmt: skip
    if sim is not None:
        cmd = [PYTHON, "-m", "hpcdl.simulate", "-n", str(ranks), *sim, *args]
    elif ranks > 1:
        cmd = [MPIEXEC, "-n", str(ranks), PYTHON, *args]
    else:
        cmd = [PYTHON, *args]
    run(cmd)
    return out


def step_times(path: Path) -> np.ndarray:
    with h5py.File(path, "r") as f:
        return f["metrics/step_time"][...]


def series(path: Path, name: str) -> np.ndarray:
    with h5py.File(path, "r") as f:
        return f["ranks"][name][...]


def stage_costs(settings: list[str], stages: int) -> tuple[Any, list[float], list[float], float]:
    """The partition ``settings`` describe for ``stages`` stages, each stage's forward and
    backward seconds per microbatch from the profile, and one transfer's seconds on the
    network (the largest activation between stages)."""
    from hpcdl.config import load_config
    from hpcdl.driver.factory import build, load_data
    from hpcdl.parallel.pipeline import stage_partition
    from hpcdl.sim.network import load_network
    from hpcdl.sim.ticks import TICKS_PER_SECOND

    cfg = load_config("mlp32-synthetic", [*BASE, *settings])
    data = load_data(cfg)
    whole = build(cfg, data, 0, np.dtype(cfg["dtype"]), np, None)
    part = stage_partition(cfg, whole, stages, data.input_shape, None)
    fwd = [sum(x.forward_s for x in layers) for layers in part.stages]
    bwd = [sum(x.backward_s for x in layers) for layers in part.stages]
    sent = max([layers[-1].output_bytes for layers in part.stages[:-1]], default=0)
    link = load_network(NETWORK, 2).inter
    return part, fwd, bwd, (link.alpha + link.transfer(sent)) / TICKS_PER_SECOND


def table(work: Path, model: str) -> str:
    return f"table:{work / f'profile-{model}.h5'}"


# -- parts ----------------------------------------------------------------------------------------


def part_profile(work: Path) -> dict[str, Any]:
    rows = {}
    for model, settings in MODELS.items():
        t0 = time.monotonic()
        out = train(work, f"profile-{model}", [*settings, "train.steps=6", "profile.layers=true"])
        with h5py.File(out, "r") as f:
            fwd, bwd = f["profile/forward_s"][...], f["profile/backward_s"][...]
        rows[model] = {
            "layers": len(fwd),
            "forward_ms": 1e3 * float(fwd.sum()),
            "backward_ms": 1e3 * float(bwd.sum()),
            "wall_s": round(time.monotonic() - t0, 1),
        }
    return rows


def part_real(work: Path) -> list[dict[str, Any]]:
    rows = []
    for m in MICROBATCHES:
        out = work / f"bench-m{m}.json"
        cmd = [MPIEXEC, "-n", "2", PYTHON, "-m", "hpcdl.bench", "pipeline", "--microbatches", str(m),
               "--schedule", "both", "--reps", str(REPS), "--vs", "torch", "--json", str(out)]  # fmt: skip
        sys.path.insert(0, str(HERE.parent))
        from reproduce import other_cores

        with other_cores() as load:  # timings beside a busy core are not comparable
            done = run(cmd)
        print(done.stdout, load, flush=True)
        for row in json.loads(out.read_text()):
            rows.append({"m": m, **row, **load})
    return rows


def part_sim(work: Path) -> list[dict[str, Any]]:
    from hpcdl.parallel.pipe_plan import schedule, simulate

    rows = []
    sim = ["--network", NETWORK, "--compute", table(work, "mlp32")]
    base = ["train.steps=3", "parallel.strategy=pipeline", "pipeline.balance=time",
            f"pipeline.profile={work / 'profile-mlp32.h5'}", "pipeline.schedule=1f1b"]  # fmt: skip
    for m in MICROBATCHES:
        one = train(work, f"sim-mlp32-p1-m{m}", [*base, f"pipeline.microbatches={m}"], 1, sim)
        t1 = statistics.median(step_times(one))
        for p in STAGES:
            settings = [*base, f"pipeline.microbatches={m}"]
            out = train(work, f"sim-mlp32-p{p}-m{m}", settings, p, sim)
            tp = statistics.median(step_times(out))
            part, fwd, bwd, transfer = stage_costs(settings, p)
            analytic = simulate(schedule("1f1b", p, m), fwd, bwd, transfer).makespan
            rows.append({
                "p": p, "m": m, "balance": list(part.balance), "step_s": tp, "one_stage_s": t1,
                "speedup": t1 / tp, "equal_stages": p * m / (m + p - 1),
                "analytic_speedup": m * (sum(fwd) + sum(bwd)) / analytic, "analytic_step_s": analytic,
                "bubble": float(np.median(series(out, "bubble")[-1])),
                "slowest_over_mean": float(np.max(np.add(fwd, bwd)) / np.mean(np.add(fwd, bwd))),
            })  # fmt: skip
            print(rows[-1], flush=True)
    return rows


def part_cnn(work: Path) -> list[dict[str, Any]]:
    rows = []
    m = 8
    for model in ("vgg16", "resnet50"):
        profile = work / f"profile-{model}.h5"
        sim = ["--network", NETWORK, "--compute", table(work, model)]
        pipe = [*MODELS[model], "train.steps=2", "parallel.strategy=pipeline", f"pipeline.microbatches={m}"]
        one = train(work, f"sim-{model}-p1", pipe, 1, sim)
        t1 = statistics.median(step_times(one))
        for p in CNN_STAGES:
            for method in ("uniform", "time"):
                settings = [*pipe, f"pipeline.balance={method}", f"pipeline.profile={profile}"]
                part, fwd, bwd, _ = stage_costs(settings, p)
                stage_s = np.add(fwd, bwd)
                out = train(work, f"sim-{model}-p{p}-{method}", settings, p, sim)
                tp = statistics.median(step_times(out))
                rows.append({
                    "model": model, "p": p, "method": method, "balance": list(part.balance),
                    "slowest_stage_ms": 1e3 * float(stage_s.max()),
                    "mean_stage_ms": 1e3 * float(stage_s.mean()),
                    "step_s": tp, "one_stage_s": t1, "speedup": t1 / tp,
                    "bubble": [round(float(b), 4) for b in series(out, "bubble")[-1]],
                })  # fmt: skip
                print(rows[-1], flush=True)
    return rows


def part_trace(work: Path) -> dict[str, Any]:
    traced = ["train.steps=3", "parallel.strategy=pipeline", "pipeline.microbatches=8", "log.trace=true"]
    real = train(work, "trace-real-1f1b", [*traced, "pipeline.schedule=1f1b"], 2)
    sim = ["--network", NETWORK, "--compute", table(work, "mlp32")]
    out = {"real": str(real)}
    for kind in ("gpipe", "1f1b"):
        timed = [*traced, f"pipeline.schedule={kind}", "pipeline.balance=time",
                 f"pipeline.profile={work / 'profile-mlp32.h5'}"]  # fmt: skip
        path = train(work, f"trace-sim-{kind}", timed, 4, sim)
        out[f"sim-{kind}"] = str(path)
    for name, path in out.items():  # the Gantt chart and the stages' bubbles kept beside this script
        run([PYTHON, "-m", "hpcdl.report", path, "--out", str(work / f"report-{name}"),
             "--trace", str(Path(path).with_suffix(".json"))])  # fmt: skip
        for figure in ("gantt", "stages"):
            shutil.copyfile(work / f"report-{name}-{figure}.png", OUT / f"{figure}-{name}.png")
    return out


# -- figures and the table --------------------------------------------------------------------------


def figures(results: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    sim = results.get("sim", [])
    for p in STAGES:
        rows = sorted((r for r in sim if r["p"] == p), key=lambda r: r["m"])
        if rows:
            ms = [r["m"] for r in rows]
            ax.plot(ms, [r["speedup"] for r in rows], "o-", label=f"simulated, {p} stages")
            ax.plot(ms, [r["equal_stages"] for r in rows], ":", color=ax.lines[-1].get_color(),
                    label=f"p m / (m + p - 1), p = {p}")  # fmt: skip
    for kind, style in (("1f1b", "s-k"), ("gpipe", "s--k")):
        real = real_speedups(results.get("real", []), kind)
        if real:
            ms = sorted(real)
            ax.plot(ms, [real[m]["hpcdl"] for m in ms], style, label=f"real, 2 stages, hpcdl {kind}")
            torch = [m for m in ms if real[m].get("torch") is not None]
            if torch and kind == "1f1b":
                ax.plot(torch, [real[m]["torch"] for m in torch], "^-", color="grey",
                        label="real, 2 stages, torch pipelining 1f1b")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xlabel("microbatches m (of 128 samples)")
    ax.set_ylabel("speed-up over one process (same samples)")
    ax.set_title("mlp32: pipeline speed-up against the number of microbatches")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(OUT / "speedup.png", dpi=100)
    plt.close(fig)

    cnn = results.get("cnn", [])
    if cnn:
        fig, axes = plt.subplots(1, 2, figsize=(9, 4))
        for ax, model in zip(axes, ("vgg16", "resnet50")):
            for k, method in enumerate(("uniform", "time")):
                rows = sorted(
                    (r for r in cnn if r["model"] == model and r["method"] == method), key=lambda r: r["p"]
                )
                ps = np.array([r["p"] for r in rows], dtype=float)
                ax.bar(np.log2(ps) + (k - 0.5) * 0.35, [r["speedup"] for r in rows], width=0.35, label=method)
            ax.set_xticks(np.log2(np.array(CNN_STAGES, dtype=float)), [str(p) for p in CNN_STAGES])
            ax.set_xlabel("stages")
            ax.set_ylabel("simulated speed-up (m = 8)")
            ax.set_title(model)
            ax.legend()
        fig.tight_layout()
        fig.savefig(OUT / "cnn-balance.png", dpi=100)
        plt.close(fig)


def real_speedups(rows: list[dict[str, Any]], kind: str) -> dict[int, dict[str, float]]:
    """Per m, the real runs' samples/s over one process's: hpcdl's pipeline and torch's."""
    out: dict[int, dict[str, float]] = {}
    for m in sorted({r["m"] for r in rows}):
        by = {r["impl"]: r for r in rows if r["m"] == m and r["schedule"] == kind}
        one = by.get("one-process")
        if one is None or "hpcdl-pipeline" not in by:
            continue
        out[m] = {"hpcdl": by["hpcdl-pipeline"]["samples_per_s"] / one["samples_per_s"],
                  "one_process_per_s": one["samples_per_s"],
                  "hpcdl_per_s": by["hpcdl-pipeline"]["samples_per_s"]}  # fmt: skip
        if "torch-pipelining" in by:
            out[m]["torch"] = by["torch-pipelining"]["samples_per_s"] / one["samples_per_s"]
            out[m]["torch_per_s"] = by["torch-pipelining"]["samples_per_s"]
    return out


def comparisons(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The README's claims, measured again: rows for ``reproduce.py`` (its :func:`row`)."""
    sys.path.insert(0, str(HERE.parent))
    from reproduce import QUIET_CORES, row

    rows = []
    busy = max((r.get("other_cores", 0.0) for r in results.get("real", []) if r["m"] == 8), default=0.0)
    quiet = busy < QUIET_CORES  # (results before 2026-11-26 were measured on a quiet machine)
    noise = "" if quiet else f", other processes {busy:.2f} cores"
    timed = f"; timings: other processes < {QUIET_CORES} cores, else not comparable"
    for r in results.get("sim", []):
        if r["m"] == max(x["m"] for x in results["sim"]):
            ratio = r["speedup"] / r["equal_stages"]
            rows.append(row(f"speed-up, simulated, p = {r['p']}, m = {r['m']}", "speed-up over one stage",
                            f"{r['speedup']:.3f}", f"{r['equal_stages']:.3f} (p·m/(m+p−1))",
                            0.95 <= ratio <= 1.001, "within 5 % below the closed form"))  # fmt: skip
    if results.get("sim"):
        err = max(abs(r["step_s"] / r["analytic_step_s"] - 1) for r in results["sim"])
        rows.append(row("speed-up, simulated (every p, m)", "step time against the plan's analytic timeline",
                        f"{err:.1e} (largest relative gap)", "1.3e-10 (README)", err <= 1e-6,
                        "the executor schedules as the plan says: gap ≤ 1e-6"))  # fmt: skip
    for kind in ("1f1b", "gpipe"):
        real = real_speedups(results.get("real", []), kind)
        if 8 in real:
            rows.append(row(f"speed-up, real, 2 stages, m = 8 ({kind})", "samples/s over one process",
                            f"{real[8]['hpcdl']:.3f}{noise}", "≥ 1.5 (the issue's target)",
                            real[8]["hpcdl"] >= 1.5 if quiet else None,
                            "≥ 1.5× one process on the same batches" + timed))  # fmt: skip
            torch = real[8].get("torch")
            rows.append(row(f"speed-up, real, 2 stages, m = 8 ({kind})", "hpcdl over torch pipelining",
                            f"{real[8]['hpcdl'] / torch:.3f}{noise}" if torch else "PyTorch not installed",
                            "> 1 (the issue's target)", real[8]["hpcdl"] > torch if torch and quiet else None,
                            "ahead of torch.distributed.pipelining on the same cut" + timed))  # fmt: skip
            sim = {r["m"]: r for r in results.get("sim", []) if r["p"] == 2}
            if kind == "1f1b" and 8 in sim:
                gap = real[8]["hpcdl"] / sim[8]["speedup"] - 1
                rows.append(row("speed-up, real against simulated, p = 2, m = 8", "real / simulated − 1",
                                f"{100 * gap:+.1f} %{noise}", "−0.3 % (README)",
                                abs(gap) <= 0.05 if quiet else None,
                                "real and simulated agree within 5 %" + timed))  # fmt: skip
    for model in ("vgg16", "resnet50"):
        for p in sorted({r["p"] for r in results.get("cnn", []) if r["model"] == model}):
            by = {r["method"]: r for r in results["cnn"] if r["model"] == model and r["p"] == p}
            if {"uniform", "time"} <= set(by):
                ratio = by["time"]["step_s"] / by["uniform"]["step_s"]
                rows.append(row(f"CNN balance, {model}, p = {p}", "time-balanced step / uniform step",
                                f"{ratio:.3f}", "< 1 (README: 0.83–0.95)", ratio < 1,
                                "the time balance's simulated step is shorter"))  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True, help="directory for run files")
    parser.add_argument("--parts", nargs="*", choices=PARTS, default=list(PARTS))
    parser.add_argument("--figures-only", action="store_true", help="redraw from results.json")
    parser.add_argument("--reproduce", choices=list(SIZES),
                        help="every part at this size; results, figures, summary.json in --work")  # fmt: skip
    args = parser.parse_args(argv)
    if args.reproduce:
        # the size's keys name the constants above that the parts read (MICROBATCHES, ...)
        globals().update({key.upper(): value for key, value in SIZES[args.reproduce].items()}, OUT=args.work)
        args.parts = list(PARTS)
        args.work.mkdir(parents=True, exist_ok=True)
        (OUT / "results.json").unlink(missing_ok=True)
    results_path = OUT / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    if not args.figures_only:
        args.work.mkdir(parents=True, exist_ok=True)
        for name in args.parts:
            t0 = time.monotonic()
            results[name] = globals()[f"part_{name}"](args.work)
            results.setdefault("wall_s", {})[name] = round(time.monotonic() - t0, 1)
            results_path.write_text(json.dumps(results, indent=1) + "\n")
            print(f"== {name}: {time.monotonic() - t0:.0f} s", flush=True)
    figures(results)
    if args.reproduce:
        sys.path.insert(0, str(HERE.parent))
        from reproduce import write_summary

        write_summary(args.work, HERE.name, args.reproduce, comparisons(results), sizes=SIZES[args.reproduce])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
