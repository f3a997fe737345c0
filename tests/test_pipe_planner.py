"""The hybrid planner against exhaustive search over its own cost model, and its limits."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from hpcdl.errors import ConfigError
from hpcdl.parallel.pipe_plan import LayerInfo
from hpcdl.parallel.pipe_planner import (
    CostModel,
    Network,
    Plan,
    baselines,
    memory,
    microbatch_counts,
    plan,
    predict,
)


def compositions(total: int, parts: int):
    if parts == 1:
        yield (total,)
        return
    for first in range(1, total - parts + 2):
        for rest in compositions(total - first, parts - 1):
            yield (first, *rest)


def exhaustive(model: CostModel, ranks: int, batch: int) -> float:
    """Every partition × replication × microbatch cut the model allows: the least predicted step
    that fits."""
    best, n = math.inf, len(model.layers)
    for m in microbatch_counts(model, batch):
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
    # beta up to 1e-6 s/B: a 10**6-byte activation's channel time rivals a layer's compute
    net = Network(
        rng.choice([0, 1e-3, 1e-2]), rng.choice([0, 1e-9, 1e-7, 1e-6]), rng.choice([None, 0.0, 1e-2])
    )
    limit = rng.choice([0, 0, 2e6, 5e6, 1e7])
    ref = rng.choice([1, 2, 4])
    more = rng.sample([s for s in (1, 3, 8) if s != ref], rng.choice([0, 0, 1, 2]))  # costs at other sizes
    sizes = [(b, [rng.uniform(0, 3) * b / ref for _ in range(n)]) for b in more]
    accumulate = rng.choice([0.0, 0.0, 1e-7])
    gather = rng.choice([0.0, 0.0, 0.05])
    schedule = rng.choice(["gpipe", "1f1b"])
    model = CostModel(layers, ref, net, schedule, limit, sizes=sizes, accumulate_s=accumulate, input_s=gather)
    return model, ranks, batch


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


def check(model: CostModel, ranks: int, batch: int) -> None:
    """The planner's step is exhaustive search's, its plan is valid and its step is predict's."""
    want = exhaustive(model, ranks, batch)
    if want == math.inf:
        with pytest.raises(ConfigError):
            plan(model, ranks, batch)
        return
    got, step = plan(model, ranks, batch)
    assert math.isclose(step, want, rel_tol=1e-9), (got, step, want)
    assert math.isclose(predict(got, model), step, rel_tol=1e-9)
    assert sum(got.replicas) == ranks and all(got.microbatches % r == 0 for r in got.replicas)
    if model.memory_limit:
        assert max(memory(got, model)) <= model.memory_limit


@pytest.mark.parametrize("seed", range(4))
def test_planner_equals_exhaustive_search_with_many_ranks_and_few_layers(seed):
    """N up to 24 on 1-3 layers, batches of many divisors: long rank vectors, many replica counts."""
    rng = random.Random(100 + seed)
    for _ in range(10):
        model, _, _ = random_case(rng)
        sizes = [(b, t[:3]) for b, t in model.sizes]
        model = dataclasses.replace(model, layers=model.layers[:3], sizes=sizes)
        check(model, rng.randint(7, 24), rng.choice([16, 24, 36, 48, 60, 64]))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_planner_equals_exhaustive_search_on_ties(schedule):
    """Small integer costs, free or round-number networks: many plans share the least step."""
    rng = random.Random(7)
    for _ in range(30):
        n = rng.randint(2, 6)
        layers = [
            LayerInfo(str(i), rng.choice([0, 100, 200]), rng.choice([0, 1, 2]), rng.choice([0, 1, 2]), 100)
            for i in range(n)
        ]
        net = rng.choice([Network(), Network(1.0, 0.0), Network(0.0, 0.01, 0.0, 0.01), Network(1.0, 0.01)])
        check(CostModel(layers, 1, net, schedule), rng.randint(1, 5), rng.choice([4, 6, 8, 12]))


def test_planner_equals_exhaustive_search_where_memory_binds_by_depth():
    """1F1B limits at the memory of a random plan: a stage fits at one depth and not at the next."""
    rng = random.Random(11)
    for _ in range(40):
        model, ranks, batch = random_case(rng)
        ranks = min(ranks, 4)
        p = rng.randint(1, min(len(model.layers), ranks))
        balance = rng.choice(list(compositions(len(model.layers), p)))
        replicas = rng.choice(list(compositions(ranks, p)))
        ms = [d for d in range(1, batch + 1) if batch % d == 0 and all(d % r == 0 for r in replicas)]
        if not ms:
            continue
        m = rng.choice(ms)
        unlimited = CostModel(model.layers, model.batch, model.network, "1f1b")
        limit = max(memory(Plan(balance, replicas, m, batch), unlimited))
        check(CostModel(model.layers, model.batch, model.network, "1f1b", limit or 1.0), ranks, batch)


def test_planner_no_worse_than_any_sampled_plan_at_a_larger_size():
    """12 layers on 32 ranks (past exhaustive search): no random plan and no baseline beats it."""
    rng = random.Random(5)
    layers = [
        LayerInfo(str(i), rng.randint(10**4, 10**7), rng.uniform(0.01, 1), rng.uniform(0.02, 2), 10**5)
        for i in range(12)
    ]
    for net in (Network(1e-5, 1e-9), Network(1e-4, 1e-8)):
        model = CostModel(layers, 1, net, "1f1b", memory_limit=2e6)
        got, step = plan(model, 32, 64)
        assert math.isclose(predict(got, model), step, rel_tol=1e-9)
        assert all(v is None or step <= v[1] * (1 + 1e-9) for v in baselines(model, 32, 64).values())
        for _ in range(300):
            p = rng.randint(1, 12)
            balance = rng.choice(list(compositions(12, p)))
            replicas = [2 ** rng.randint(0, 5) for _ in range(p)]
            if sum(replicas) != 32:
                continue
            m = rng.choice([r for r in (1, 2, 4, 8, 16, 32, 64) if r >= max(replicas)])
            sample = Plan(balance, tuple(replicas), m, 64)
            if max(memory(sample, model)) <= model.memory_limit:
                assert step <= predict(sample, model) * (1 + 1e-9), sample


def test_a_pipeline_just_above_the_work_bound_is_found():
    """Stage busy times (m / r) t equal on every rank: the step is W / N plus the fill (3), half a
    percent above the bound the search prunes by, and no baseline has the plan."""
    layers = [LayerInfo("0", 0, 1.0, 2.0, 100), LayerInfo("1", 10**6, 0.5, 0.5, 100)]
    model = CostModel(layers, 1, Network(0.0, 0.0, allreduce_alpha=0.0, allreduce_beta=1e-6))
    got, step = plan(model, 4, 600)
    assert (got.balance, got.replicas, got.microbatches) == ((1, 1), (3, 1), 600)
    assert math.isclose(step, 603, rel_tol=1e-12) and math.isclose(step, exhaustive(model, 4, 600))
    assert all(v is None or v[1] > step for v in baselines(model, 4, 600).values())


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


def test_layer_times_interpolate_between_sizes_and_extend_the_last_slope():
    layers = [LayerInfo("0", 0, 0.3, 0.7), LayerInfo("1", 0, 1.0, 1.0)]  # 1.0 and 2.0 s at 4 samples
    model = CostModel(layers, 4, sizes=[(1, (0.5, 0.5)), (16, (2.5, 5.0))])
    assert list(model.layer_times(4)) == pytest.approx([1.0, 2.0])
    assert list(model.layer_times(2.5)) == pytest.approx([0.75, 1.25])  # halfway from 1 to 4
    assert list(model.layer_times(10)) == pytest.approx([1.75, 3.5])  # halfway from 4 to 16
    assert list(model.layer_times(32)) == pytest.approx([2.5 + 16 * 1.5 / 12, 5.0 + 16 * 3.0 / 12])
    assert model.smallest == 1
    alone = CostModel(layers, 4)  # one size: in proportion, as before sizes existed
    assert list(alone.layer_times(8)) == pytest.approx([2.0, 4.0])
    assert list(alone.layer_times(2)) == pytest.approx([0.5, 1.0])


def test_microbatches_below_the_smallest_measured_size_are_not_considered():
    layers = [LayerInfo(str(i), 10, 0.1, 0.2, 100) for i in range(3)]
    model = CostModel(layers, 4, Network(1e-6, 1e-12))
    assert microbatch_counts(model, 24) == [1, 2, 3, 4, 6]  # microbatches of 24, 12, 8, 6 and 4
    assert microbatch_counts(model, 3) == [1]  # the batch below it: one microbatch
    got, _ = plan(model, 3, 24)
    assert got.microbatch_size >= 4
    assert all(found[0].microbatch_size >= 4 for found in baselines(model, 3, 24).values() if found)
    finer = CostModel(layers, 4, Network(1e-6, 1e-12), sizes=[(1, (0.1, 0.1, 0.1))])  # 0.3 s a call at 1
    assert microbatch_counts(finer, 24) == [1, 2, 3, 4, 6, 8, 12, 24]
    assert plan(finer, 3, 24)[0].microbatch_size >= 4  # the per-call cost keeps it off 1-sample cuts


def test_a_slow_link_paces_the_pipeline():
    """Two stages, one replica each: the per-microbatch channel time, not the compute, sets the
    pace when it is larger (written out from the formula: fill + (m - 1) max(t, c) + A)."""
    layers = [LayerInfo("0", 0, 0.0, 0.0, 1000), LayerInfo("1", 0, 0.1, 0.2, 10)]
    alpha, beta = 1e-3, 1e-3  # 1 ms a byte: the 1,000-byte activation takes 1 s a microbatch
    model = CostModel(layers, 1, Network(alpha, beta))
    m = 8
    step = predict(Plan((1, 1), (1, 1), m, m), model)
    fill = 0.3 + 2 * (alpha + beta * 1000)
    assert step == pytest.approx(fill + (m - 1) * beta * 1000)
    one = predict(Plan((2,), (1,), m, m), model)  # one stage: no link, compute alone
    assert one == pytest.approx(m * 0.3)


def test_accumulating_gradients_is_charged_per_microbatch():
    layers = [LayerInfo("0", 1000, 0.1, 0.2, 10)]
    model = CostModel(layers, 1, accumulate_s=1e-4)  # 0.1 s to add a microbatch's 1,000 gradients
    assert predict(Plan((1,), (2,), 8, 8), model) == pytest.approx(0.3 + 3 * (0.3 + 0.1))


def test_the_first_stage_gathers_its_inputs():
    layers = [LayerInfo("0", 0, 0.1, 0.2, 10), LayerInfo("1", 0, 0.1, 0.2, 10)]
    model = CostModel(layers, 1, input_s=0.05)  # 0.05 s a sample on whichever stage holds layer 0
    m, b = 4, 2
    one = 2 * (0.3 + 0.3) + 0.05 * b  # a microbatch of 2 through both layers, gathered first
    assert predict(Plan((2,), (1,), m, m * b), model) == pytest.approx(m * one)
    first, second = 2 * 0.3 + 0.05 * b, 2 * 0.3
    assert predict(Plan((1, 1), (1, 1), m, m * b), model) == pytest.approx(first + second + (m - 1) * first)
