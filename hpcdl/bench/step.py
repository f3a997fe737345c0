"""``bench step``: forward + backward + update samples/s of one process, beside PyTorch."""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from typing import Any

import numpy as np

from hpcdl.bench.torchref import torch_twin
from hpcdl.comm import world, wtime
from hpcdl.driver.cli import positive_int
from hpcdl.errors import ConfigError
from hpcdl.models import MODELS, build_model
from hpcdl.nn import SoftmaxCrossEntropy
from hpcdl.optim import SGD
from hpcdl.rng import generator

__all__ = ["add_parser", "bench_step", "run"]

LR, MOMENTUM = 0.01, 0.9


def _hpcdl_stepper(model_name: str, batch: int, shape: tuple[int, ...], classes: int, seed: int):
    model = build_model(model_name, shape, classes, rng=generator(seed, "init"))
    opt = SGD(model.parameters(), LR, momentum=MOMENTUM)
    loss_fn = SoftmaxCrossEntropy()
    rng = generator(seed, "bench-data")
    x = rng.standard_normal((batch, *shape), dtype=np.float32)
    y = rng.integers(0, classes, batch)

    def step() -> None:
        loss_fn.forward(model.forward(x), y)
        model.backward(loss_fn.backward())
        opt.step()

    return model, step


def _torch_stepper(model: Any, batch: int, shape: tuple[int, ...], classes: int, seed: int, threads: int):
    """The same network in PyTorch, initialised with hpcdl's weights (Linear layers only)."""
    import torch

    torch.set_num_threads(threads)
    net = torch_twin(model, "--vs torch")
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)
    loss_fn = torch.nn.CrossEntropyLoss()
    rng = generator(seed, "bench-data")
    x = torch.from_numpy(rng.standard_normal((batch, *shape), dtype=np.float32))
    y = torch.from_numpy(rng.integers(0, classes, batch))

    def step() -> None:
        opt.zero_grad(set_to_none=False)
        loss_fn(net(x), y).backward()
        opt.step()

    return step


def _time(step: Callable[[], None], steps: int) -> float:
    t0 = wtime()
    for _ in range(steps):
        step()
    return (wtime() - t0) / steps


def bench_step(
    model: str = "mlp32",
    batch: int = 128,
    vs: str | None = None,
    repeat: int = 5,
    steps: int = 20,
    warmup: int = 5,
    threads: int = 1,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Forward + backward + SGD update samples/s of one process, optionally beside PyTorch.

    Repetitions alternate between the implementations (hpcdl, torch, hpcdl, …)
    so that drifts of the machine hit both alike; each figure is the median.
    """
    shape: tuple[int, ...] = (1, 28, 28) if model.startswith("mlp") else (3, 32, 32)
    classes = 10
    net, hp_step = _hpcdl_stepper(model, batch, shape, classes, seed)
    impls: dict[str, Callable[[], None]] = {"hpcdl": hp_step}
    if vs == "torch":
        try:
            import torch  # noqa: F401
        except ImportError:
            raise ConfigError(
                "--vs torch needs PyTorch, which hpcdl does not depend on: pip install torch==2.13.0"
            ) from None
        impls["torch"] = _torch_stepper(net, batch, shape, classes, seed, threads)
    times: dict[str, list[float]] = {name: [] for name in impls}
    for step in impls.values():
        _time(step, warmup)
    for _ in range(repeat):
        for name, step in impls.items():
            times[name].append(_time(step, steps))
    rows = []
    for name, ts in times.items():
        step_s = statistics.median(ts)
        rows.append(
            {
                "impl": name,
                "model": model,
                "batch": batch,
                "samples_per_s": batch / step_s,
                "step_s": step_s,
                "step_s_min": min(ts),
                "step_s_max": max(ts),
                "repeat": repeat,
                "threads": threads,
            }
        )
    return rows


def print_rows(rows: list[dict[str, Any]]) -> None:
    ref = next((r for r in rows if r["impl"] == "torch"), None)
    blas = os.environ.get("OPENBLAS_NUM_THREADS", "unset")
    print(
        f"bench step: {rows[0]['model']}, batch {rows[0]['batch']}, median of {rows[0]['repeat']} "
        f"interleaved repetitions (OPENBLAS_NUM_THREADS={blas}, torch threads={rows[0]['threads']})"
    )
    print(f"{'impl':<8}{'samples/s':>12}{'step ms':>10}{'min..max ms':>16}{'vs torch':>10}")
    for r in rows:
        ratio = f"{r['samples_per_s'] / ref['samples_per_s']:.3f}" if ref else "-"
        span = f"{1e3 * r['step_s_min']:.1f}..{1e3 * r['step_s_max']:.1f}"
        print(f"{r['impl']:<8}{r['samples_per_s']:>12.0f}{1e3 * r['step_s']:>10.2f}{span:>16}{ratio:>10}")


def add_parser(sub: Any) -> None:
    """Register ``step`` and its options on the ``bench`` subparsers."""
    p = sub.add_parser(
        "step",
        help="forward + backward + update samples/s of one process",
        description="Forward + backward + SGD update samples/s of one process, optionally beside PyTorch.",
    )
    p.add_argument("--model", default="mlp32", choices=MODELS, help="the network to time")
    p.add_argument("--batch", type=int, default=128, help="samples per step")
    p.add_argument(
        "--vs",
        choices=("torch",),
        default=None,
        help="also time the same network, with the same initial weights, in PyTorch (needs torch; "
        "default: hpcdl only)",
    )
    p.add_argument("--repeat", type=int, default=5, help="interleaved repetitions; the median is reported")
    p.add_argument("--steps", type=int, default=20, help="steps per repetition")
    p.add_argument(
        "--threads",
        type=positive_int,
        default=1,
        help="PyTorch's intra-op threads; give OPENBLAS_NUM_THREADS the same value for hpcdl",
    )


def run(args: Any) -> list[dict[str, Any]]:
    """Run ``bench step`` with parsed ``args``; prints the table on rank 0 and returns the rows."""
    if args.batch < 1 or args.repeat < 1 or args.steps < 1:
        raise ConfigError("--batch, --repeat and --steps must be positive integers")
    rows = bench_step(args.model, args.batch, args.vs, args.repeat, args.steps, threads=args.threads)
    if world().Get_rank() == 0:
        print_rows(rows)
    return rows
