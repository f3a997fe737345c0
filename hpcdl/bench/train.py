"""``bench train``: data-parallel training throughput under mpiexec, beside PyTorch DDP.

With ``--set optimizer.name=kfac`` every K-FAC row (``hpcdl-kfac``) has an SGD twin (``hpcdl``:
the same config with ``optimizer.name = "sgd"``, the same momentum and weight decay) stepping
in the same interleaved repetitions, and the K-FAC row splits K-FAC's share of a step (its
:class:`~hpcdl.parallel.kfac.DistributedKfac`'s times, on the world's clock) per rank: factor
collection (in forward and backward), the factors' exchange, folding, eigendecomposition (on
the steps ``t mod kfac.inv_every = 0`` among those measured, so amortised over them), the
eigenbases' broadcast, preconditioning, the preconditioned gradients' broadcast, the update,
and the rest of the optimizer's slot (``other``: loops, buffers); the parts add up to the
share (:data:`KFAC_PARTS`), means over the measured steps, with the bytes K-FAC sent.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import numpy as np

from hpcdl import comm as ops
from hpcdl.bench.torchref import init_gloo, torch_twin
from hpcdl.comm import Communicator, use_world, watch, world, wtime
from hpcdl.config import add_set_argument, load_config
from hpcdl.driver.run import build
from hpcdl.errors import ConfigError
from hpcdl.nn import Sequential
from hpcdl.parallel import Strategy, strategy_class

__all__ = ["add_parser", "run", "bench_train", "KFAC_PARTS"]

#: K-FAC's share of a step, in parts that add up to it: factor collection in forward and
#: backward, then the optimizer's slot (``kfac.seconds["step"]``) cut into the rest
KFAC_PARTS = ("factors", "exchange", "fold", "decompose", "broadcast_eigen", "precondition",
              "broadcast_grads", "update", "other")  # fmt: skip
_COUNTERS = ("bytes_factors", "bytes_eigen", "bytes_grads", "steps", "inversions")
#: the bucketed exchange's time by kind (``BucketedExchange.times``): what a step spends beyond
#: the one-rank step, with the rest (compute slower beside other ranks, Python between layers)
BREAKDOWN = ("pack", "progress", "wait")
#: the row of the config's step on one rank, each rank alone at once (``--solo``)
SOLO = "hpcdl-1rank"


def _hpcdl_stepper(cfg: Any, comm: Communicator) -> tuple[Strategy, Callable[[], dict[str, float]], Any]:
    """One step of the config's strategy, the very step ``train`` runs (no run file, no meetings).

    Raises:
        ConfigError: the strategy's ranks run free between meetings (no step to time alone).
    """
    if strategy_class(cfg["parallel.strategy"]).runs_free:
        raise ConfigError(
            f"bench train times the steps of strategies whose ranks step together; "
            f"parallel.strategy = {cfg['parallel.strategy']!r} runs free: time it with python -m hpcdl.train "
            "(its run file's samples_per_s, ranks/pushes_per_s and ranks/busy_fraction)"
        )
    ctx, strategy = build(cfg, comm)
    done = [0]
    times = getattr(getattr(strategy, "exchange", None), "times", {})  # the bucketed exchange's kinds

    def step() -> dict[str, float]:
        before = dict(times)
        t0 = wtime()
        stats = strategy.step(done[0])
        wall = wtime() - t0
        done[0] += 1
        kinds = {f"{k}_s": times.get(k, 0.0) - before.get(k, 0.0) for k in BREAKDOWN}
        return {"compute_s": wall - stats.comm_s, "comm_s": stats.comm_s, "exposed_comm_s": stats.exposed_s,
                **kinds}  # fmt: skip

    member = ctx.placement.ranks[comm.Get_rank()].member
    batch = ctx.batch(ctx.sampler(max(member, 0)).indices(0, 0))  # the batch PyTorch's twin trains on
    return strategy, step, batch


def _torch_ddp_stepper(model: Sequential, batch: Any, comm: Communicator, cfg: Any) -> Callable[[], dict]:
    """The same network, weights and batch under PyTorch DDP (gloo), rendezvous address sent over MPI."""
    import torch

    torch.set_num_threads(1)
    init_gloo(comm)
    net = torch.nn.parallel.DistributedDataParallel(torch_twin(model, "--vs torch-ddp"))
    opt = torch.optim.SGD(net.parameters(), lr=cfg["optimizer.lr"], momentum=cfg["optimizer.momentum"])
    loss_fn = torch.nn.CrossEntropyLoss()
    x = torch.from_numpy(np.ascontiguousarray(batch[0], dtype=cfg["dtype"]))  # the twin's dtype
    y = torch.from_numpy(np.asarray(batch[1], dtype=np.int64))

    def step() -> dict[str, float]:
        t0 = wtime()
        opt.zero_grad(set_to_none=False)
        loss_fn(net(x), y).backward()  # DDP overlaps its allreduce with backward
        opt.step()
        return {"compute_s": float("nan"), "comm_s": float("nan"), "exposed_comm_s": float("nan"),
                "total": wtime() - t0}  # fmt: skip

    return step


def _measure(comm: Communicator, step: Callable[[], dict], steps: int) -> dict[str, float]:
    comm.Barrier()
    t0 = wtime()
    parts: list[dict[str, float]] = [step() for _ in range(steps)]
    own = wtime() - t0
    elapsed = comm.allreduce(own, op=ops.MAX) / steps
    mean = {k: float(np.mean([p.get(k, np.nan) for p in parts]))
            for k in ("compute_s", "comm_s", "exposed_comm_s", *(f"{b}_s" for b in BREAKDOWN))}  # fmt: skip
    return {"step_s": elapsed, "own_s": own, **mean}


def _kfac_update(strategy: Strategy) -> Any:
    """The strategy's distributed K-FAC (:class:`~hpcdl.parallel.kfac.DistributedKfac`), or None."""
    update = getattr(strategy, "update", None)
    return update if hasattr(update, "inversions") else None


def _kfac_snapshot(update: Any) -> dict[str, float]:
    return {**update.kfac.seconds, **{c: getattr(update, c) for c in _COUNTERS}}


def _kfac_split(comm: Communicator, update: Any, spent: dict[str, float], own_s: float) -> dict[str, Any]:
    """K-FAC's share per measured step on every rank (:data:`KFAC_PARTS`), from the differences
    ``spent`` of its counters over the measured steps, and this rank's own time in them."""
    steps = max(int(spent["steps"]), 1)
    slot = spent["step"]
    mine = {p: spent[p] / steps for p in KFAC_PARTS[:-1]}
    mine["other"] = (slot - sum(spent[p] for p in KFAC_PARTS[1:-1])) / steps
    mine = {f"{p}_s": v for p, v in mine.items()}
    mine["kfac_s"] = (spent["factors"] + slot) / steps
    mine["step_mean_s"] = own_s / steps  # this rank's mean step over the same steps (the share lies inside)
    by_rank = comm.allgather(mine)
    sent = {c: comm.allreduce(int(spent[c]), op=ops.SUM) / steps for c in _COUNTERS[:3]}
    return {
        **by_rank[0],
        "split_rank": 0,
        "kfac_by_rank": by_rank,
        "kfac_steps": int(spent["steps"]),
        "inversions": int(spent["inversions"]),
        "inv_every": update.kfac.inv_every,
        "grad_workers": update.k,
        **{f"{c}_per_step": v for c, v in sent.items()},  # summed over the ranks
    }


def bench_train(
    config: str,
    sets: list[str],
    vs: str | None,
    repeat: int,
    steps: int,
    compressions: list[str] | None = None,
    watchdog: str = "config",
    solo: bool = True,
    extra: dict[str, list[str]] | None = None,
) -> list[dict[str, Any]]:
    """Global samples/s of hpcdl (and PyTorch DDP) on the same network and batch, interleaved.

    Args:
        config: a preset or TOML file.
        sets: ``KEY=VALUE`` overrides.
        vs: ``"torch-ddp"`` to train the same network with PyTorch DDP in the same job.
        repeat: interleaved repetitions (the median is reported).
        steps: steps per repetition.
        compressions: one hpcdl run per ``exchange.compression`` value, interleaved
            (default: the config's).
        watchdog: ``config``: hpcdl's steps run under the stall watchdog as ``train`` runs
            them (``debug.stall_s``; 0: off); ``off``: without it; ``both``: each hpcdl
            row also without it, named ``...-nowatch``, interleaved (the watchdog's cost).
        solo: on 2 ranks or more, also the config's step on one rank (:data:`SOLO`: every
            rank alone, at the same time, on its own one-rank communicator), interleaved: the
            step perfect scaling would keep. The ``hpcdl`` row then says how far from it it is
            (``scaling``) and where the difference goes (``gap_*_s``: :data:`BREAKDOWN`, and
            ``other``: compute slowed beside the other ranks, Python between layers).
        extra: row name -> more ``KEY=VALUE`` settings: one more hpcdl row each
            (``hpcdl-NAME``), in the same interleaved repetitions (before and after a change).

    Returns:
        One row per implementation, as the module describes.
    """
    cfg = load_config(config, sets)
    with watch(cfg["debug.stall_s"] if watchdog != "off" else 0.0) as comm:
        return _bench_train(comm, config, cfg, sets, vs, repeat, steps, compressions, watchdog, solo, extra)


def _bench_train(
    comm: Communicator,
    config: str,
    cfg: Any,
    sets: list[str],
    vs: str | None,
    repeat: int,
    steps: int,
    compressions: list[str] | None,
    watchdog: str,
    solo: bool = True,
    extra: dict[str, list[str]] | None = None,
) -> list[dict[str, Any]]:
    """:func:`bench_train` inside the world ``comm`` (watched or not)."""
    impls: dict[str, Callable[[], dict]] = {}
    strategies: dict[str, Strategy] = {}  # hpcdl's, freed at the end
    variants: dict[str, Any] = {}
    worlds: dict[str, Communicator | None] = {}  # the world each implementation runs in
    model = batch = None
    kfac = cfg["optimizer.name"] == "kfac"
    for comp in dict.fromkeys(compressions or [cfg["exchange.compression"]]):
        base = "hpcdl" if comp == "none" else f"hpcdl-{comp}"
        wire = f'exchange.compression="{comp}"'
        # K-FAC beside its SGD twin (the same momentum and weight decay), interleaved
        twins = (
            {f"{base}-kfac": [*sets, wire], base: [*sets, wire, 'optimizer.name="sgd"']}
            if kfac
            else {base: [*sets, wire]}
        )
        for name, twin_sets in twins.items():
            variant = load_config(config, twin_sets)
            strategies[name], impls[name], b = _hpcdl_stepper(variant, comm)
            variants[name], worlds[name] = variant, comm
            if watchdog == "both":  # the same steps in MPI's own world, without the watchdog
                unwatched = f"{name}-nowatch"
                with use_world(None) as raw:
                    strategies[unwatched], impls[unwatched], _ = _hpcdl_stepper(variant, raw)
                variants[unwatched], worlds[unwatched] = variant, None
            if model is None:
                model, batch = strategies[name].model, b
    for label, more in (extra or {}).items():  # the same step with more settings: before/after
        name = f"hpcdl-{label}"
        if name in impls or name == SOLO or name.endswith("-nowatch"):
            raise ConfigError(
                f"--variant {label}: row {name} is one of bench train's own: choose another name"
            )
        variants[name] = load_config(config, [*sets, *more])
        strategies[name], impls[name], _ = _hpcdl_stepper(variants[name], comm)
        worlds[name] = comm
    one_rank = solo and comm.Get_size() > 1 and not kfac and _fits_one_rank(cfg, comm)
    alone = comm.Split(comm.Get_rank(), 0) if one_rank else None
    if alone is not None:  # the same step on one rank: each rank alone, all at once
        strategies[SOLO], impls[SOLO], _ = _hpcdl_stepper(cfg, alone)
        variants[SOLO], worlds[SOLO] = cfg, alone
    if vs == "torch-ddp":
        try:
            import torch  # noqa: F401
        except ImportError:
            raise ConfigError("--vs torch-ddp needs PyTorch: pip install torch==2.13.0") from None
        impls["torch-ddp"] = _torch_ddp_stepper(model, batch, comm, cfg)
        variants["torch-ddp"], worlds["torch-ddp"] = cfg, comm
    for name, step in impls.items():
        with use_world(worlds[name]) as here:
            _measure(here, step, 3)  # warm-up
    results: dict[str, list[dict[str, float]]] = {k: [] for k in impls}
    updates = {k: u for k, s in strategies.items() if (u := _kfac_update(s)) is not None}
    spent: dict[str, dict[str, float]] = {k: {} for k in updates}  # K-FAC's counters over the measured steps
    for _ in range(repeat):
        for name, step in impls.items():
            before = _kfac_snapshot(updates[name]) if name in updates else None
            comm.Barrier()  # the one-rank rows too: the ranks measure together
            with use_world(worlds[name]) as here:
                results[name].append(_measure(here, step, steps))
            if name == SOLO:  # the slowest rank alone, as the N-rank rows take the slowest rank
                results[name][-1]["step_s"] = comm.allreduce(results[name][-1]["step_s"], op=ops.MAX)
            if before is not None:
                for key, value in _kfac_snapshot(updates[name]).items():
                    spent[name][key] = spent[name].get(key, 0.0) + value - before[key]
    splits = {}
    for name, update in updates.items():
        with use_world(worlds[name]) as here:
            splits[name] = _kfac_split(here, update, spent[name], sum(r["own_s"] for r in results[name]))
    for name, strategy in strategies.items():  # free what they hold, in the world each ran in
        with use_world(worlds[name]):
            strategy.close()
    if alone is not None:
        alone.Free()
    size, batch_size = comm.Get_size(), cfg["data.batch_size"]
    rows = []
    for name, reps in results.items():
        step_s = statistics.median(r["step_s"] for r in reps)
        micro = variants[name]["exchange.accumulate"] if name != "torch-ddp" else 1
        # samples per step: the strategy's global batch (its data-parallel width, not the world)
        per_step = strategies[name].ctx.placement.global_batch if name in strategies else size * batch_size
        rows.append(
            {
                "impl": name,
                "config": cfg["name"],
                "model": cfg["model.name"],
                "ranks": size,
                "batch_per_rank": variants[name]["data.batch_size"],
                "micro_steps": micro,
                "samples_per_s": per_step / step_s,
                "step_s": step_s,
                "compute_s": statistics.median(r["compute_s"] for r in reps),
                "comm_s": statistics.median(r["comm_s"] for r in reps),
                "exposed_comm_s": statistics.median(r["exposed_comm_s"] for r in reps),
                **{f"{b}_s": statistics.median(r[f"{b}_s"] for r in reps) for b in BREAKDOWN},
                "compression": variants[name]["exchange.compression"] if name != "torch-ddp" else "none",
                "exchange": variants[name]["exchange.name"] if name != "torch-ddp" else "ddp",
                "stall_s": cfg["debug.stall_s"] if worlds[name] is not None and watchdog != "off" else 0.0,
                "repeat": repeat,
                **splits.get(name, {}),
            }
        )
        if name in strategies:
            placement = strategies[name].ctx.placement
            rows[-1]["width"] = placement.width
            rows[-1]["data_parallel"] = placement.width == placement.world  # every rank a whole replica
    one = next((r for r in rows if r["impl"] == SOLO), None)
    if one is not None:  # hpcdl against N x its one-rank step, and where the difference goes
        one["ranks"] = 1
        for r in rows:
            if r["impl"] != SOLO and r.get("data_parallel"):  # (a pipeline's stages are not N replicas)
                _scaling(r, one, results[r["impl"]], results[SOLO])
    for r in rows:  # K-FAC's step against its SGD twin's
        twin = next((t for t in rows if t["impl"] == r["impl"].replace("-kfac", "", 1)), None)
        if "kfac_s" in r and twin is not None and twin is not r:
            r["sgd_step_s"], r["vs_sgd"] = twin["step_s"], r["step_s"] / twin["step_s"]
    return rows


def _fits_one_rank(cfg: Any, comm: Communicator) -> bool:
    """Whether the config's strategy places on one rank (a pipeline of several stages does not:
    no one-rank row then, said on rank 0)."""
    try:
        strategy_class(cfg["parallel.strategy"]).plan(cfg, 1)
    except ConfigError as err:
        if comm.Get_rank() == 0:
            print(f"bench train: no {SOLO} row (the config does not run on one rank: {err})")
        return False
    return True


def _scaling(r: dict[str, Any], one: dict[str, Any], reps: list[dict], solo: list[dict]) -> None:
    """``r``'s samples/s as a fraction of its width times ``one``'s (perfect scaling), and the
    extra time per step by kind: the exchange's (:data:`BREAKDOWN`), the rest as ``other``; each
    a median over the repetitions of that repetition's difference from the one-rank step
    (``reps`` and ``solo`` interleaved, pairwise)."""
    r["one_rank_samples_per_s"] = one["samples_per_s"]
    r["scaling"] = r["samples_per_s"] / (r["width"] * one["samples_per_s"])
    gaps = [a["step_s"] - b["step_s"] for a, b in zip(reps, solo)]
    r["gap_s"] = statistics.median(gaps)
    for k in BREAKDOWN:
        r[f"gap_{k}_s"] = statistics.median(a[f"{k}_s"] - b[f"{k}_s"] for a, b in zip(reps, solo))
    r["gap_other_s"] = statistics.median(
        g - sum(a[f"{k}_s"] - b[f"{k}_s"] for k in BREAKDOWN) for g, a, b in zip(gaps, reps, solo)
    )


def print_rows(rows: list[dict[str, Any]]) -> None:
    ref = next((r for r in rows if r["impl"] == "torch-ddp"), None)
    r0 = rows[0]
    print(f"bench train: {r0['config']} (model {r0['model']}), {r0['ranks']} rank{'s' * (r0['ranks'] != 1)} "
          f"x batch {r0['batch_per_rank']}, median of {r0['repeat']} interleaved repetitions")  # fmt: skip
    head = ("impl", "samples/s", "step ms", "compute ms", "comm ms", "exposed", "vs ddp")
    widths = (16, 11, 9, 12, 9, 9, 8)
    print(head[0].ljust(widths[0]) + "".join(h.rjust(w) for h, w in zip(head[1:], widths[1:])))
    for r in rows:
        ratio = f"{r['samples_per_s'] / ref['samples_per_s']:.3f}" if ref else "-"
        ms = {
            k: (f"{1e3 * r[k]:.2f}" if np.isfinite(r[k]) else "-")
            for k in ("compute_s", "comm_s", "exposed_comm_s")
        }
        print(f"{r['impl']:<16}{r['samples_per_s']:>11.0f}{1e3 * r['step_s']:>9.2f}{ms['compute_s']:>12}"
              f"{ms['comm_s']:>9}{ms['exposed_comm_s']:>9}{ratio:>8}")  # fmt: skip
    for r in rows:
        if "scaling" in r:
            parts = ", ".join(f"{b} {1e3 * r[f'gap_{b}_s']:.2f}" for b in (*BREAKDOWN, "other"))
            print(f"{r['impl']}: {100 * r['scaling']:.1f}% of perfect scaling ({r['samples_per_s']:.0f} "
                  f"against {r['width']} x {r['one_rank_samples_per_s']:.0f} samples/s, {SOLO}: every rank "
                  f"alone at once); {1e3 * r['gap_s']:.2f} ms more per step: {parts}")  # fmt: skip
    for r in rows:
        if "kfac_s" in r:
            print_split(r)


def print_split(r: dict[str, Any]) -> None:
    """K-FAC's share of a step, rank by rank, and what it sent."""
    print(
        f"{r['impl']}: K-FAC's share per step (ms, means over {r['kfac_steps']} steps, {r['inversions']} of "
        f"them decomposing: inv_every {r['inv_every']}; grad_workers {r['grad_workers']})"
    )
    heads = ("factors", "exchange", "fold", "eigh", "bc eigen", "precond", "bc grads", "update", "other")
    print("rank" + "".join(f"{h:>10}" for h in heads) + f"{'K-FAC':>9}{'step':>9}")
    for rank, split in enumerate(r["kfac_by_rank"]):
        cells = "".join(f"{1e3 * split[p + '_s']:>10.2f}" for p in KFAC_PARTS)
        print(f"{rank:<4}{cells}{1e3 * split['kfac_s']:>9.2f}{1e3 * split['step_mean_s']:>9.2f}")
    sgd = f"; SGD's step {1e3 * r['sgd_step_s']:.2f} ms ({r['vs_sgd']:.2f}x)" if "vs_sgd" in r else ""
    kib = ", ".join(f"{c.removeprefix('bytes_')} {r[c + '_per_step'] / 1024:.1f}" for c in _COUNTERS[:3])
    print(f"K-FAC's step {1e3 * r['step_s']:.2f} ms (median){sgd}; KiB sent per step, all ranks: {kib}")


def add_parser(sub: Any) -> None:
    """Register ``train`` on the ``bench`` subparsers."""
    p = sub.add_parser(
        "train",
        help="data-parallel training samples/s, optionally beside PyTorch DDP",
        description="Data-parallel training samples/s, compute and communication per step (under mpiexec), "
        "optionally beside PyTorch DDP.",
    )
    p.add_argument("--config", default="mlp32-synthetic", help="a preset name or a TOML file")
    add_set_argument(p)
    p.add_argument(
        "--vs",
        choices=("torch-ddp",),
        default=None,
        help="also train the same network with PyTorch DDP over gloo (needs torch; default: hpcdl only)",
    )
    p.add_argument(
        "--watchdog",
        choices=("config", "off", "both"),
        default="config",
        help="run hpcdl's steps under the stall watchdog as train does (config: debug.stall_s), without "
        "it (off), or both, interleaved, to measure its cost (rows ...-nowatch)",
    )
    p.add_argument(
        "--variant",
        nargs="+",
        action="append",
        default=[],
        metavar=("NAME", "KEY=VALUE"),
        help="one more hpcdl row, hpcdl-NAME, with these settings on top of --set, in the same interleaved "
        "repetitions (before and after a change; repeatable; default: none)",
    )
    p.add_argument(
        "--solo",
        choices=("yes", "no"),
        default="yes",
        help=f"also time the step on one rank ({SOLO}: every rank alone, at once), for the fraction of "
        "perfect scaling and where the rest goes (default: yes; not with K-FAC)",
    )
    p.add_argument("--repeat", type=int, default=5, help="interleaved repetitions; the median is reported")
    p.add_argument("--steps", type=int, default=10, help="steps per repetition")
    p.add_argument(
        "--compression",
        nargs="+",
        choices=("none", "float16", "bfloat16", "int32"),
        default=None,
        metavar="FORMAT",
        help="one hpcdl row per gradient wire format, interleaved: none, float16, bfloat16, int32 "
        "(default: the config's exchange.compression)",
    )


def run(args: Any) -> list[dict[str, Any]]:
    """Run ``bench train``; prints on rank 0 and returns the rows."""
    if args.repeat < 1 or args.steps < 1:
        raise ConfigError("--repeat and --steps must be positive integers")
    variants: dict[str, list[str]] = {}
    for name, *more in args.variant:
        if "=" in name or not more or name in variants:
            raise ConfigError(
                f"--variant {name} {' '.join(more)}: give a new row name, then its KEY=VALUE settings "
                "(--variant packed exchange.in_place=false)"
            )
        variants[name] = more
    rows = bench_train(
        args.config,
        args.sets,
        args.vs,
        args.repeat,
        args.steps,
        args.compression,
        args.watchdog,
        args.solo == "yes",
        variants,
    )
    if world().Get_rank() == 0:
        print_rows(rows)
    return rows
