"""``bench planner``: the hybrid planner's own time on ResNet-50's blocks, up to 1,024 ranks.

For each network and rank count N, :func:`hpcdl.parallel.pipe_planner.plan` plans
ResNet-50's 22 top-level layers (the stem's convolution, batch norm, ReLU and max-pool, 16
bottleneck blocks, the pool and the classifier) for a global batch of ``--batch-per-rank``
× N samples. Beside it, timed alike and interleaved with it, the reference:
:func:`~hpcdl.parallel.pipe_planner.baselines` alone (the four layouts a user would
otherwise pick, each with its best microbatch cut), which ``plan`` computes first as the
bound it prunes by; what ``plan`` takes beyond it is its search. Figures are medians of
``--repeat`` repetitions of wall time, with the planner's CPU time beside it (on a shared
machine the wall time also holds the waits for a core); the table also gives the plan,
its predicted step and the best baseline's.

**The costs are measured, not analytic**: the packaged table
``hpcdl/bench/data/resnet50-224.toml`` (or ``--costs``), ResNet-50's forward and backward
seconds per top-level layer at 8 samples of 3×224×224, profiled once with
:func:`~hpcdl.parallel.pipe_profile.profile_costs` on one core of the development machine
(the file's header says how), divided by ``--speedup``: one CPU core trains about 2
samples/s, an accelerator some hundreds (the default 200 gives 416), and the network's
weight beside compute is what decides whether a pipeline beats data parallelism.
Parameters and output bytes are the model's own (:func:`~hpcdl.parallel.pipe_profile.layer_infos`,
a one-sample forward). **The network** is a simulator network file (a packaged name or a
path) read as ``pipeline.network`` is: α-β of the link between two of the N ranks. The
default pair puts the optimum on both sides: ``ib-hdr`` mostly pure data parallel,
``eth10g`` pipelines of replicated stages.
"""

from __future__ import annotations

import statistics
import time
from importlib import resources
from pathlib import Path
from typing import Any

from hpcdl.comm import world, wtime
from hpcdl.driver.cli import nonnegative_float, positive_float, positive_int
from hpcdl.errors import ConfigError
from hpcdl.models import resnet50
from hpcdl.parallel.pipe_plan import LayerInfo
from hpcdl.parallel.pipe_planner import CostModel, Network, baselines, plan
from hpcdl.parallel.pipe_profile import layer_infos
from hpcdl.rng import generator
from hpcdl.sim.network import Network as SimNetwork
from hpcdl.sim.network import load_network
from hpcdl.store.costs import load_cost_table

__all__ = ["add_parser", "bench_planner", "run", "COSTS"]

#: the packaged cost table (``hpcdl/bench/data/``)
COSTS = "resnet50-224.toml"
#: the model the table was measured on: one sample's shape and the classes
INPUT, CLASSES = (3, 224, 224), 1000
#: a table row without a batch is taken as measured at this many samples
_DEFAULT_BATCH = 8


def resnet50_layers(costs: str | None, speedup: float) -> tuple[list[LayerInfo], int]:
    """ResNet-50's top-level layers with the table's times divided by ``speedup``, and the batch
    they are given at (the table's).

    Raises:
        CostTableError: the table cannot be read, or lacks a row for one of the layers.
    """
    if costs is None:
        with resources.as_file(resources.files("hpcdl.bench").joinpath("data", COSTS)) as path:
            table = load_cost_table(path)
    else:
        table = load_cost_table(costs)
    batch = next(iter(table.values())).batch or _DEFAULT_BATCH
    model = resnet50(INPUT, CLASSES, rng=generator(0, "init"))
    infos = layer_infos(model, INPUT, batch, table)
    missing = [x.name for x in infos if x.name not in table]
    if missing:
        raise ConfigError(
            f"cost table {costs or COSTS} has no row for ResNet-50's layer {missing[0]!r}: "
            "give a table profiled on hpcdl's resnet50 at 3x224x224"
        )
    scaled = [
        LayerInfo(x.name, x.params, x.forward_s / speedup, x.backward_s / speedup, x.output_bytes)
        for x in infos
    ]
    return scaled, batch


def link(net: SimNetwork, ranks: int) -> Network:
    """The planner's network from a simulator's, as ``pipeline.network`` is read
    (:meth:`hpcdl.sim.network.Network.alpha_beta`)."""
    return Network(*net.alpha_beta(ranks))


def bench_planner(
    networks: list[str],
    ranks: list[int],
    batch_per_rank: int,
    speedup: float,
    schedule: str,
    memory_mb: float,
    repeat: int,
    costs: str | None = None,
) -> list[dict[str, Any]]:
    """The planner's and the baselines' median times, and the plan, per network and rank count.

    Args:
        networks: simulator network files (packaged names or paths).
        ranks: the rank counts N.
        batch_per_rank: the global batch is this × N.
        speedup: the cost table's times are divided by it.
        schedule: ``gpipe`` or ``1f1b``.
        memory_mb: MiB of activations per rank (0: no limit).
        repeat: repetitions; the medians are reported.
        costs: a cost table of ResNet-50 (None: the packaged one).

    Returns:
        One row per network and rank count.

    Raises:
        ConfigError: a network file or cost table that cannot be read, or no plan within
            the memory limit.
    """
    nets = {name: load_network(name) for name in networks}  # a bad file fails before the model is built
    layers, batch = resnet50_layers(costs, speedup)
    rows = []
    for name, net in nets.items():
        for n in ranks:
            model = CostModel(layers, batch, link(net, n), schedule, memory_mb * 2**20)
            global_batch = batch_per_rank * n
            plan_s, plan_cpu_s, base_s = [], [], []
            for _ in range(repeat):
                t0 = wtime()
                others = baselines(model, n, global_batch)
                base_s.append(wtime() - t0)
                t0, c0 = wtime(), time.process_time()
                chosen, step = plan(model, n, global_batch)
                plan_s.append(wtime() - t0)
                plan_cpu_s.append(time.process_time() - c0)
            fits = {k: v for k, v in others.items() if v is not None}
            best = min(fits, key=lambda k: fits[k][1]) if fits else None
            rows.append(
                {
                    "network": name,
                    "ranks": n,
                    "global_batch": global_batch,
                    "layers": len(layers),
                    "schedule": schedule,
                    "memory_mb": memory_mb,
                    "speedup": speedup,
                    "costs": costs or COSTS,
                    "plan": str(chosen),
                    "balance": list(chosen.balance),
                    "replicas": list(chosen.replicas),
                    "microbatches": chosen.microbatches,
                    "predicted_step_s": step,
                    "best_baseline": best,
                    "baseline_step_s": fits[best][1] if best else None,
                    "plan_s": statistics.median(plan_s),
                    "plan_s_min": min(plan_s),
                    "plan_s_max": max(plan_s),
                    "plan_cpu_s": statistics.median(plan_cpu_s),  # what other processes take is not in it
                    "baselines_s": statistics.median(base_s),
                    "repeat": repeat,
                }
            )
    return rows


def print_rows(rows: list[dict[str, Any]]) -> None:
    """The table: one line per network and rank count."""
    r0 = rows[0]
    limit = (
        f"at most {r0['memory_mb']:g} MiB of activations per rank" if r0["memory_mb"] else "no memory limit"
    )
    print(
        f"bench planner: ResNet-50, {r0['layers']} top-level layers (costs {Path(r0['costs']).name} / "
        f"{r0['speedup']:g}), {r0['schedule']}, {r0['global_batch'] // r0['ranks']} samples per rank, "
        f"{limit}; median of {r0['repeat']} interleaved repetitions"
    )
    columns = (("ranks", 6), ("global batch", 13), ("plan s", 9), ("cpu s", 8), ("baselines s", 12),
               ("step ms", 10), ("best baseline ms", 24))  # fmt: skip
    print("network".ljust(10) + "".join(h.rjust(w) for h, w in columns) + "  plan")
    for r in rows:
        base = f"{r['baseline_step_s'] * 1e3:.3f} ({r['best_baseline']})" if r["best_baseline"] else "-"
        step = r["predicted_step_s"] * 1e3
        print(f"{r['network']:<10}{r['ranks']:>6}{r['global_batch']:>13,}{r['plan_s']:>9.3f}{r['plan_cpu_s']:>8.3f}"
              f"{r['baselines_s']:>12.4f}{step:>10.3f}{base:>24}  {r['plan']}")  # fmt: skip


def add_parser(sub: Any) -> None:
    """Register ``planner`` on the ``bench`` subparsers."""
    p = sub.add_parser(
        "planner",
        help="the hybrid planner's time on ResNet-50's blocks at up to 1,024 ranks, beside its baselines'",
        description="Times pipe_planner.plan on ResNet-50's 22 top-level layers (a packaged cost table) "
        "per network and rank count, beside baselines() alone, and prints the plan and its predicted step.",
    )
    p.add_argument(
        "--ranks", type=positive_int, nargs="+", default=[8, 64, 1024], metavar="N", help="rank counts"
    )
    p.add_argument(
        "--networks",
        nargs="+",
        default=["ib-hdr", "eth10g"],
        metavar="NET",
        help="simulator network files, packaged names or paths, read as pipeline.network is",
    )
    p.add_argument(
        "--batch-per-rank", type=positive_int, default=32, help="the global batch is this times the ranks"
    )
    p.add_argument(
        "--speedup",
        type=positive_float,
        default=200.0,
        help="divide the table's times (one CPU core) by this: an accelerator's speed",
    )
    p.add_argument("--schedule", choices=("gpipe", "1f1b"), default="1f1b", help="the schedule planned for")
    p.add_argument(
        "--memory-mb", type=nonnegative_float, default=0.0, help="MiB of activations per rank (0: no limit)"
    )
    p.add_argument(
        "--costs", default=None, metavar="FILE", help=f"a cost table of ResNet-50 (default: {COSTS})"
    )
    p.add_argument("--repeat", type=positive_int, default=3, help="repetitions; the medians are reported")


def run(args: Any) -> list[dict[str, Any]]:
    """Run ``bench planner``; prints on rank 0 and returns the rows."""
    rows = bench_planner(
        args.networks,
        args.ranks,
        args.batch_per_rank,
        args.speedup,
        args.schedule,
        args.memory_mb,
        args.repeat,
        args.costs,
    )
    if world().Get_rank() == 0:
        print_rows(rows)
    return rows
