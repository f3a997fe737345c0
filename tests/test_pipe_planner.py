"""The hybrid planner against exhaustive search over its own cost model, and its limits."""

from __future__ import annotations

import math
import random

import pytest

from hpcdl.errors import ConfigError
from hpcdl.parallel.pipe_plan import LayerInfo
from hpcdl.parallel.pipe_planner import CostModel, Network, Plan, baselines, memory, plan, predict


def compositions(total: int, parts: int):
    if parts == 1:
        yield (total,)
        return
    for first in range(1, total - parts + 2):
        for rest in compositions(total - first, parts - 1):
            yield (first, *rest)


def exhaustive(model: CostModel, ranks: int, batch: int) -> float:
    """Every partition × replication × microbatch cut: the least predicted step that fits."""
    best, n = math.inf, len(model.layers)
    for m in (d for d in range(1, batch + 1) if batch % d == 0):
        for p in range(1, min(n, ranks) + 1):
            for balance in compositions(n, p):
                for replicas in compositions(ranks, p):
                    if any(m % r for r in replicas):
                        continue
                    candidate = Plan(balance, replicas, m, batch)
                    if model.memory_limit and max(memory(candidate, model)) > model.memory_limit:
                        continue
                    best = min(best, predict(candidate, model))
    return best


def random_case(rng: random.Random) -> tuple[CostModel, int, int]:
    n = rng.randint(1, 8)
    ranks = rng.randint(1, 6)
    batch = rng.choice([1, 2, 4, 6, 8, 12])
    layers = [
        LayerInfo(str(i), rng.randint(0, 10**6), rng.uniform(0, 1), rng.uniform(0, 2), rng.randint(1, 10**6))
        for i in range(n)
    ]
    net = Network(rng.choice([0, 1e-3, 1e-2]), rng.choice([0, 1e-9, 1e-7]), rng.choice([None, 0.0, 1e-2]))
    limit = rng.choice([0, 0, 2e6, 5e6, 1e7])
    return CostModel(layers, rng.choice([1, 2, 4]), net, rng.choice(["gpipe", "1f1b"]), limit), ranks, batch


@pytest.mark.parametrize("seed", range(8))
def test_planner_equals_exhaustive_search(seed):
    rng = random.Random(seed)
    for _ in range(25):
        model, ranks, batch = random_case(rng)
        if len(model.layers) > 6 and ranks > 4:  # keep the exhaustive side fast
            ranks = 4
        want = exhaustive(model, ranks, batch)
        if want == math.inf:
            with pytest.raises(ConfigError):
                plan(model, ranks, batch)
            continue
        got, step = plan(model, ranks, batch)
        assert math.isclose(step, want, rel_tol=1e-9), (got, step, want)
        assert math.isclose(predict(got, model), step, rel_tol=1e-9)
        assert sum(got.replicas) == ranks and all(got.microbatches % r == 0 for r in got.replicas)
        if model.memory_limit:
            assert max(memory(got, model)) <= model.memory_limit


def test_memory_limit_no_plan_meets_is_one_line():
    layers = [LayerInfo(str(i), 10, 1.0, 2.0, 2**20) for i in range(3)]
    model = CostModel(layers, 1, Network(), "gpipe", memory_limit=100)
    with pytest.raises(ConfigError) as err:
        plan(model, 2, 4)
    text = str(err.value)
    assert "\n" not in text and "the least any plan needs is 6 MiB" in text, text


def test_least_memory_named_is_the_least():
    layers = [LayerInfo(str(i), 10, 1.0, 2.0, 1000 * (i + 1)) for i in range(4)]
    for schedule in ("gpipe", "1f1b"):
        least = min(
            max(memory(Plan(b, r, m, 8), CostModel(layers, 1, schedule=schedule)))
            for m in (1, 2, 4, 8)
            for p in range(1, 4)
            for b in compositions(4, p)
            for r in compositions(3, p)
            if not any(m % x for x in r)
        )
        fits = CostModel(layers, 1, Network(), schedule, memory_limit=least)
        got, _ = plan(fits, 3, 8)
        assert max(memory(got, fits)) <= least
        with pytest.raises(ConfigError, match=f"needs is {least / 2**20:.4g} MiB"):
            plan(CostModel(layers, 1, Network(), schedule, memory_limit=least * 0.999), 3, 8)


@pytest.mark.parametrize("ranks, batch", [(1, 4), (2, 8), (4, 8), (3, 12), (6, 12)])
def test_all_equal_layers_free_network_give_the_work_divided_evenly(ranks, batch):
    n, cost, ref = 5, 0.3, 2
    layers = [LayerInfo(str(i), 100, 0.1, 0.2, 64) for i in range(n)]
    _, step = plan(CostModel(layers, ref, Network()), ranks, batch)
    assert math.isclose(step, batch / ref * n * cost / ranks, rel_tol=1e-12)


def test_data_parallel_wins_when_its_communication_is_free_and_it_fits():
    layers = [LayerInfo(str(i), 1000 * (i + 1), 0.1 * (i + 1), 0.2, 10**6) for i in range(5)]
    model = CostModel(layers, 1, Network(1e-3, 1e-9, allreduce_alpha=0.0, allreduce_beta=0.0))
    got, step = plan(model, 4, 16)
    assert got.balance == (5,) and got.replicas == (4,)
    assert math.isclose(step, baselines(model, 4, 16)["data"][1], rel_tol=1e-12)


def test_a_heavy_layer_gets_more_replicas():
    # the light layers hold many parameters (costly to replicate), the heavy one few
    costs = [(1.0, 10**8), (1.0, 10**8), (10.0, 1000), (1.0, 10**8)]
    layers = [LayerInfo(str(i), params, t, 2 * t, 1000) for i, (t, params) in enumerate(costs)]
    model = CostModel(layers, 1, Network(0.0, 0.0, allreduce_alpha=0.0, allreduce_beta=1e-7))
    got, step = plan(model, 6, 12)
    stage_of = [s for s, size in enumerate(got.balance) for _ in range(size)]
    heavy = got.replicas[stage_of[2]]
    assert len(got.balance) > 1
    assert all(heavy > r for s, r in enumerate(got.replicas) if s != stage_of[2])
    assert step < min(v[1] for v in baselines(model, 6, 12).values() if v is not None)


def test_baselines_are_the_named_layouts():
    layers = [LayerInfo(str(i), 10, 0.1 * (i + 1), 0.1, 100) for i in range(6)]
    out = baselines(CostModel(layers, 1, Network(1e-4, 1e-9)), 4, 16)
    assert sorted(out["uniform"][0].balance) == [1, 1, 2, 2]
    assert out["uniform"][0].replicas == (1, 1, 1, 1) and out["time"][0].replicas == (1, 1, 1, 1)
    assert out["data"][0].balance == (6,) and out["data"][0].replicas == (4,)
    assert set(out["replicated"][0].replicas) == {2}
