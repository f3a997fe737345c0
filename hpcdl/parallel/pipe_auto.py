"""``pipeline.balance = "plan"``: the hybrid planner run on the config's model, its plan as config values.

Before the pipeline is placed, the driver asks the strategy to settle what it works out from
the model (:meth:`~hpcdl.parallel.Strategy.settle`); with ``balance = "plan"`` that is the plan
of :func:`hpcdl.parallel.pipe_planner.plan` — the contiguous partition, each stage's replicas
and the microbatch cut of the configured global batch (``pipeline.microbatches`` ×
``data.batch_size``) of least predicted step time. Its inputs:

* **layer costs**: ``pipeline.profile`` (a run file's ``profile/`` or a TOML/CSV cost table:
  one microbatch size, so the planner cuts no microbatch smaller than it) or, when that is
  empty, :data:`~hpcdl.parallel.pipe_profile.PROFILE_STEPS` steps rank 0 profiles at each
  microbatch size of :func:`~hpcdl.parallel.pipe_profile.profile_sizes` (``data.batch_size``
  and a ladder from a 64th of it to 4 times it) on training samples, with the cost of adding
  a microbatch's gradients into their sum
  (:func:`~hpcdl.parallel.pipe_profile.accumulate_cost`) and of gathering a microbatch's
  samples (:func:`~hpcdl.parallel.pipe_profile.input_cost`) — impossible when the training set
  holds fewer samples than ``data.batch_size``: the run is refused, naming
  ``pipeline.profile``;
* **the network**: ``pipeline.network`` (a simulator network file, packaged name or path; the
  packaged ``shm-local``, one node, by default), read as α-β between two of the N ranks;
* **a memory limit**: ``pipeline.memory_mb`` of activations per rank (0: none).

The plan becomes ``pipeline.balance``, ``pipeline.replicas``, ``pipeline.microbatches`` and
``data.batch_size`` — and ``optimizer.lr``, rescaled when the cut changes m, so that the
learning rate of an update is the configured global batch's under ``schedule.scale``
(the rule counts m batches per update: ``lr' = lr · scale(m) / scale(m')``) — and
``pipeline.planned`` records it (JSON: the plan, its predicted step,
and the baselines ``--plan`` prints beside it). The run file stores the settled config; a
resume takes the plan from there instead of planning again, so a fresh profile cannot change
a running job's cut.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import astuple
from typing import Any

import numpy as np

from hpcdl.errors import ConfigError
from hpcdl.optim import scaled_lr
from hpcdl.parallel.pipe_planner import CostModel, Network, baselines, plan
from hpcdl.parallel.pipe_profile import (
    accumulate_cost,
    input_cost,
    layer_infos,
    profile_costs,
    profile_sizes,
)
from hpcdl.store.costs import LayerCost, load_cost_table

__all__ = ["PLANNED", "planned_lines", "settle_plan"]

#: the config keys a plan sets (with ``pipeline.planned``, its record)
PLANNED = (
    "pipeline.balance",
    "pipeline.replicas",
    "pipeline.stages",
    "pipeline.microbatches",
    "data.batch_size",
    "optimizer.lr",
)
#: what --plan names each baseline
_BASELINES = {
    "uniform": "uniform cut, no replication",
    "time": "time-balanced cut, no replication",
    "data": "pure data parallel (one stage)",
    "replicated": "uniform replicas of time-balanced stages",
}


def settle_plan(cfg: Any, world: int, inputs: Any) -> dict[str, Any]:
    """The config values of the plan for ``world`` ranks (module docstring), or {} unless
    ``pipeline.balance = "plan"``; on a resume, the plan the run was started with.

    Raises:
        ConfigError: ``interleaved`` (the planner plans GPipe and 1F1B), ``pipeline.replicas``
            or ``pipeline.stages`` set beside it, no costs and no way to profile, a cost table
            without a row for a layer, or no plan within the memory limit.
    """
    if cfg["pipeline.balance"] != "plan":
        return {}
    stored = inputs.stored
    if stored is not None and stored.get("pipeline.planned"):
        return {key: stored[key] for key in (*PLANNED, "pipeline.planned")}
    if cfg["pipeline.schedule"] not in ("gpipe", "1f1b"):
        raise ConfigError(
            "pipeline.balance = 'plan' plans gpipe and 1f1b, not pipeline.schedule = "
            f"{cfg['pipeline.schedule']!r}"
        )
    if cfg["pipeline.replicas"] or cfg["pipeline.stages"] or cfg["pipeline.split"]:
        raise ConfigError(
            "pipeline.balance = 'plan' chooses the stages and their replicas: leave pipeline.replicas, "
            "pipeline.stages and pipeline.split unset"
        )
    batch, m = cfg["data.batch_size"], cfg["pipeline.microbatches"]
    model, data = inputs.model(), inputs.data()
    sizes: list[tuple[int, tuple[float, ...]]] = []
    accumulate = gather = 0.0
    profiled: dict[int, dict[str, LayerCost]] = {}  # size -> costs, when rank 0 profiles
    if cfg["pipeline.profile"]:
        costs, source = load_cost_table(cfg["pipeline.profile"]), str(cfg["pipeline.profile"])
    else:
        if len(data.y_train) < batch:
            raise ConfigError(
                f"pipeline.balance = 'plan' needs layer costs: the {len(data.y_train)} training samples "
                f"cannot make a microbatch of {batch} to profile; set pipeline.profile to a cost table "
                "or a run file made with profile.layers = true"
            )
        ladder = profile_sizes(batch, min(m * batch, len(data.y_train)))
        for size in ladder:
            x = np.asarray(data.x_train[:size], dtype=cfg["dtype"])
            profiled[size] = profile_costs(inputs.model(), x, np.asarray(data.y_train[:size]))
        costs, source = profiled[batch], f"profiled at {', '.join(map(str, ladder))} samples"
        accumulate = accumulate_cost(sum(int(p.size) for p in model.parameters()), cfg["dtype"])
        gather = input_cost(inputs.batch, len(data.y_train), batch)
    measured_at = {c.batch for c in costs.values() if c.batch}  # a table's one size is the reference
    ref = measured_at.pop() if len(measured_at) == 1 else batch
    infos = layer_infos(model, data.input_shape, ref, costs)
    for size, measured in profiled.items():
        if size != batch:
            zero = LayerCost(0.0, 0.0)
            sizes.append((size, tuple(sum(astuple(measured.get(x.name, zero))[:2]) for x in infos)))
    missing = [x.name for x in infos if x.name not in costs]
    if missing:
        raise ConfigError(
            f"pipeline.profile {cfg['pipeline.profile']} has no row for layer {missing[0]!r}: "
            "profile this model (a run with profile.layers = true)"
        )
    alpha, beta = inputs.network(cfg["pipeline.network"], world)
    itemsize = np.dtype(cfg["dtype"]).itemsize
    cost = CostModel(infos, ref, Network(alpha, beta), cfg["pipeline.schedule"],
                     cfg["pipeline.memory_mb"] * 2**20, itemsize, sizes, accumulate, gather)  # fmt: skip
    chosen, predicted = plan(cost, world, m * batch)
    others = {
        name: None if found is None else [str(found[0]), found[1]]
        for name, found in baselines(cost, world, m * batch).items()
    }
    record = {"plan": str(chosen), "predicted_s": predicted, "baselines": others, "costs": source,
              "network": cfg["pipeline.network"], "memory_mb": cfg["pipeline.memory_mb"]}  # fmt: skip
    lr = (
        cfg["optimizer.lr"]
        * scaled_lr(1.0, m, cfg["schedule.scale"])
        / scaled_lr(1.0, chosen.microbatches, cfg["schedule.scale"])
    )
    return {
        "optimizer.lr": lr,
        "pipeline.balance": list(chosen.balance),
        "pipeline.replicas": list(chosen.replicas),
        "pipeline.stages": 0,
        "pipeline.microbatches": chosen.microbatches,
        "data.batch_size": chosen.microbatch_size,
        "pipeline.planned": json.dumps(record, sort_keys=True),
    }


def planned_lines(cfg: Mapping[str, Any]) -> list[str]:
    """``--plan``'s comparison: the chosen plan and its predicted step beside the baselines, each at
    the same global batch with its own best microbatch cut ([] when the run was not planned)."""
    if not cfg["pipeline.planned"]:
        return []
    record = json.loads(cfg["pipeline.planned"])
    best = record["predicted_s"]
    rows = [("planner's plan", record["plan"], best)]
    rows += [(_BASELINES[name], found[0], found[1]) for name, found in record["baselines"].items() if found]
    width = max(len(r[0]) for r in rows)
    lines = [
        f"planned (pipeline.balance = 'plan'; costs: {record['costs']}; network {record['network']}"
        + (f"; at most {record['memory_mb']:g} MiB of activations per rank" if record["memory_mb"] else "")
        + "): predicted step times at the same global batch",
    ]
    for name, text, t in rows:
        ratio = t / best if best else 1.0
        lines.append(f"  {name:<{width}}  {t * 1e3:10.3f} ms  {ratio:5.2f}x the plan's  {text}")
    missing = [_BASELINES[name] for name, found in record["baselines"].items() if not found]
    if missing:
        lines.append(f"  (does not apply or fit: {', '.join(missing)})")
    return lines
