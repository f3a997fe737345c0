"""The pipeline's planning inputs: what the partitioner knows of a model's top-level layers.

Each layer's parameters and output bytes (from the shapes of a one-sample forward) and its
forward/backward times, read from a cost table (``pipeline.profile``:
:func:`hpcdl.store.costs.load_cost_table`) or measured here by profiling a few steps; then
the partition ``[pipeline]`` describes (:func:`stage_partition`), worked out by the pure
planner of :mod:`hpcdl.parallel.pipe_plan`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hpcdl.backend import get_array_module
from hpcdl.errors import ConfigError
from hpcdl.nn import LayerProfiler, Sequential, SoftmaxCrossEntropy, observe
from hpcdl.parallel.pipe_plan import LayerInfo, Partition, partition
from hpcdl.store.costs import LayerCost, load_cost_table

__all__ = [
    "PROFILE_STEPS",
    "accumulate_cost",
    "input_cost",
    "layer_infos",
    "profile_costs",
    "profile_sizes",
    "sample_shapes",
    "stage_partition",
]

#: steps rank 0 profiles for ``balance = "time"`` when ``pipeline.profile`` is empty
PROFILE_STEPS = 3


def sample_shapes(model: Sequential, x: Any) -> list[tuple[int, ...]]:
    """One sample's shape into the model and out of each top-level layer (a forward of the
    one-sample ``x`` in evaluation mode: BatchNorm statistics and dropout streams untouched)."""
    shapes = [tuple(x.shape[1:])]
    training = model.training
    model.eval()
    try:
        for layer in model.layers:
            x = layer.forward(x)
            shapes.append(tuple(x.shape[1:]))
    finally:
        model.train(training)
    return shapes


def layer_infos(
    model: Sequential,
    input_shape: Sequence[int],
    batch: int,
    costs: Mapping[str, LayerCost] | None = None,
) -> list[LayerInfo]:
    """What the partitioner knows of each top-level layer: parameters, output bytes at ``batch``
    samples (:func:`sample_shapes`), and ``costs``' times scaled to ``batch``.

    Args:
        model: the whole model.
        input_shape: one sample's shape.
        batch: samples per microbatch.
        costs: layer name -> :class:`~hpcdl.store.costs.LayerCost` (a cost table), or None.
    """
    first = model.parameters()[0].data  # a model has parameters; a stage may not
    shapes = sample_shapes(model, get_array_module(first).zeros((1, *input_shape), dtype=first.dtype))
    infos = []
    for name, layer, shape in zip(model._children, model.layers, shapes[1:], strict=True):
        fwd = bwd = 0.0
        cost = (costs or {}).get(name)
        if cost is not None:
            scale = batch / cost.batch if cost.batch else 1.0
            fwd, bwd = cost.forward_s * scale, cost.backward_s * scale
        params = sum(int(p.size) for p in layer.parameters())
        out_bytes = math.prod(shape) * first.dtype.itemsize * batch
        infos.append(LayerInfo(name, params, fwd, bwd, out_bytes))
    return infos


def profile_costs(model: Sequential, x: Any, y: Any, steps: int = PROFILE_STEPS) -> dict[str, LayerCost]:
    """Per top-level layer, the median forward and backward time over ``steps`` steps on ``(x, y)``
    after one warm-up step.

    Run on a model of its own (its gradients, BatchNorm statistics and dropout draws are
    spent): the costs ``balance = "time"`` partitions by when no profile is given.
    """
    profiler = LayerProfiler()
    loss_fn = SoftmaxCrossEntropy()
    loss_fn.forward(model.forward(x), y)  # a warm-up step: first touches of memory, not timed
    model.backward(loss_fn.backward())
    with observe(profiler):
        for _ in range(steps):
            loss_fn.forward(model.forward(x), y)
            model.backward(loss_fn.backward())
    batch = int(x.shape[0])
    return {row["layer"]: LayerCost(row["forward_s"], row["backward_s"], batch) for row in profiler.table()}


def profile_sizes(batch: int, most: int) -> list[int]:
    """The microbatch sizes the planner profiles at (ascending): ``batch`` and a ladder of factors
    of 4 from ``batch / 64`` to ``4 batch``, none above ``most`` (the global batch, or the training
    samples there are) nor below 1. Per-call costs show at the small sizes, BLAS's efficiency
    at the large ones; the planner cuts no microbatch smaller than the smallest."""
    ladder = {batch} | {batch // 4**k for k in (1, 2, 3)} | {batch * 4}
    return sorted(b for b in ladder if 1 <= b <= max(batch, most) and (b <= most or b == batch))


def accumulate_cost(params: int, dtype: Any, repeats: int = 5) -> float:
    """Seconds a parameter of ``dtype`` takes to be added into a gradient sum (the executor's
    accumulation of a microbatch's gradients, ``a += b`` over the model's ``params``): the median
    of ``repeats`` timed additions, divided by ``params``."""
    import time

    import numpy as np

    n = max(int(params), 1)
    a, b = np.zeros(n, dtype=dtype), np.ones(n, dtype=dtype)
    a += b  # first touch of the pages, not timed
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a += b
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) / n


def input_cost(batch: Callable[[Any], Any], samples: int, size: int, repeats: int = 9) -> float:
    """Seconds a sample takes to be gathered into a microbatch of ``size`` (the first stage's
    input: ``batch(indices)`` of ``size`` random indices among ``samples`` training samples, as
    the run context gathers a step's): the median of ``repeats`` gathers after one, divided by
    ``size``."""
    import time

    import numpy as np

    rng = np.random.default_rng(0)
    times = []
    for i in range(repeats + 1):
        idx = rng.integers(0, samples, size)
        t0 = time.perf_counter()
        batch(idx)
        if i:  # the first touches the samples' pages
            times.append(time.perf_counter() - t0)
    return float(np.median(times)) / size


def stage_partition(
    cfg: Any, model: Sequential, stages: int, input_shape: Sequence[int], sample: Callable[[], Any] | None
) -> Partition:
    """The partition ``[pipeline]`` describes for ``stages`` stages of ``model`` (pure but for profiling).

    ``pipeline.split`` (names) when given, else ``pipeline.balance`` (counts or a method).
    ``balance = "time"`` takes its costs from ``pipeline.profile`` (a run file's ``profile/``
    or a cost table) or, when that is empty, profiles :data:`PROFILE_STEPS` steps of a
    microbatch ``sample()`` returns (``(model, x, y)``: a model of its own).

    Raises:
        ConfigError: the description does not fit the model (one line naming it).
    """
    balance, split = cfg["pipeline.balance"], cfg["pipeline.split"]
    if split and balance != "uniform":
        raise ConfigError(
            f"pipeline.split = {split} and pipeline.balance = {balance!r} both describe the partition: "
            "give one"
        )
    batch = cfg["data.batch_size"]
    costs = None
    if cfg["pipeline.profile"]:
        costs = load_cost_table(cfg["pipeline.profile"])
    elif balance == "time" and not split and sample is not None:
        costs = profile_costs(*sample())
    infos = layer_infos(model, input_shape, batch, costs)
    if balance == "time" and costs is not None and not split:
        missing = [x.name for x in infos if x.name not in costs]
        if missing:
            raise ConfigError(
                f"pipeline.profile {cfg['pipeline.profile']} has no row for layer {missing[0]!r}: "
                "profile this model (a run with profile.layers = true)"
            )
    if split:
        return partition(infos, stages, split=split)
    return partition(infos, stages, balance=balance)
