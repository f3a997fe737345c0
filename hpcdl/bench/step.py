"""``bench step``: forward + backward + update samples/s of one process, beside PyTorch.

With ``--optimizer kfac`` the same network also steps with K-FAC (``hpcdl.optim.kfac``) in
the same interleaved repetitions, and K-FAC's row splits its time per step into factor
collection (in forward and backward), folding, eigendecomposition (every ``--inv-every``
steps: amortised), preconditioning and the update — beside SGD's whole step. (The factors'
exchange is a distributed step's: ``bench train --set optimizer.name=kfac`` under mpiexec.)
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import numpy as np

from hpcdl.bench.torchref import torch_twin
from hpcdl.comm import world, wtime
from hpcdl.driver.cli import positive_int
from hpcdl.driver.convplan import MODES, plan_model
from hpcdl.errors import ConfigError
from hpcdl.models import MODELS, build_model
from hpcdl.nn import SoftmaxCrossEntropy, observe
from hpcdl.optim import KFAC, SGD
from hpcdl.rng import generator

__all__ = ["add_parser", "bench_step", "run"]

LR, MOMENTUM = 0.01, 0.9
#: one sample of each model's own data: MNIST-sized for the MLPs, the digits for ``cnn`` (the
#: ``digits-cnn`` preset's network); the models not named here take CIFAR-sized images
INPUT_SHAPES: dict[str, tuple[int, ...]] = {"mlp": (1, 28, 28), "mlp32": (1, 28, 28), "cnn": (1, 8, 8)}
CIFAR_SHAPE = (3, 32, 32)


def _hpcdl_stepper(  # noqa: PLR0917
    model_name: str,
    batch: int,
    shape: tuple[int, ...],
    classes: int,
    seed: int,
    inv_every: int = 0,
    winograd: str = "measure",
):
    """A step of hpcdl's network: SGD with momentum, or K-FAC (``inv_every > 0``) with the
    same momentum, its 3x3 convolutions chosen as ``model.winograd = winograd`` chooses in a run;
    returns the model, the step and the optimizer."""
    model = build_model(model_name, shape, classes, rng=generator(seed, "init"))
    for line in plan_model(model, winograd, shape, batch, np.float32):
        print(f"bench step: {line}", flush=True)
    if inv_every:
        opt: Any = KFAC(model, LR, momentum=MOMENTUM, inv_every=inv_every)
    else:
        opt = SGD(model.parameters(), LR, momentum=MOMENTUM)
    loss_fn = SoftmaxCrossEntropy()
    rng = generator(seed, "bench-data")
    x = rng.standard_normal((batch, *shape), dtype=np.float32)
    y = rng.integers(0, classes, batch)
    observer = getattr(opt, "observer", None)

    def step() -> None:
        with observe(observer) if observer is not None else nullcontext():
            loss_fn.forward(model.forward(x), y)
            model.backward(loss_fn.backward())
        opt.step()

    return model, step, opt


def _torch_stepper(model: Any, batch: int, shape: tuple[int, ...], classes: int, seed: int, threads: int):
    """The same network in PyTorch (:func:`~hpcdl.bench.torchref.torch_twin`), from hpcdl's weights."""
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
    optimizer: str = "sgd",
    inv_every: int = 10,
    winograd: Sequence[str] = ("measure",),
) -> list[dict[str, Any]]:
    """Forward + backward + SGD update samples/s of one process, optionally beside PyTorch, and
    with ``optimizer = "kfac"`` K-FAC's step beside it (module docstring).

    ``winograd`` chooses the 3x3 convolutions as ``model.winograd`` does in a run; with more
    than one value, the network steps once per value (rows ``hpcdl`` for the first,
    ``hpcdl winograd=VALUE`` for the others), in the same interleaved repetitions.

    Repetitions alternate between the implementations (hpcdl, torch, hpcdl, …)
    so that drifts of the machine hit both alike; each figure is the median. Each model
    takes samples of its own data's shape (:data:`INPUT_SHAPES`).
    """
    shape = INPUT_SHAPES.get(model, CIFAR_SHAPE)
    classes = 10
    net, hp_step, _ = _hpcdl_stepper(model, batch, shape, classes, seed, winograd=winograd[0])
    impls: dict[str, Callable[[], None]] = {"hpcdl": hp_step}
    for mode in winograd[1:]:
        impls[f"hpcdl winograd={mode}"] = _hpcdl_stepper(model, batch, shape, classes, seed, winograd=mode)[1]
    kfac = None
    if optimizer == "kfac":
        kfac_net = _hpcdl_stepper(model, batch, shape, classes, seed, inv_every, winograd[0])
        impls["hpcdl-kfac"], kfac = kfac_net[1], kfac_net[2]
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
    split: dict[str, list[float]] = {}
    for _ in range(repeat):
        for name, step in impls.items():
            before = dict(kfac.seconds) if kfac is not None and name == "hpcdl-kfac" else None
            times[name].append(_time(step, steps))
            if before is not None:
                for key, value in kfac.seconds.items():
                    split.setdefault(key, []).append((value - before[key]) / steps)
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
                "winograd": name.partition("=")[2] or (winograd[0] if name != "torch" else None),
                **({"inv_every": inv_every, **{f"{k}_s": statistics.median(v) for k, v in split.items()}}
                   if name == "hpcdl-kfac" else {}),
            }
        )  # fmt: skip
    return rows


def print_rows(rows: list[dict[str, Any]]) -> None:
    ref = next((r for r in rows if r["impl"] == "torch"), None)
    blas = os.environ.get("OPENBLAS_NUM_THREADS", "unset")
    print(
        f"bench step: {rows[0]['model']}, batch {rows[0]['batch']}, median of {rows[0]['repeat']} "
        f"interleaved repetitions (OPENBLAS_NUM_THREADS={blas}, torch threads={rows[0]['threads']})"
    )
    width = max(12, *(len(r["impl"]) + 2 for r in rows))
    print(f"{'impl':<{width}}{'samples/s':>12}{'step ms':>10}{'min..max ms':>16}{'vs torch':>10}")
    for r in rows:
        ratio = f"{r['samples_per_s'] / ref['samples_per_s']:.3f}" if ref else "-"
        span = f"{1e3 * r['step_s_min']:.1f}..{1e3 * r['step_s_max']:.1f}"
        rate, ms = f"{r['samples_per_s']:>12.0f}", f"{1e3 * r['step_s']:>10.2f}"
        print(f"{r['impl']:<{width}}{rate}{ms}{span:>16}{ratio:>10}")
    kfac = next((r for r in rows if r["impl"] == "hpcdl-kfac"), None)
    sgd = next((r for r in rows if r["impl"] == "hpcdl"), None)
    if kfac is not None and sgd is not None:
        parts = ("factors", "fold", "decompose", "precondition", "update")
        rest = kfac["step_s"] - sum(kfac[p + "_s"] for p in parts)
        print(
            f"K-FAC per step (ms, medians; eigendecompositions every {kfac['inv_every']} steps, amortised): "
            + ", ".join(f"{p} {1e3 * kfac[p + '_s']:.2f}" for p in parts)
            + f"; the rest (forward, backward) {1e3 * rest:.2f}"
            + f"; SGD's whole step {1e3 * sgd['step_s']:.2f} ({kfac['step_s'] / sgd['step_s']:.2f}x)"
        )


def add_parser(sub: Any) -> None:
    """Register ``step`` and its options on the ``bench`` subparsers."""
    p = sub.add_parser(
        "step",
        help="forward + backward + update samples/s of one process",
        description="Forward + backward + SGD update samples/s of one process, optionally beside PyTorch.",
    )
    p.add_argument(
        "--model",
        default="mlp32",
        choices=MODELS,
        help="the network to time, on samples of its data's shape: 1x28x28 for mlp and mlp32, the "
        "digits' 1x8x8 for cnn, 3x32x32 for the others",
    )
    p.add_argument("--batch", type=int, default=128, help="samples per step")
    p.add_argument(
        "--vs",
        choices=("torch",),
        default=None,
        help="also time the same network (every model), with the same initial weights, in PyTorch "
        "(needs torch; default: hpcdl only)",
    )
    p.add_argument(
        "--optimizer",
        choices=("sgd", "kfac"),
        default="sgd",
        help="kfac: also step with K-FAC and split its time per step (default: SGD only)",
    )
    p.add_argument(
        "--inv-every",
        type=positive_int,
        default=10,
        help="with --optimizer kfac: eigendecompose every this many steps (amortised in the split)",
    )
    p.add_argument(
        "--winograd",
        nargs="+",
        choices=[m for m in MODES if m != "layers"],
        default=["measure"],
        help="how the 3x3 convolutions are chosen, as model.winograd in a run (default: measure, timed on "
        "this machine and cached); several: one row each, interleaved",
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
    rows = bench_step(args.model, args.batch, args.vs, args.repeat, args.steps, threads=args.threads,
                      optimizer=args.optimizer, inv_every=args.inv_every,
                      winograd=tuple(dict.fromkeys(args.winograd)))  # fmt: skip
    if world().Get_rank() == 0:
        print_rows(rows)
    return rows
