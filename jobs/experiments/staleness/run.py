"""The staleness study of "A Hybrid Simulator to Analyze Gradient Staleness Effect", on parameter servers.

Every run is ``python -m hpcdl.train`` on the digits-mlp preset with ``parallel.strategy =
"ps"`` (one server), simulated (``python -m hpcdl.simulate``: ``eth10g``, compute from a
cost table profiled from a real single-process run) or real (``mpiexec``). One factor at a
time:

* ``scan``: W in {1, 2, 4, 8, 16, 64, 256, 1024} workers x modes (async, async with
  ``compensation = "lr"``, ssp s = 1 and 4, the ps ``sync`` mode, and sync data parallel
  over ``allreduce``), the same pushes (samples) each: the tau distribution per W, test
  accuracy against samples and time, virtual time per epoch.
* ``jitter``: homogeneous async at W = 8, equal costs, ``--jitter 0`` (tau = W - 1
  exactly after the first round) and ``--jitter 0.1`` (the histogram).
* ``straggler``: W = 8, worker 7 three times slower (``--straggler``), async and ssp
  s = 1, 4 on ``ib-hdr`` (compute-bound): the straggler's share of pushes and its tau
  against the closed form (docstring of :func:`closed_form`), SSP's bound.
* ``real``: real ``mpiexec -n 3`` (W = 2) and ``-n 4`` (W = 3, oversubscribing the 2
  cores: information) against the simulator at the same W on ``shm-local`` (this
  machine's calibrated network), compute from the table; Kolmogorov-Smirnov distance of
  the tau histograms.
* ``accuracy``: W = 4 simulated and W = 2 real, async with and without ``compensation =
  "lr"`` beside sync data parallel, the same epochs (samples processed), seeds 0-2: median
  final test accuracy.
* ``scale``: 1,024 simulated async workers, 10,000 pushes: wall time and peak memory.

    python jobs/experiments/staleness/run.py --work /tmp/staleness            # everything
    python jobs/experiments/staleness/run.py --work /tmp/staleness --parts scan straggler
    python jobs/experiments/staleness/run.py --reproduce small --work /tmp/staleness   # make reproduce

Rows go to ``results.json`` beside this script (each part replaces its own entry), the
figures to ``*.png`` beside it; run files stay in ``--work``. With ``--reproduce SIZE``
(``jobs/experiments/reproduce.py``'s interface) everything goes to ``--work`` instead, with
``summary.json``: the comparisons of :func:`comparisons`. ``SIZES`` gives the sizes.
"""

from __future__ import annotations

import argparse
import json
import math
import re
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
from reproduce import env, sets  # noqa: E402

PYTHON = sys.executable
MPIEXEC = str(Path(sys.executable).with_name("mpiexec"))
PARTS = ("profile", "scan", "jitter", "straggler", "real", "accuracy", "scale")
WORKERS = (1, 2, 4, 8, 16, 64, 256, 1024)
#: mode name -> the settings on top of the ps preset (``dp``: the sync strategy itself)
MODES: dict[str, list[str]] = {
    "async": ["ps.mode=async"],
    "async-lr": ["ps.mode=async", "ps.compensation=lr"],
    "ssp1": ["ps.mode=ssp", "ps.staleness=1"],
    "ssp4": ["ps.mode=ssp", "ps.staleness=4"],
    "sync": ["ps.mode=sync"],
    "dp": [],
}
#: digits-mlp sampled with replacement (1,024 x 32 exceeds the 1,437 training samples), no checkpoints
BASE = ["data.sampler=random", "checkpoint.every=0", "train.log_every=100000"]
BATCH, TRAIN_SAMPLES = 32, 1437
#: settings every run of this invocation adds (``--set``), e.g. optimizer.momentum=0
EXTRA: list[str] = []
#: --reproduce's sizes (the options below): full is the README's first command (about 4 minutes);
#: small scans fewer workers with fewer pushes, 3 real runs, 1 seed (about 2 minutes, 4 on a busy machine)
SIZES: dict[str, dict[str, Any]] = {
    "full": {"workers": list(WORKERS), "pushes": 4000, "repeats": 5, "seeds": 3, "epochs": 30},
    "small": {"workers": [1, 4, 16], "pushes": 1000, "repeats": 3, "seeds": 1, "epochs": 30},
}


def train(
    work: Path, name: str, ranks: int, settings: list[str], *, sim: list[str] | None = None, mode: str = "ps"
) -> dict[str, Any]:
    """One run of ``hpcdl.train`` (simulated when ``sim`` gives the simulator's options); its results."""
    out = work / f"{name}.h5"
    for old in work.glob(f"{name}.*h5"):
        old.unlink()
    strategy = ["parallel.strategy=sync"] if mode == "dp" else ["parallel.strategy=ps"]
    args = ["-m", "hpcdl.train", "--config", "digits-mlp", *sets([*BASE, *EXTRA, *strategy, *settings]),
            "--progress", "none", "--out", str(out)]  # fmt: skip
    if sim is not None:
        cmd = [PYTHON, "-m", "hpcdl.simulate", "-n", str(ranks), "--stats", *sim, *args]
    else:
        cmd = [MPIEXEC, "-n", str(ranks), PYTHON, *args]
    t0 = time.monotonic()
    done = subprocess.run(cmd, env=env(), capture_output=True, text=True, check=False)
    wall = time.monotonic() - t0
    row: dict[str, Any] = {"name": name, "ranks": ranks, "settings": settings, "sim": sim,
                           "exit": done.returncode, "wall_s": round(wall, 2)}  # fmt: skip
    peak = re.search(r"peak RSS ([\d,]+) MiB", done.stderr)
    if peak:
        row["peak_rss_mib"] = int(peak.group(1).replace(",", ""))
    if done.returncode:
        error = [ln for ln in done.stderr.splitlines() if "error" in ln.lower()]
        row["error"] = (error or done.stderr.splitlines()[-1:] or [""])[-1][-300:]
    if out.exists():
        row.update(read(out))
    return row


def read(path: Path) -> dict[str, Any]:
    """What the study keeps of a run file."""
    with h5py.File(path, "r") as f:
        m = {k: f["metrics"][k][...] for k in ("step", "samples", "time", "test_accuracy")}
        tau = f["staleness/tau"][...] if "staleness" in f else np.zeros(0, dtype=np.int64)
        worker = f["staleness/worker"][...] if "staleness" in f else np.zeros(0, dtype=np.int32)
        attrs = dict(f.attrs)
    evaluated = np.isfinite(m["test_accuracy"])
    epochs = float(m["samples"][-1]) / TRAIN_SAMPLES if len(m["samples"]) else float("nan")
    return {
        "path": str(path),
        "status": str(attrs.get("status")),
        "steps": int(m["step"][-1]) if len(m["step"]) else 0,
        "epochs": round(epochs, 3),
        "final_accuracy": float(m["test_accuracy"][evaluated][-1]) if evaluated.any() else float("nan"),
        "virtual_s": float(m["time"][-1]) if len(m["time"]) else float("nan"),
        "s_per_epoch": float(m["time"][-1]) / epochs if len(m["time"]) and epochs else float("nan"),
        "tau_hist": np.bincount(tau).tolist() if len(tau) else [],
        "tau_median": float(np.median(tau)) if len(tau) else float("nan"),
        "tau_max": int(tau.max()) if len(tau) else 0,
        "curve": {
            "samples": m["samples"][evaluated].tolist(),
            "time": m["time"][evaluated].tolist(),
            "accuracy": m["test_accuracy"][evaluated].tolist(),
        },  # fmt: skip
        "worker": np.bincount(worker).tolist() if len(worker) else [],
        "tau_by_worker": [float(np.mean(tau[worker == w])) for w in range(int(worker.max()) + 1)]
        if len(worker)
        else [],
    }


# -- parts ---------------------------------------------------------------------------------------


def part_profile(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The cost table: a real single-process digits-mlp run with ``profile.layers = true``."""
    row = train(
        work, "profile", 1, ["parallel.strategy=sync", "profile.layers=true", "train.steps=400"], mode="dp"
    )
    with h5py.File(row["path"]) as f:
        table = {k: f["profile"][k][...].tolist() for k in ("forward_s", "backward_s")}
    step_s = sum(table["forward_s"]) + sum(table["backward_s"])
    return {"table": row["path"], "layers": table, "compute_per_push_s": step_s}


def table(work: Path) -> str:
    return f"table:{work / 'profile.h5'}"


def part_scan(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    rows = []
    for w in args.workers:
        for mode, settings in MODES.items():
            if mode == "sync" and w == 1:
                continue  # the same as async with one worker
            n = w if mode == "dp" else w + 1
            pushes = args.pushes
            steps = max(1, round(pushes / w)) if mode == "dp" else pushes
            sim = ["--network", "eth10g", "--compute", table(work)]
            every = max(1, 45 // (w if mode == "dp" else 1))  # about an epoch
            if mode == "sync":  # whole rounds of W pushes
                steps, every = w * max(1, round(pushes / w)), w * max(1, round(45 / w))
            run_sets = [*settings, f"train.steps={steps}", f"train.eval_every={every}"]
            row = train(work, f"scan-{mode}-w{w}", n, run_sets, sim=sim, mode=mode)
            row.update(workers=w, mode=mode)
            acc, per_epoch = row.get("final_accuracy", math.nan), row.get("s_per_epoch", math.nan)
            tau = f"tau median {row.get('tau_median')} max {row.get('tau_max')}"
            print(f"scan W={w:5d} {mode:9s} exit {row['exit']} acc {acc:.4f} {tau} s/epoch {per_epoch:.4f} "
                  f"wall {row['wall_s']} s", flush=True)  # fmt: skip
            rows.append(row)
    return {"pushes": args.pushes, "rows": rows}


def part_jitter(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Homogeneous async, W = 8: tau = W - 1 exactly without jitter; the histogram with 10 %.

    On eth10g the server's link is the bottleneck and the workers queue there, which
    absorbs most of the jitter; on ib-hdr the workers are compute-bound and it shows.
    """
    rows = []
    settings = ["ps.mode=async", "ps.compensation=lr", "train.steps=2000"]
    for network in ("eth10g", "ib-hdr"):
        for jitter in (0.0, 0.1):
            sim = ["--network", network, "--compute", table(work), "--jitter", str(jitter)]
            row = train(work, f"jitter-{network}-{jitter}", 9, settings, sim=sim)
            tau = _tau(row)
            row.update(
                network=network, jitter=jitter, after_first_round_all_w_minus_1=bool((tau[8:] == 7).all())
            )
            rows.append(row)
            print(f"jitter {jitter} on {network}: tau histogram {row['tau_hist']}", flush=True)
    return {"rows": rows}


def _tau(row: dict[str, Any]) -> np.ndarray:
    with h5py.File(row["path"]) as f:
        return f["staleness/tau"][...]


def closed_form(workers: int, factor: float, compute_s: float, round_trip_s: float) -> dict[str, float]:
    """Async with one straggler, compute-bound: shares and staleness from the cycle times.

    A worker's cycle is pull -> compute -> push -> apply -> reply: ``C = T + r`` for the
    others and ``C_s = f T + r`` for the straggler (T: compute per push, r: the push's
    and the reply's transfer). Each worker pushes once per cycle, so over a long run the
    straggler's share of the pushes is ``(1/C_s) / ((W - 1)/C + 1/C_s)``. Its staleness is
    the pushes the others apply between the reply it computes from and its own push:
    ``tau_s = (W - 1) C_s / C``; another worker's is ``(W - 2) + C / C_s``.
    """
    c, cs = compute_s + round_trip_s, factor * compute_s + round_trip_s
    return {"cycle_s": c, "straggler_cycle_s": cs, **_relations(workers, c, cs)}


def part_straggler(work: Path, args: argparse.Namespace, profile: dict[str, Any]) -> dict[str, Any]:
    """W = 8 on ib-hdr, worker 7 three times slower, 5 % jitter: its share and tau against the closed form.

    At ``--speed 0.125`` (a device 8x slower: 1.5 ms of compute per push against 14 us
    per transfer) the workers are compute-bound, as the closed form assumes; at speed 1
    (190 us of compute) pushes that overlap share the server's link and lengthen every
    cycle by a queueing delay the closed form leaves out: shown as information, with the
    same relations fed the cycles measured in the run.
    """
    workers, factor = 8, 3.0
    nbytes = 85_002 * 4 + 64  # the packed float32 parameters and the header
    alpha, bandwidth = 1.0e-6, 24.0e9  # ib-hdr's inter-node figures
    rows, forms = [], {}
    for speed in (0.125, 1.0):
        compute = profile["compute_per_push_s"] / speed
        form = forms[str(speed)] = closed_form(workers, factor, compute, 2 * (alpha + nbytes / bandwidth))
        for mode in ("async", "ssp1", "ssp4"):
            # a 5 % jitter: identical deterministic workers would stay in lockstep from the phase's
            # start, their pushes colliding at the server every cycle, unlike any real machine's
            sim = ["--network", "ib-hdr", "--compute", table(work), "--straggler", f"{workers}:{factor}",
                   "--speed", str(speed), "--jitter", "0.05"]  # fmt: skip
            row = train(
                work,
                f"straggler-{mode}-speed{speed}",
                workers + 1,
                # evaluated after the last push only: server 0 idle between pushes, as the form assumes
                [*MODES[mode], "train.steps=4000", "train.eval_every=100000"],
                sim=sim,
            )
            counts = np.array(row["worker"])
            share = float(counts[-1] / counts.sum())
            others_rate = counts[:-1].mean() / row["virtual_s"]  # pushes per second of a worker
            measured = {"cycle_s": 1 / others_rate, "straggler_cycle_s": row["virtual_s"] / counts[-1]}
            row.update(mode=mode, speed=speed, straggler_share=share, straggler_tau=row["tau_by_worker"][-1],
                       other_tau=float(np.mean(row["tau_by_worker"][:-1])), measured_cycles=measured,
                       form_of_measured_cycles=_relations(workers, *measured.values()))  # fmt: skip
            if mode.startswith("ssp"):
                row["bound"] = (workers - 1) * (2 * int(mode[3:]) + 1)
            rows.append(row)
            print(f"straggler speed {speed} {mode}: share {share:.4f} (form {form['straggler_share']:.4f}) "
                  f"tau_s {row['straggler_tau']:.2f} (form {form['straggler_tau']:.2f}) "
                  f"others {row['other_tau']:.2f} "
                  f"(form {form['other_tau']:.2f}) max {row['tau_max']}", flush=True)  # fmt: skip
    return {"workers": workers, "factor": factor, "closed_form": forms, "rows": rows}


def _relations(workers: int, c: float, cs: float) -> dict[str, float]:
    return {
        "straggler_share": (1 / cs) / ((workers - 1) / c + 1 / cs),
        "straggler_tau": (workers - 1) * cs / c,
        "other_tau": (workers - 2) + c / cs,
    }


def ks_distance(a: list[int], b: list[int]) -> float:
    """Kolmogorov-Smirnov distance of two histograms over 0, 1, 2, ...: the largest gap of their CDFs."""
    n = max(len(a), len(b))
    pa, pb = np.zeros(n), np.zeros(n)
    pa[: len(a)], pb[: len(b)] = a, b
    return float(np.abs(np.cumsum(pa) / pa.sum() - np.cumsum(pb) / pb.sum()).max())


def push_interval_cv(path: str) -> float:
    """The relative spread of the time between a worker's pushes, the median over workers.

    What the real machine adds to a worker's cycle (the OS sharing 2 cores among 3 or 4
    ranks, caches, the server's busy polling): the simulator's ``--jitter`` that matches it.
    The relative standard deviation of the intervals between their 1st and 99th
    percentiles: the rare long gap (server 0 writing the run file) left out.
    """
    with h5py.File(path, "r") as f:
        worker, t = f["staleness/worker"][...], f["staleness/time"][...]
    cvs = []
    for w in np.unique(worker):
        d = np.diff(t[worker == w])[1:]
        low, high = np.percentile(d, [1, 99])
        d = d[(d >= low) & (d <= high)]
        cvs.append(float(d.std() / d.mean()))
    return statistics.median(cvs)


def part_real(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    rows = []
    for n in (3, 4):
        settings = ["ps.mode=async", "train.steps=3000", "data.sampler=shuffle"]
        sys.path.insert(0, str(HERE.parent))
        from reproduce import other_cores

        real = []
        for i in range(args.repeats):
            with other_cores() as load:  # other processes on the cores move the real τ
                real.append(train(work, f"real-n{n}-{i}", n, settings))
            real[-1].update(load)
        jitter = statistics.median(push_interval_cv(r["path"]) for r in real)
        shm, costs = ["--network", "shm-local"], ["--compute", table(work)]
        sims = {
            "table": train(work, f"sim-n{n}-table", n, settings, sim=[*shm, *costs]),
            "measured": train(work, f"sim-n{n}-measured", n, settings, sim=shm),
            f"table, jitter {jitter:.2f}": train(
                work, f"sim-n{n}-jitter", n, settings, sim=[*shm, *costs, "--jitter", f"{jitter:.3f}"]
            ),
        }
        for kind, sim in sims.items():
            distances = [ks_distance(r["tau_hist"], sim["tau_hist"]) for r in real]
            rows.append({"ranks": n, "workers": n - 1, "sim": kind, "ks": distances,
                         "ks_median": statistics.median(distances),
                         "real_hist": [r["tau_hist"] for r in real],
                         "other_cores": max(r["other_cores"] for r in real),
                         "sim_hist": sim["tau_hist"]})  # fmt: skip
            print(f"real -n {n} against the simulator ({kind}): KS {distances}", flush=True)
    return {"rows": rows}


def part_accuracy(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    rows = []
    epochs = args.epochs
    for world, workers in (("sim", 4), ("real", 2)):
        for mode in ("async", "async-lr", "dp"):
            finals = []
            for seed in range(args.seeds):
                settings = [*MODES[mode], f"train.epochs={epochs}", f"seed={seed}", "data.sampler=shuffle"]
                n = workers if mode == "dp" else workers + 1
                sim = ["--network", "eth10g", "--compute", table(work)] if world == "sim" else None
                row = train(work, f"acc-{world}-{mode}-s{seed}", n, settings, sim=sim, mode=mode)
                finals.append(row.get("final_accuracy", float("nan")))
            rows.append({"world": world, "workers": workers, "mode": mode, "finals": finals,
                         "median": statistics.median(finals)})  # fmt: skip
            print(f"accuracy {world} W={workers} {mode}: {finals}", flush=True)
    return {"epochs": epochs, "rows": rows}


def part_scale(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    sim = ["--network", "eth10g", "--compute", table(work)]
    settings = ["ps.mode=async", "ps.compensation=lr", "train.steps=10000"]
    row = train(work, "scale-w1024", 1025, settings,
                sim=sim)  # fmt: skip
    print(f"scale: exit {row['exit']} wall {row['wall_s']} s peak {row.get('peak_rss_mib')} MiB "
          f"accuracy {row.get('final_accuracy')}", flush=True)  # fmt: skip
    return row


# -- figures ---------------------------------------------------------------------------------------


def _suffix(key: str) -> str:
    """``scan@optimizer.momentum=0`` -> ``-momentum0``: the figures of a variant."""
    tags = key.split("@")[1:]
    return "".join("-" + t.split(".")[-1].replace("=", "") for t in tags)


def _title(key: str) -> str:
    tags = key.split("@")[1:]
    return f" ({', '.join(tags)})" if tags else ""


def figures(results: dict[str, Any], out: Path = HERE) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for key in sorted(k for k in results if k.startswith("scan")):
        scan, suffix = results[key].get("rows", []), _suffix(key)
        if not scan:
            continue
        modes = ("async", "ssp1", "ssp4")
        fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), sharey=True)
        for ax, mode in zip(axes, modes):
            for row in (r for r in scan if r["mode"] == mode and r.get("tau_hist")):
                hist = np.array(row["tau_hist"], dtype=float)
                tau = np.nonzero(hist)[0]
                ax.plot(tau + 1, hist[tau] / hist.sum(), "o-", ms=2, lw=1, label=f"W={row['workers']}")
            ax.set(xscale="log", yscale="log", xlabel="τ + 1", title=mode)
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("fraction of pushes")
        axes[-1].legend(fontsize="small")
        fig.suptitle(f"staleness by worker count (digits-mlp, eth10g, one server){_title(key)}")
        fig.tight_layout()
        fig.savefig(out / f"tau-by-workers{suffix}.png", dpi=100)
        plt.close(fig)

        fig, axes = plt.subplots(2, 3, figsize=(15, 8))
        fig.suptitle(f"test accuracy against samples and virtual time{_title(key)}")
        for col, w in enumerate((4, 64, 1024)):
            for row in (r for r in scan if r["workers"] == w):
                curve = row.get("curve")
                if not curve or not curve["samples"]:
                    continue
                acc = 100 * np.array(curve["accuracy"])
                axes[0, col].plot(curve["samples"], acc, lw=1, label=row["mode"])
                axes[1, col].plot(curve["time"], acc, lw=1, label=row["mode"])
            axes[0, col].set(title=f"W = {w}", xlabel="samples processed", ylim=(0, 100))
            axes[1, col].set(xlabel="virtual time (s)", xscale="log", ylim=(0, 100))
        for ax in axes.flat:
            ax.grid(alpha=0.3)
            ax.legend(fontsize="x-small")
        axes[0, 0].set_ylabel("test accuracy (%)")
        axes[1, 0].set_ylabel("test accuracy (%)")
        fig.tight_layout()
        fig.savefig(out / f"accuracy{suffix}.png", dpi=100)
        plt.close(fig)

        fig, ax = plt.subplots(figsize=(7, 4.5))
        for mode in MODES:
            pts = [
                (r["workers"], r["s_per_epoch"])
                for r in scan
                if r["mode"] == mode and math.isfinite(r.get("s_per_epoch", math.nan))
            ]
            if pts:
                ax.plot(*zip(*pts), "o-", label=mode)
        ax.set(xscale="log", yscale="log", xlabel="workers W", ylabel="virtual seconds per epoch",
               title="time per epoch (digits-mlp, eth10g)")  # fmt: skip
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / f"epoch-time{suffix}.png", dpi=100)
        plt.close(fig)

    for part, name, title in (("straggler", "straggler.png", "one straggler (x3) among 8 workers, ib-hdr"),
                              ("jitter", "jitter.png", "homogeneous async, W = 8")):  # fmt: skip
        rows = results.get(part, {}).get("rows", [])
        if not rows:
            continue
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for row in rows:
            hist = np.array(row["tau_hist"], dtype=float)
            label = row.get("mode") or f"{row.get('network')}, jitter {row.get('jitter')}"
            ax.plot(np.arange(len(hist)), hist / hist.sum(), drawstyle="steps-mid", label=label)
        ax.set(yscale="log", xlabel="τ", ylabel="fraction of pushes", title=title)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / name, dpi=100)
        plt.close(fig)

    real = results.get("real", {}).get("rows", [])
    if real:
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
        for ax, n in zip(axes, (3, 4)):
            rows = [r for r in real if r["ranks"] == n]
            if not rows:
                continue
            for i, hist in enumerate(rows[0]["real_hist"]):
                h = np.array(hist, float)
                ax.plot(np.arange(len(h)), h / h.sum(), drawstyle="steps-mid", color="k", alpha=0.5,
                        label="real" if i == 0 else None)  # fmt: skip
            for row in rows:
                h = np.array(row["sim_hist"], float)
                ax.plot(np.arange(len(h)), h / h.sum(), drawstyle="steps-mid", lw=2,
                        label=f"sim ({row['sim']}), KS {row['ks_median']:.3f}")  # fmt: skip
            ax.set(yscale="log", xlabel="τ", title=f"mpiexec -n {n} (W = {n - 1}) against the simulator")
            ax.grid(alpha=0.3)
            ax.legend(fontsize="small")
        axes[0].set_ylabel("fraction of pushes")
        fig.tight_layout()
        fig.savefig(out / "real-vs-sim.png", dpi=100)
        plt.close(fig)


def _row(cells: list[Any]) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def summary(results: dict[str, Any]) -> str:
    """The README's tables, in Markdown, from ``results.json``."""
    out: list[str] = []
    for key in sorted(k for k in results if k.startswith("scan")):
        out += [f"### {key} ({results[key].get('pushes')} pushes = samples / 32 per run)", "",
                "| W | mode | final test acc % | τ median | τ max | virtual s / epoch | wall s |",
                "|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in results[key]["rows"]:
            acc = 100 * r.get("final_accuracy", math.nan)
            note = f" (loss not finite at step {r['steps'] + 1})" if r["exit"] else ""
            tau = f"{r['tau_median']:g} | {r['tau_max']}" if r.get("tau_hist") else "– | –"
            per_epoch = r.get("s_per_epoch", math.nan)
            cells = [
                r["workers"],
                r["mode"],
                f"{acc:.1f}{note}",
                tau,
                f"{per_epoch:.4f}",
                f"{r['wall_s']:.1f}",
            ]
            out.append(_row(cells))
        out.append("")
    if "jitter" in results:
        out += ["### jitter (W = 8, async)", ""]
        for r in results["jitter"]["rows"]:
            exact = r["after_first_round_all_w_minus_1"]
            out.append(f"* {r['network']}, jitter {r['jitter']}: τ histogram {r['tau_hist']}; τ = W − 1 "
                       f"after the first round: {exact}")  # fmt: skip
        out.append("")
    if "straggler" in results:
        st = results["straggler"]
        out += ["### straggler (W = 8, worker 7 x3, ib-hdr)", "",
                "| speed | mode | straggler share % (form) | its τ (form) | others' τ (form) | τ max | SSP "
                "bound |",
                "|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in st["rows"]:
            f = st["closed_form"][str(r["speed"])]
            share = f"{100 * r['straggler_share']:.2f} ({100 * f['straggler_share']:.2f})"
            tau_s = f"{r['straggler_tau']:.2f} ({f['straggler_tau']:.2f})"
            tau_o = f"{r['other_tau']:.2f} ({f['other_tau']:.2f})"
            out.append(_row([r["speed"], r["mode"], share, tau_s, tau_o, r["tau_max"], r.get("bound", "–")]))
        out.append("")
    if "real" in results:
        out += ["### real against simulated", "",
                "| mpiexec -n | W | simulated compute | KS per real run | median |",
                "|---|---|---|---|---|"]  # fmt: skip
        for r in results["real"]["rows"]:
            ks = ", ".join(f"{d:.3f}" for d in r["ks"])
            out.append(f"| {r['ranks']} | {r['workers']} | {r['sim']} | {ks} | {r['ks_median']:.3f} |")
        out.append("")
    if "accuracy" in results:
        out += [f"### accuracy ({results['accuracy']['epochs']} epochs, seeds 0-2)", "",
                "| world | W | mode | final test acc % per seed | median |",
                "|---|---|---|---|---|"]  # fmt: skip
        for r in results["accuracy"]["rows"]:
            finals = ", ".join(f"{100 * a:.2f}" for a in r["finals"])
            out.append(_row([r["world"], r["workers"], r["mode"], finals, f"{100 * r['median']:.2f}"]))
        out.append("")
    if "scale" in results:
        r = results["scale"]
        out += ["### scale", "",
                f"1,024 async workers (compensation lr), {r.get('steps')} pushes: wall {r['wall_s']} s, "
                f"peak RSS {r.get('peak_rss_mib')} MiB, virtual {r.get('virtual_s', math.nan):.2f} s, "
                f"final test accuracy {100 * r.get('final_accuracy', math.nan):.2f} %", ""]  # fmt: skip
    return "\n".join(out)


def comparisons(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The README's "What the issue asked, measured", measured again: rows for ``reproduce.py``."""
    sys.path.insert(0, str(HERE.parent))
    from reproduce import QUIET_CORES, row

    rows = []
    scan = results.get("scan", {}).get("rows", [])
    stale = [r for r in scan if r["mode"] == "async" and r.get("tau_hist")]
    if stale:
        off = [f"W={r['workers']}: {r['tau_median']:g}" for r in stale if r["tau_median"] != r["workers"] - 1]
        scanned = ", ".join(str(r["workers"]) for r in stale)
        rows.append(row("tau-by-workers.png", f"async τ median at W = {scanned}",
                        "W − 1 at every W" if not off else "; ".join(off), "W − 1", not off,
                        "τ median = W − 1 for identical workers"))  # fmt: skip
    for r in results.get("jitter", {}).get("rows", []):
        if r["network"] == "eth10g" and r["jitter"] == 0.0:
            hist = r["tau_hist"]
            rows.append(row("jitter.png", "W = 8, eth10g, no jitter: τ after the first round",
                            f"{hist[7] if len(hist) > 7 else 0:,} of {sum(hist):,} pushes at τ = 7",
                            "τ = W − 1 = 7 for every push", r["after_first_round_all_w_minus_1"],
                            "every push after the first 8 has τ = 7"))  # fmt: skip
    st = results.get("straggler", {})
    for r in st.get("rows", []):
        if r["speed"] != 0.125:
            continue
        form = st["closed_form"][str(r["speed"])]
        if r["mode"] == "async":
            share, target = 100 * r["straggler_share"], 100 * form["straggler_share"]
            rows.append(row("straggler.png", "compute-bound straggler's share of pushes (%)", f"{share:.2f}",
                            f"{target:.2f} (closed form)", abs(share - target) <= 2,
                            "within 2 points of the closed form"))  # fmt: skip
            rows.append(row("straggler.png", "compute-bound straggler's mean τ", f"{r['straggler_tau']:.2f}",
                            f"{form['straggler_tau']:.2f} (closed form)",
                            abs(r["straggler_tau"] - form["straggler_tau"]) <= 2,
                            "within 2 of the closed form"))  # fmt: skip
        elif "bound" in r:
            rows.append(row("straggler.png", f"{r['mode']}: largest τ with the straggler", r["tau_max"],
                            f"≤ {r['bound']} ((W − 1)(2s + 1))", r["tau_max"] <= r["bound"],
                            "SSP's bound holds"))  # fmt: skip
    for r in results.get("real", {}).get("rows", []):
        if r["sim"] == "table":
            ks, busy = r["ks_median"], r.get("other_cores", 0.0)  # (none recorded: a quiet machine)
            noise = f", other processes {busy:.2f} cores" if busy >= QUIET_CORES else ""
            rows.append(row("real-vs-sim.png", f"mpiexec -n {r['ranks']} (W = {r['workers']}) against the "
                            "simulator: KS of τ", f"{ks:.3f} (median of {len(r['ks'])}{noise})",
                            "≤ 0.1" if r["ranks"] == 3 else "information (oversubscribed)",
                            ks <= 0.1 if r["ranks"] == 3 and not noise else None,
                            f"KS ≤ 0.1 at -n 3 with other processes < {QUIET_CORES} cores, else not "
                            "comparable; -n 4 oversubscribes 2 cores"))  # fmt: skip
    acc = {(r["world"], r["mode"]): r for r in results.get("accuracy", {}).get("rows", [])}
    for world, workers in (("sim", 4), ("real", 2)):
        if (world, "async-lr") in acc and (world, "dp") in acc:
            gap = 100 * (acc[world, "async-lr"]["median"] - acc[world, "dp"]["median"])
            rows.append(row("accuracy table", f"{world} W = {workers}: async-lr − sync DP accuracy (points)",
                            f"{gap:+.2f}", "within 1 point", abs(gap) <= 1,
                            "|median async-lr − median sync DP| ≤ 1 point"))  # fmt: skip
    scale = results.get("scale")
    if scale:
        ok = scale.get("exit") == 0 and scale["wall_s"] <= 600
        rows.append(row("scale", "1,024 async workers, 10,000 pushes: wall time", f"{scale['wall_s']:.1f} s",
                        "≤ 600 s", ok, "the run finishes within 10 minutes"))  # fmt: skip
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True, help="directory for the run files")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--workers", nargs="+", type=int, default=list(WORKERS))
    parser.add_argument("--pushes", type=int, default=4000, help="scan: pushes (samples / 32) per run")
    parser.add_argument("--repeats", type=int, default=5, help="real: real runs per rank count")
    parser.add_argument("--seeds", type=int, default=3, help="accuracy: seeds per mode")
    parser.add_argument("--epochs", type=int, default=30, help="accuracy: epochs per run")
    parser.add_argument("--figures-only", action="store_true", help="redraw the figures from results.json")
    parser.add_argument("--summary", action="store_true", help="print the README's tables from results.json")
    parser.add_argument(
        "--set",
        dest="extra",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a setting for every run (repeatable): results go under PART@KEY=VALUE",
    )
    parser.add_argument("--reproduce", choices=list(SIZES),
                        help="every part at this size; results, figures, summary.json in --work")  # fmt: skip
    args = parser.parse_args()
    if args.reproduce:
        vars(args).update(SIZES[args.reproduce], parts=list(PARTS), extra=[], figures_only=False)
        args.work.mkdir(parents=True, exist_ok=True)
        (args.work / "results.json").unlink(missing_ok=True)
    out = args.work if args.reproduce else HERE  # results.json and the figures
    if args.summary:
        store = HERE / "results.json"
        print(summary(json.loads(store.read_text())))
        return 0
    EXTRA[:] = args.extra
    tag = "".join(f"@{item}" for item in args.extra)
    args.work.mkdir(parents=True, exist_ok=True)
    store = out / "results.json"
    results: dict[str, Any] = json.loads(store.read_text()) if store.exists() else {}
    if not args.figures_only:
        if "profile" in args.parts or not (args.work / "profile.h5").exists():
            results["profile"] = part_profile(args.work, args)
        for part in args.parts:
            if part == "profile":
                continue
            t0 = time.monotonic()
            fn = globals()[f"part_{part}"]
            key = part + tag
            results[key] = (
                fn(args.work, args, results["profile"]) if part == "straggler" else fn(args.work, args)
            )
            results[key].update(part_wall_s=round(time.monotonic() - t0, 1), settings=args.extra)
            store.write_text(json.dumps(results, indent=1))
            print(f"== {key}: {results[key]['part_wall_s']} s", flush=True)
    figures(results, out)
    if args.reproduce:
        sys.path.insert(0, str(HERE.parent))
        from reproduce import write_summary

        write_summary(args.work, HERE.name, args.reproduce, comparisons(results), sizes=SIZES[args.reproduce])
    return 0


if __name__ == "__main__":
    sys.exit(main())
