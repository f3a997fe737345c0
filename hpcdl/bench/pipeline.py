"""``bench pipeline``: the pipeline strategy's samples/s beside one process on the same batches.

Under ``mpiexec -n P`` (P stages), for each schedule, three contenders alternate in every
repetition, each timed as ``bench train`` times a step (a barrier, then ``steps`` steps;
the slowest rank's time):

* ``hpcdl-pipeline``: the config with ``parallel.strategy = "pipeline"``, m microbatches
  of ``data.batch_size``, the very step ``train`` runs;
* ``one-process``: the same config with ``parallel.strategy = "sync"`` and
  ``exchange.accumulate = m`` on rank 0 alone (a communicator of one rank; the others
  wait), which trains the same batches from the same initial weights;
* ``torch-pipelining`` (``--vs torch``): ``torch.distributed.pipelining`` over gloo, each
  rank a ``PipelineStage`` holding the PyTorch twin of hpcdl's stage (the same layers,
  cut where hpcdl's partition cuts, the same initial weights), ``ScheduleGPipe`` or
  ``Schedule1F1B`` with m microbatches of the first step's batch, SGD with the config's
  learning rate and momentum, one thread.

A step is ``m x data.batch_size`` samples for each; samples/s is that over the median
step time. Run with ``OPENBLAS_NUM_THREADS=1``: one BLAS thread per process.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hpcdl.bench.torchref import init_gloo, torch_twin
from hpcdl.bench.train import _hpcdl_stepper, _measure
from hpcdl.comm import Communicator, long_wait, subcomm, watch, world
from hpcdl.config import add_set_argument, load_config
from hpcdl.errors import ConfigError
from hpcdl.parallel import Strategy

__all__ = ["add_parser", "run", "bench_pipeline", "SCHEDULES"]

#: the schedules ``--schedule both`` runs, in order
SCHEDULES = ("gpipe", "1f1b")
#: the rows' ``impl``
PIPELINE, ONE, TORCH = "hpcdl-pipeline", "one-process", "torch-pipelining"
#: what ``--vs torch`` needs
_TORCH_MISSING = (
    "bench pipeline: --vs torch skipped: PyTorch (with torch.distributed.pipelining) is not installed: "
    "pip install torch==2.13.0"
)


@dataclass
class _Contender:
    """One implementation at one schedule: its step (None on ranks that do not take part),
    the communicator it is timed on, and its measurements."""

    impl: str
    schedule: str
    step: Callable[[], dict[str, float]] | None
    comm: Communicator | None
    strategy: Strategy | None = None
    alone: bool = False  # rank 0 alone; the other ranks wait
    steps_done: int = 0
    reps: list[dict[str, float]] = field(default_factory=list)


def _pipeline_config(config: str, sets: list[str], m: int, schedule: str) -> Any:
    forced = ['parallel.strategy="pipeline"', f"pipeline.microbatches={m}", f'pipeline.schedule="{schedule}"']
    return load_config(config, [*sets, *forced])


def _one_process_config(config: str, sets: list[str], m: int) -> Any:
    return load_config(config, [*sets, 'parallel.strategy="sync"', f"exchange.accumulate={m}"])


def _torch_pipe_stepper(
    pipe: Any, batch: Any, comm: Communicator, cfg: Any, schedule: str
) -> Callable[[], dict[str, float]]:
    """This rank's stage of the same network under ``torch.distributed.pipelining`` (gloo).

    Args:
        pipe: hpcdl's :class:`~hpcdl.parallel.pipeline.Pipeline` on this rank, not stepped
            yet (its stage's layers, initial weights and boundary shapes are copied).
        batch: the step's ``(x, y)`` (m microbatches), trained on every step.
        comm: the world (the rendezvous port travels over it).
        cfg: the pipeline's config.
        schedule: ``gpipe`` or ``1f1b``.
    """
    import torch
    from torch.distributed import pipelining

    torch.set_num_threads(1)
    init_gloo(comm)
    dtype = getattr(torch, cfg["dtype"])
    try:
        net, error = torch_twin(pipe.model, "--vs torch").to(dtype), None
    except ConfigError as err:  # a layer on some stages only: every rank raises it
        net, error = None, str(err)
    error = next((e for e in comm.allgather(error) if e is not None), None)
    if error is not None:
        raise ConfigError(error)
    # static shapes: a received activation and every output carry a gradient back
    stage = pipelining.PipelineStage(
        net,
        pipe.s,
        pipe.p,
        torch.device("cpu"),
        input_args=torch.empty(pipe.chunks[0].in_shape, dtype=dtype, requires_grad=not pipe.first),
        output_args=torch.empty(pipe.chunks[0].out_shape, dtype=dtype, requires_grad=True),
    )
    kind = {"gpipe": pipelining.ScheduleGPipe, "1f1b": pipelining.Schedule1F1B}[schedule]
    # the mean loss of each microbatch, gradients averaged over the m (scale_grads): hpcdl's rule
    plan = kind(stage, n_microbatches=pipe.m, loss_fn=torch.nn.CrossEntropyLoss(), scale_grads=True)
    params = list(net.parameters())
    opt = None  # a stage of ReLUs has nothing to update
    if params:
        opt = torch.optim.SGD(params, lr=cfg["optimizer.lr"], momentum=cfg["optimizer.momentum"])
    args = (torch.from_numpy(np.ascontiguousarray(batch[0], dtype=cfg["dtype"])),) if pipe.first else ()
    kwargs: dict[str, Any] = {"return_outputs": False}
    if pipe.last:
        kwargs["target"] = torch.from_numpy(np.asarray(batch[1], dtype=np.int64))
    nan = float("nan")

    def step() -> dict[str, float]:
        if opt is not None:
            opt.zero_grad(set_to_none=False)
        plan.step(*args, **kwargs)
        if opt is not None:
            opt.step()
        return {"compute_s": nan, "comm_s": nan, "exposed_comm_s": nan}

    return step


def _torch_available() -> bool:
    try:
        import torch.distributed.pipelining  # noqa: F401
    except ImportError:
        return False
    return True


def bench_pipeline(
    config: str,
    sets: list[str],
    microbatches: int,
    schedules: tuple[str, ...],
    vs: str | None,
    repeat: int,
    steps: int,
    warmup: int,
) -> list[dict[str, Any]]:
    """Samples/s of the pipeline, of one process on the same batches (and of torch
    pipelining), alternating within each repetition.

    Args:
        config: a preset or TOML file (``parallel.strategy`` is set for each contender).
        sets: ``KEY=VALUE`` overrides.
        microbatches: m, ``pipeline.microbatches`` and the one process's ``exchange.accumulate``.
        schedules: the pipeline schedules to run (``gpipe``, ``1f1b``).
        vs: ``"torch"`` to run ``torch.distributed.pipelining`` too, when installed.
        repeat: alternating repetitions (the median is reported).
        steps: timed steps per repetition.
        warmup: untimed steps of each contender before the first repetition.

    Returns:
        One row per schedule and implementation, the same on every rank.

    Raises:
        ConfigError: one rank (the stages are the ranks), or a config the pipeline cannot run.
    """
    size = world().Get_size()
    if size < 2:
        raise ConfigError(
            "bench pipeline runs one stage per rank: run it under mpiexec -n P with P >= 2 stages, "
            "e.g. mpiexec -n 2 python -m hpcdl.bench pipeline"
        )
    cfgs = {s: _pipeline_config(config, sets, microbatches, s) for s in schedules}
    one_cfg = _one_process_config(config, sets, microbatches)
    first = cfgs[schedules[0]]
    with watch(first["debug.stall_s"]) as comm:
        return _bench(comm, cfgs, one_cfg, vs, repeat, steps, warmup)


def _bench(
    comm: Communicator,
    cfgs: dict[str, Any],
    one_cfg: Any,
    vs: str | None,
    repeat: int,
    steps: int,
    warmup: int,
) -> list[dict[str, Any]]:
    """:func:`bench_pipeline` in the world ``comm``."""
    rank = comm.Get_rank()
    with_torch = vs == "torch" and _torch_available()
    if vs == "torch" and not with_torch and rank == 0:
        print(_TORCH_MISSING)
    alone = subcomm(comm, [0]) if rank == 0 else None  # the one process's world
    contenders: list[_Contender] = []
    for schedule, cfg in cfgs.items():  # built before any step: torch copies the initial weights
        pipe, step, batch = _hpcdl_stepper(cfg, comm)
        contenders.append(_Contender(PIPELINE, schedule, step, comm, pipe))
        one, one_step = _hpcdl_stepper(one_cfg, alone)[:2] if alone is not None else (None, None)
        contenders.append(_Contender(ONE, schedule, one_step, alone, one, alone=True))
        if with_torch and pipe.m < pipe.p:
            if rank == 0:  # torch's schedules refuse it (ValueError on every rank)
                print(f"bench pipeline: torch pipelining skipped at {schedule}: it needs at least as many "
                      f"microbatches as stages ({pipe.m} < {pipe.p})")  # fmt: skip
        elif with_torch:
            torch_step = _torch_pipe_stepper(pipe, batch, comm, cfg, schedule)
            contenders.append(_Contender(TORCH, schedule, torch_step, comm))
    if warmup:
        for c in contenders:
            _time(c, comm, warmup)
    for _ in range(repeat):
        for c in contenders:
            c.reps.append(_time(c, comm, steps))
    rows = _rows(contenders, cfgs, comm, repeat, steps, warmup) if rank == 0 else None
    for c in contenders:  # free what they hold, on the communicator each was built on
        if c.strategy is not None:
            c.strategy.close()
    if alone is not None:
        alone.Free()
    return comm.bcast(rows, root=0)


def _time(c: _Contender, comm: Communicator, steps: int) -> dict[str, float]:
    """``steps`` steps of ``c`` timed; rank 0's figures on every rank when it runs alone."""
    if not c.alone:
        result = _measure(comm, c.step, steps)
    else:
        with long_wait("rank 0 times one process alone"):
            result = _measure(c.comm, c.step, steps) if c.step is not None else None
            result = comm.bcast(result, root=0)
    c.steps_done += steps
    return result


def _rows(
    contenders: list[_Contender],
    cfgs: dict[str, Any],
    comm: Communicator,
    repeat: int,
    steps: int,
    warmup: int,
) -> list[dict[str, Any]]:
    """The rows, on rank 0 (which holds stage 0 and the one process: both samplers)."""
    rows = []
    for c in contenders:
        cfg = cfgs[c.schedule]
        m, batch = cfg["pipeline.microbatches"], cfg["data.batch_size"]
        times = [r["step_s"] for r in c.reps]
        step_s = statistics.median(times)
        pipe = next(x.strategy for x in contenders if x.schedule == c.schedule and x.impl == PIPELINE)
        sampler = c.strategy.sampler.state() if c.strategy is not None else None
        rows.append(
            {
                "impl": c.impl,
                "schedule": c.schedule,
                "config": cfg["name"],
                "model": cfg["model.name"],
                "stages": comm.Get_size(),
                "balance": list(pipe.partition.balance),
                "microbatches": m,
                "batch_per_microbatch": batch,
                "samples_per_step": m * batch,
                "samples_per_s": m * batch / step_s,
                "step_s": step_s,
                "step_s_min": min(times),
                "step_s_max": max(times),
                # rank 0's (stage 0's) split of its step: time waiting on receives and sends is comm_s
                "compute_s": statistics.median(r["compute_s"] for r in c.reps),
                "comm_s": statistics.median(r["comm_s"] for r in c.reps),
                "steps": c.steps_done,  # warm-up and timed
                "samples": c.steps_done * m * batch,
                # where the hpcdl contenders' sampler stands (torch trains the first step's batch)
                "sampler": {"epoch": sampler["epoch"], "step": sampler["step"]} if sampler else None,
                "repeat": repeat,
                "timed_steps": steps,
                "warmup": warmup,
            }
        )
    for r in rows:
        ref = {x["impl"]: x["samples_per_s"] for x in rows if x["schedule"] == r["schedule"]}
        r["vs_one_process"] = r["samples_per_s"] / ref[ONE]
        r["vs_torch"] = r["samples_per_s"] / ref[TORCH] if TORCH in ref else None
    return rows


def print_rows(rows: list[dict[str, Any]]) -> None:
    """The table: one line per schedule, each contender's samples/s and the pipeline's ratios."""
    r0 = rows[0]
    blas = os.environ.get("OPENBLAS_NUM_THREADS", "unset")
    print(
        f"bench pipeline: {r0['config']} ({r0['model']}), {r0['stages']} stages (balance {r0['balance']}) x "
        f"{r0['microbatches']} microbatches of {r0['batch_per_microbatch']} ({r0['samples_per_step']:,} "
        f"samples per step); median of {r0['repeat']} alternating repetitions of {r0['timed_steps']} steps "
        f"(OPENBLAS_NUM_THREADS={blas})"
    )
    head = ("schedule", "pipeline/s", "one proc/s", "torch/s", "vs one proc", "vs torch")
    widths = (10, 12, 12, 12, 13, 10)
    print(head[0].ljust(widths[0]) + "".join(h.rjust(w) for h, w in zip(head[1:], widths[1:])))
    for schedule in dict.fromkeys(r["schedule"] for r in rows):
        by = {r["impl"]: r for r in rows if r["schedule"] == schedule}
        pipe, torch = by[PIPELINE], by.get(TORCH)
        torch_rate = f"{torch['samples_per_s']:.0f}" if torch else "-"
        vs_torch = f"{pipe['vs_torch']:.3f}" if torch else "-"
        print(f"{schedule:<10}{pipe['samples_per_s']:>12.0f}{by[ONE]['samples_per_s']:>12.0f}{torch_rate:>12}"
              f"{pipe['vs_one_process']:>13.3f}{vs_torch:>10}")  # fmt: skip


def add_parser(sub: Any) -> None:
    """Register ``pipeline`` on the ``bench`` subparsers."""
    p = sub.add_parser(
        "pipeline",
        help="pipeline samples/s beside one process on the same batches, optionally beside torch pipelining",
        description="Samples/s of the pipeline strategy (under mpiexec -n P: P stages) beside one process "
        "accumulating the same m microbatches on rank 0 alone, optionally beside "
        "torch.distributed.pipelining on the same network, weights and batch; repetitions alternate.",
    )
    p.add_argument("--config", default="mlp32-synthetic", help="a preset name or a TOML file")
    add_set_argument(p)
    p.add_argument(
        "--microbatches",
        type=int,
        default=8,
        metavar="M",
        help="microbatches of data.batch_size per step: pipeline.microbatches, and the one process's "
        "exchange.accumulate (overrides --set)",
    )
    p.add_argument(
        "--schedule",
        choices=(*SCHEDULES, "both"),
        default="both",
        help="the pipeline schedule(s) to time, one table line each",
    )
    p.add_argument(
        "--vs",
        choices=("torch",),
        default=None,
        help="also run torch.distributed.pipelining over gloo (skipped with one line when PyTorch is "
        "missing; default: hpcdl only)",
    )
    p.add_argument("--reps", type=int, default=5, help="alternating repetitions; the median is reported")
    p.add_argument("--steps", type=int, default=5, help="timed steps per repetition and contender")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps of each contender first")


def run(args: Any) -> list[dict[str, Any]]:
    """Run ``bench pipeline``; prints on rank 0 and returns the rows."""
    if args.reps < 1 or args.steps < 1 or args.microbatches < 1 or args.warmup < 0:
        raise ConfigError("--reps, --steps and --microbatches must be positive integers, --warmup >= 0")
    schedules = SCHEDULES if args.schedule == "both" else (args.schedule,)
    rows = bench_pipeline(
        args.config, args.sets, args.microbatches, schedules, args.vs, args.reps, args.steps, args.warmup
    )
    if world().Get_rank() == 0:
        print_rows(rows)
    return rows
