"""In-network aggregation: "Parameter Aggregation using Software Switch for Multi-GPU Deep Learning" (issue 26).

The paper (IEICE CPSY2019-81) sums the gradients of a 40 GbE GPU cluster in a DPDK software
switch and finds it about 2.2-2.5x faster than summing them on a host, whose kernel per-packet
processing dominates at that bandwidth. Parts:

* ``calibrate``: the switch program's CPU per datagram received on this machine
  (``python -m hpcdl.bench switch --calibrate``): the batched loop's (the software switch) and
  the one-datagram-per-call loop's (the host's kernel-socket receive loop), written into
  network files for 10, 40 and 100 GbE (``eth10g``, ``eth40g``, and ``eth40g`` at 100 Gb/s).
* ``sim``: the simulator, ``--compute none``, the last rank as the switch
  (``bench exchange --variants ring switch-rank``, ``SIM_SLOTS`` slots): one aggregation of
  a 1 MiB vector, and of 2 MiB, at W = 2 ... 64 workers, the switch rank as the software switch
  (one core: ``serial``), as a host (``mode = "host"``), and as a hardware switch (a port
  each at 1 ns a packet: ``parallel``), beside hpcdl's ring on the same workers; and the
  analytic times. mlp32's and ResNet-50's gradients are on the line through the two sizes
  (a constant of latencies plus a term linear in the bytes: checked by simulating mlp32's own
  size at the smallest W), and training samples/s from them and a stated device's compute.
* ``real``: on loopback, ``mpiexec -n W python -m hpcdl.bench exchange`` for W = 2 ... 4: the UDP
  switch at 0, 1 and 10 % loss against MPI's Allreduce and hpcdl's ring, mlp32's gradients.
* ``accuracy``: digits-mlp trained through the UDP switch (int32, -n 2) against the float32
  bucketed exchange, seeds 0-2.

    python jobs/experiments/switch/run.py --work /tmp/switch                # every part
    python jobs/experiments/switch/run.py --work /tmp/switch --parts sim
    python jobs/experiments/switch/run.py --tables                          # the README's tables
    python jobs/experiments/switch/run.py --reproduce small --work /tmp/sw  # make reproduce

Rows go to ``results.json`` beside this script (each part replaces its own entry), figures to
``*.png`` beside it. With ``--reproduce SIZE`` everything goes to ``--work`` with ``summary.json``.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import h5py

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from reproduce import env, experiment_parser, open_results, row, run_parts, write_summary  # noqa: E402

PYTHON = sys.executable
MPIEXEC = str(Path(sys.executable).with_name("mpiexec"))
PARTS = ("calibrate", "sim", "real", "accuracy")
MIB = 2**20
#: bytes of float32 gradients (the models' parameter counts x 4)
MODEL_BYTES = {"mlp32": 8_286_730 * 4, "resnet50": 25_557_032 * 4}
PAYLOAD = 1024
HEADER = 24
#: the 100 GbE network: eth40g's latency and framing at 100 Gb/s (4.6/5 of the line rate)
ETH100G_GBPS = 11.5
#: an ideal hardware switch: a packet a nanosecond on every port (a P4 pipeline at line rate)
HW_PER_PACKET_US = 0.001
#: slots per worker in the simulated runs: a window of 256 KiB covers 100 GbE's bandwidth-delay
#: product (11.5 GB/s x 16 us = 184 KB), so the line, not the window, bounds a hardware switch
SIM_SLOTS = 256
SEEDS = (0, 1, 2)
#: forward FLOPs per sample: mlp32's dense layers (2 per weight), ResNet-50 at 224x224 (3.8 G
#: multiply-adds, He et al. 2016); a training step is 3 forwards' worth (forward + backward)
FORWARD_FLOP = {"mlp32": 2 * 8_286_730, "resnet50": 2 * 3.8e9}
#: the stated device for samples/s: 7 TFLOP/s sustained (a V100's 15.7 TFLOP/s FP32 peak at 45 %)
DEVICE_FLOPS = 7e12
#: samples per worker per step
BATCH = 64
MODES = ("switch", "host", "hardware", "ring")
SIZES: dict[str, dict[str, Any]] = {
    "small": {"parts": ["calibrate", "sim", "real", "accuracy"], "workers": [2, 4, 8], "bytes": MIB,
              "check_bytes": 4 * MIB, "real_ranks": [2], "repeat": 2, "runs": 1, "seeds": (0,), "seconds": 0.5,
              "networks": ["eth40g"], "steps": 60},  # fmt: skip
    "full": {"parts": list(PARTS), "workers": [2, 4, 8, 16, 32, 64], "bytes": MIB,
             "check_bytes": MODEL_BYTES["mlp32"], "real_ranks": [2, 3, 4], "repeat": 5, "runs": 3, "seeds": SEEDS,
             "seconds": 2.0, "networks": ["eth10g", "eth40g", "eth100g"], "steps": 0},  # fmt: skip
}


def sh(args: list[str], log: Path) -> None:
    """Run a command, its output to ``log``; a failure ends the study with the log's tail."""
    with log.open("w") as f:
        code = subprocess.run(args, stdout=f, stderr=subprocess.STDOUT, env=env(), check=False).returncode
    if code:
        tail = log.read_text().splitlines()[-15:]
        raise SystemExit(f"{' '.join(args)} failed ({code}):\n" + "\n".join(tail))


def networks(work: Path, names: list[str], costs: dict[str, float]) -> dict[str, dict[str, Path]]:
    """Each network's three files (a software switch, a host, a hardware switch) from eth40g's
    calibrated ones, the base's links in each."""
    out: dict[str, dict[str, Path]] = {}
    for name in names:
        base = tomllib.loads((work / "calibrated" / "eth40g-switch.toml").read_text())
        if name != "eth40g":
            preset = "eth40g" if name == "eth100g" else name
            text = (Path(__file__).resolve().parents[3] / "hpcdl" / "sim" / "networks" / f"{preset}.toml")
            base = {**tomllib.loads(text.read_text()), "switch": base["switch"]}
        if name == "eth100g":
            base["inter"] = {**base["inter"], "bandwidth_GBps": ETH100G_GBPS}
        files = {}
        for mode, section in (
            ("switch", {"rank": -1, "mode": "switch", "per_packet_us": costs["switch"], "processing": "serial"}),
            ("host", {"rank": -1, "mode": "host", "per_packet_us": costs["host"]}),
            ("hardware", {"rank": -1, "mode": "switch", "per_packet_us": HW_PER_PACKET_US,
                          "processing": "parallel"}),
        ):  # fmt: skip
            table = {k: v for k, v in base.items() if k not in ("switch", "name", "source")}
            table["switch"] = section
            path = work / "networks" / f"{name}-{mode}.toml"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(_toml(table))
            files[mode] = path
        out[name] = files
    return out


def _toml(table: dict[str, Any]) -> str:
    from hpcdl.sim.network import network_toml  # noqa: PLC0415

    return network_toml(table)


def analytic(nbytes: int, workers: int, net: dict[str, Any], c_switch: float, c_host: float) -> dict[str, float]:
    """Seconds to aggregate ``nbytes`` at W workers by the formulas of the README.

    n = ceil(S / P) datagrams of D = 24 + P bytes per worker; B the line rate, α the latency.
    Switch (one core): 4α + max(n D / B, W n c, n 2α / K); hardware switch: 4α + max(n D / B,
    n c_hw, n 2α / K); host: 4α + max(W n D / B, W n c_host); ring: 2 (W - 1) (α + S / (W B)).
    The 4α are the exponent round's and the last chunk's round trips; n 2α / K is the window's
    bound (K = ``SIM_SLOTS`` chunks in flight, one round trip each).
    """
    b = net["inter"]["bandwidth_GBps"] * 1e9
    alpha = net["inter"]["latency_us"] * 1e-6
    n = math.ceil(nbytes / PAYLOAD)
    wire = n * (HEADER + PAYLOAD) / b
    rounds = 4 * alpha  # the exponent round's and the last chunk's round trips
    window = n * 2 * alpha / SIM_SLOTS
    return {
        "switch": rounds + max(wire, workers * n * c_switch * 1e-6, window),
        "hardware": rounds + max(wire, n * HW_PER_PACKET_US * 1e-6, window),
        "host": rounds + max(workers * wire, workers * n * c_host * 1e-6, window),
        "ring": 2 * (workers - 1) * (alpha + nbytes / (workers * b)),
    }


def step_compute_s(model: str) -> float:
    """Seconds of one worker's forward and backward of a ``BATCH`` on the stated device."""
    return 3 * FORWARD_FLOP[model] * BATCH / DEVICE_FLOPS


def at_size(r: dict[str, Any], mode: str, nbytes: int) -> float:
    """A mode's simulated ms at ``nbytes``: the line through its times at ``bytes`` and twice
    that (a constant of latencies and a term linear in the bytes; checked by ``linearity``)."""
    t1, t2 = r[f"{mode}_ms"], r[f"{mode}_2x_ms"]
    return t1 + (t2 - t1) * (nbytes / r["bytes"] - 1)


def model_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Per network, W and model: each mode's time to aggregate the model's gradients
    (:func:`at_size`) and training samples/s with the step's compute and the aggregation one
    after the other (no overlap)."""
    out = []
    for r in results["sim"]["rows"]:
        for model, nbytes in MODEL_BYTES.items():
            compute = step_compute_s(model)
            row_ = {"network": r["network"], "workers": r["workers"], "model": model, "compute_ms": compute * 1e3}
            for mode in MODES:
                ms = at_size(r, mode, nbytes)
                row_[f"{mode}_ms"] = ms
                row_[f"{mode}_samples_per_s"] = r["workers"] * BATCH / (compute + ms / 1e3)
            out.append(row_)
    return out


def simulate(work: Path, network: Path, workers: int, nbytes: int, variants: list[str]) -> dict[str, float]:
    """One aggregation in the simulator: ms per variant (the last of W + 1 ranks the switch)."""
    out = work / "sim" / f"{network.stem}-w{workers}-{nbytes}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    sh([PYTHON, "-m", "hpcdl.simulate", "-n", str(workers + 1), "--network", str(network), "--compute", "none",
        "-m", "hpcdl.bench", "exchange", "--variants", *variants, "--size", str(nbytes), "--repeat", "1",
        "--slots", str(SIM_SLOTS),
        "--json", str(out)], out.with_suffix(".log"))  # fmt: skip
    return {r["variant"]: r["ms"] for r in json.loads(out.read_text())}


def part_calibrate(work: Path, size: dict[str, Any], results: dict[str, Any]) -> dict[str, Any]:
    out = work / "calibrated"
    out.mkdir(parents=True, exist_ok=True)
    rows_path = work / "bench-switch.json"
    sh([PYTHON, "-m", "hpcdl.bench", "switch", "--workers", "2", "4", "--seconds", str(size["seconds"]),
        "--repeat", "3", "--calibrate", str(out), "--base", "eth40g", "--json", str(rows_path)],
       work / "calibrate.log")  # fmt: skip
    costs = {mode: tomllib.loads((out / f"eth40g-{mode}.toml").read_text())["switch"]["per_packet_us"]
             for mode in ("switch", "host")}  # fmt: skip
    return {"per_packet_us": costs, "bench": json.loads(rows_path.read_text())}


def part_sim(work: Path, size: dict[str, Any], results: dict[str, Any]) -> dict[str, Any]:
    costs = results["calibrate"]["per_packet_us"]
    files = networks(work, size["networks"], costs)
    rows = []
    for name, by_mode in files.items():
        net = tomllib.loads(by_mode["switch"].read_text())
        for w in size["workers"]:
            row_: dict[str, Any] = {"network": name, "workers": w, "bytes": size["bytes"]}
            for suffix, nbytes in (("", size["bytes"]), ("_2x", 2 * size["bytes"])):
                ms = simulate(work, by_mode["switch"], w, nbytes, ["ring", "switch-rank"])
                row_[f"switch{suffix}_ms"], row_[f"ring{suffix}_ms"] = ms["switch-rank"], ms["ring"]
                for mode in ("host", "hardware"):
                    row_[f"{mode}{suffix}_ms"] = simulate(work, by_mode[mode], w, nbytes, ["switch-rank"])["switch-rank"]
            model = analytic(size["bytes"], w, net, costs["switch"], costs["host"])
            rows.append({**row_, **{f"analytic_{k}_ms": v * 1e3 for k, v in model.items()}})
    # linearity: the smallest W at the check size, simulated, against the line through 1x and 2x
    w = min(size["workers"])
    check = simulate(work, files["eth40g"]["switch"], w, size["check_bytes"], ["ring", "switch-rank"])
    base = next(r for r in rows if r["network"] == "eth40g" and r["workers"] == w)
    linearity = {"workers": w, "bytes": size["check_bytes"], "switch_ms": check["switch-rank"],
                 "switch_line_ms": at_size(base, "switch", size["check_bytes"]), "ring_ms": check["ring"],
                 "ring_line_ms": at_size(base, "ring", size["check_bytes"])}  # fmt: skip
    return {"rows": rows, "linearity": linearity, "per_packet_us": costs}


def part_real(work: Path, size: dict[str, Any], results: dict[str, Any]) -> dict[str, Any]:
    """``bench exchange`` at each W, ``runs`` times in turn; the rows are the medians over the runs."""
    runs: list[list[dict[str, Any]]] = []
    for k in range(size["runs"]):
        rows = []
        for n in size["real_ranks"]:
            out = work / f"real-n{n}-{k}.json"
            sh([MPIEXEC, "-n", str(n), PYTHON, "-m", "hpcdl.bench", "exchange", "--model", "mlp32", "--loss", "0",
                "0.01", "0.1", "--repeat", str(size["repeat"]), "--json", str(out)], out.with_suffix(".log"))  # fmt: skip
            rows += json.loads(out.read_text())
        runs.append(rows)
    return {"rows": median_rows(runs), "runs": runs}


def median_rows(runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per (W, variant): the median over the runs of ms, the ratios and retransmissions, each
    ratio the median of the runs' ratios (a ratio is of one run's interleaved figures)."""
    out = []
    for first in runs[0]:
        same = [next(r for r in rows if (r["workers"], r["variant"]) == (first["workers"], first["variant"]))
                for rows in runs]  # fmt: skip
        merged = dict(first)
        for key in ("ms", "vs_mpi", "vs_no_loss", "retransmissions", "datagrams"):
            if key in first:
                merged[key] = statistics.median(r[key] for r in same)
        merged["runs_ms"] = [r["ms"] for r in same]
        if "vs_no_loss" in first:
            merged["runs_vs_no_loss"] = [r["vs_no_loss"] for r in same]
        out.append(merged)
    return out


def part_accuracy(work: Path, size: dict[str, Any], results: dict[str, Any]) -> dict[str, Any]:
    rows = []
    for seed in size["seeds"]:
        for name, sets in (("float32", ["exchange.name=\"bucketed\""]), ("switch int32", ["exchange.name=\"switch\""])):
            run = work / f"accuracy-{name.replace(' ', '-')}-{seed}.h5"
            for old in [run, *work.glob(f"{run.stem}.ckpt-*.h5")]:  # a run of an earlier study
                old.unlink(missing_ok=True)
            steps = ["--set", f"train.steps={size['steps']}"] if size["steps"] else []
            args = [MPIEXEC, "-n", "2", PYTHON, "-m", "hpcdl.train", "--config", "digits-mlp", "--progress", "none",
                    "--set", f"seed={seed}", "--set", "checkpoint.every=0", *steps,
                    *[x for s in sets for x in ("--set", s)], "--out", str(run)]  # fmt: skip
            sh(args, run.with_suffix(".log"))
            with h5py.File(run, "r") as f:
                acc = f["metrics/test_accuracy"][()]
                acc = [float(a) for a in acc if a == a]
            rows.append({"exchange": name, "seed": seed, "test_accuracy": acc[-1]})
    return {"rows": rows}


def tables(results: dict[str, Any]) -> str:
    """The README's tables from ``results.json``."""
    out = []
    if "calibrate" in results:
        c = results["calibrate"]["per_packet_us"]
        out.append(f"per datagram received: switch (batched) {c['switch']:.3g} us, host (one per call) {c['host']:.3g} us")
    if "sim" in results:
        out.append("| network | W | switch ms | (analytic) | host ms | (analytic) | host/switch | hardware ms | ring ms | "
                   "(analytic) | ring/hardware |")
        out.append("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in results["sim"]["rows"]:
            out.append(
                f"| {r['network']} | {r['workers']} | {r['switch_ms']:.2f} | {r['analytic_switch_ms']:.2f} | "
                f"{r['host_ms']:.2f} | {r['analytic_host_ms']:.2f} | {r['host_ms'] / r['switch_ms']:.2f} | "
                f"{r['hardware_ms']:.3f} | {r['ring_ms']:.3f} | {r['analytic_ring_ms']:.3f} | "
                f"{r['ring_ms'] / r['hardware_ms']:.2f} |"
            )
        lin = results["sim"]["linearity"]
        out.append("")
        out.append(f"linearity at W = {lin['workers']}, {lin['bytes'] / MIB:.1f} MiB: switch {lin['switch_ms']:.2f} ms "
                   f"simulated, {lin['switch_line_ms']:.2f} on the line; ring {lin['ring_ms']:.3f} and "
                   f"{lin['ring_line_ms']:.3f}")  # fmt: skip
        out.append("")
        out.append("| network | model | W | compute ms | switch ms | host ms | hardware ms | ring ms | "
                   "samples/s: switch | host | hardware | ring |")
        out.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in model_rows(results):
            out.append(
                f"| {r['network']} | {r['model']} | {r['workers']} | {r['compute_ms']:.1f} | "
                + " | ".join(f"{r[f'{m}_ms']:.1f}" for m in MODES)
                + " | "
                + " | ".join(f"{r[f'{m}_samples_per_s']:,.0f}" for m in MODES)
                + " |"
            )
    if "real" in results:
        out.append("| W | variant | ms (median; runs) | x MPI | retransmissions per exchange per worker | "
                   "x no loss (runs) |")  # fmt: skip
        out.append("|---|---|---|---|---|---|")
        for r in results["real"]["rows"]:
            runs = ", ".join(f"{x:.1f}" for x in r.get("runs_ms", [r["ms"]]))
            extra = " | "
            if "datagrams" in r:
                ratios = ", ".join(f"{x:.3f}" for x in r.get("runs_vs_no_loss", [r["vs_no_loss"]]))
                extra = f"{r['retransmissions']:,.0f} | {r['vs_no_loss']:.3f} ({ratios})"
            out.append(f"| {r['workers']} | {r['variant']} | {r['ms']:.1f} ({runs}) | {r['vs_mpi']:.2f} | {extra} |")
    if "accuracy" in results:
        for name in ("float32", "switch int32"):
            accs = [r["test_accuracy"] for r in results["accuracy"]["rows"] if r["exchange"] == name]
            out.append(f"{name}: test accuracy {statistics.median(accs):.4f} (seeds: {', '.join(f'{a:.4f}' for a in accs)})")
    return "\n".join(out)


def comparisons(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The summary's rows: the paper's ratio, the 2x of the line rate, the loss target, accuracy."""
    rows = []
    if "sim" in results:
        at40 = [r for r in results["sim"]["rows"] if r["network"] == "eth40g"]
        ratios = [r["host_ms"] / r["switch_ms"] for r in at40]
        rows.append(row("sim", "host / software switch time at 40 GbE, W = 2 ... 64",
                        ", ".join(f"{x:.2f}" for x in ratios), "2.2-2.5x (paper)",
                        any(2.2 <= x <= 2.5 for x in ratios), "some W in [2.2, 2.5]"))  # fmt: skip
        big = max((r for r in model_rows(results) if r["network"] == "eth40g" and r["model"] == "resnet50"),
                  key=lambda r: r["workers"])  # fmt: skip
        ratio = big["ring_ms"] / big["hardware_ms"]
        rows.append(row("sim", f"ring / hardware switch, ResNet-50's gradients at W = {big['workers']}, 40 GbE",
                        f"{ratio:.2f}", "-> 2 at large W", abs(ratio - 2) < 0.3, "within 0.3 of 2"))  # fmt: skip
        lin = results["sim"]["linearity"]
        for mode in ("switch", "ring"):
            err = lin[f"{mode}_ms"] / lin[f"{mode}_line_ms"] - 1
            rows.append(row("sim", f"{mode}: simulated at {lin['bytes'] / MIB:.1f} MiB / the line through 1 and 2 MiB",
                            f"{1 + err:.4f}", "1", abs(err) < 0.02, "within 2 %"))  # fmt: skip
    if "real" in results:
        for r in results["real"]["rows"]:
            if r["variant"] == "switch loss 0.01":
                rows.append(row("real", f"UDP switch at 1 % loss / 0 %, W = {r['workers']}",
                                f"{r['vs_no_loss']:.3f}", "<= 1.10", r["vs_no_loss"] <= 1.10, "ratio of medians"))  # fmt: skip
    if "accuracy" in results:
        accs = {name: statistics.median(r["test_accuracy"] for r in results["accuracy"]["rows"] if r["exchange"] == name)
                for name in ("float32", "switch int32")}  # fmt: skip
        diff = accs["switch int32"] - accs["float32"]
        rows.append(row("accuracy", "digits-mlp test accuracy, switch int32 - float32 (median of seeds)",
                        f"{diff:+.4f}", "about 0", abs(diff) <= 1 / 360 * 3, "within 3 test images"))  # fmt: skip
    return rows


def figures(results: dict[str, Any], out: Path) -> None:
    """``aggregation.png``: simulated time per aggregation against W, each network, with the
    analytic lines; ``real.png``: the loopback exchange per variant."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    if "sim" in results:
        rows = results["sim"]["rows"]
        nets = list(dict.fromkeys(r["network"] for r in rows))
        fig, axes = plt.subplots(1, len(nets), figsize=(5 * len(nets), 4), squeeze=False)
        for ax, net in zip(axes[0], nets):
            mine = [r for r in rows if r["network"] == net]
            w = [r["workers"] for r in mine]
            for key, label, color in (("host", "host (one core, kernel loop)", "C3"),
                                      ("switch", "software switch (one core, batched)", "C0"),
                                      ("ring", "ring allreduce", "C2"),
                                      ("hardware", "hardware switch (a port each)", "C1")):  # fmt: skip
                ax.plot(w, [r[f"{key}_ms"] for r in mine], "o-", color=color, label=label)
                ax.plot(w, [r[f"analytic_{key}_ms"] for r in mine], "--", color=color, alpha=0.6)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("workers W")
            ax.set_ylabel(f"ms per aggregation of {mine[0]['bytes'] / MIB:g} MiB")
            ax.set_title(f"{net} (simulated; dashed: analytic)")
        axes[0][0].legend(fontsize="small")
        fig.tight_layout()
        fig.savefig(out / "aggregation.png", dpi=110)
        plt.close(fig)
        models = model_rows(results)
        fig, axes = plt.subplots(1, len(MODEL_BYTES), figsize=(5 * len(MODEL_BYTES), 4), squeeze=False)
        for ax, model in zip(axes[0], MODEL_BYTES):
            mine = [r for r in models if r["model"] == model and r["network"] == "eth40g"]
            w = [r["workers"] for r in mine]
            for mode, color in zip(MODES, ("C0", "C3", "C1", "C2")):
                ax.plot(w, [r[f"{mode}_samples_per_s"] for r in mine], "o-", color=color, label=mode)
            ax.plot(w, [x * BATCH / (mine[0]["compute_ms"] / 1e3) for x in w], ":", color="k", label="compute only")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("workers W")
            ax.set_ylabel("training samples/s (no overlap)")
            ax.set_title(f"{model}, 40 GbE, {BATCH} samples/worker at {DEVICE_FLOPS / 1e12:g} TFLOP/s")
        axes[0][0].legend(fontsize="small")
        fig.tight_layout()
        fig.savefig(out / "samples.png", dpi=110)
        plt.close(fig)
    if "real" in results:
        rows = results["real"]["rows"]
        ranks = sorted({r["workers"] for r in rows})
        variants = list(dict.fromkeys(r["variant"] for r in rows))
        fig, ax = plt.subplots(figsize=(7, 4))
        width = 0.8 / len(variants)
        for i, v in enumerate(variants):
            ms = [next((r["ms"] for r in rows if r["workers"] == n and r["variant"] == v), math.nan) for n in ranks]
            ax.bar([k + i * width for k in range(len(ranks))], ms, width, label=v)
        ax.set_xticks([k + 0.4 - width / 2 for k in range(len(ranks))], [f"W = {n}" for n in ranks])
        ax.set_yscale("log")
        ax.set_ylabel("ms per exchange of mlp32's gradients (loopback)")
        ax.legend(fontsize="small")
        fig.tight_layout()
        fig.savefig(out / "real.png", dpi=110)
        plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = experiment_parser(__doc__, list(PARTS), list(PARTS), list(SIZES))
    args = parser.parse_args(argv)
    out = HERE
    size, out, results_path, results = open_results(args, SIZES, out)
    if args.tables:
        print(tables(results))
        return 0
    if not args.figures_only:
        work = args.work or Path("/tmp/hpcdl-switch")
        work.mkdir(parents=True, exist_ok=True)
        parts = {"calibrate": part_calibrate, "sim": part_sim, "real": part_real, "accuracy": part_accuracy}
        run_parts(args.parts, results, results_path, lambda name: parts[name](work, size, results))
    figures(results, out)
    print(tables(results))
    if args.reproduce:
        write_summary(out, "switch", args.reproduce, comparisons(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
