"""Pipeline plans (``hpcdl.parallel.pipe_plan``) against literal tables, closed forms and brute force."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from hpcdl.errors import ConfigError
from hpcdl.parallel.pipe_plan import (
    LayerInfo,
    balance_by_cost,
    bubble_fraction,
    gpipe,
    interleaved,
    one_f_one_b,
    partition,
    schedule,
    simulate,
)


def test_gpipe_runs_every_forward_then_the_backwards_in_reverse() -> None:
    assert str(gpipe(3, 4)) == (
        "stage 0: F0 F1 F2 F3 B3 B2 B1 B0\nstage 1: F0 F1 F2 F3 B3 B2 B1 B0\nstage 2: F0 F1 F2 F3 B3 B2 B1 B0"
    )


def test_1f1b_warms_up_alternates_and_drains() -> None:
    assert str(one_f_one_b(3, 4)) == (
        "stage 0: F0 F1 F2 B0 F3 B1 B2 B3\nstage 1: F0 F1 B0 F2 B1 F3 B2 B3\nstage 2: F0 B0 F1 B1 F2 B2 F3 B3"
    )
    assert str(one_f_one_b(4, 2)) == (  # fewer microbatches than stages: warm-up is cut short
        "stage 0: F0 F1 B0 B1\nstage 1: F0 F1 B0 B1\nstage 2: F0 F1 B0 B1\nstage 3: F0 B0 F1 B1"
    )


@pytest.mark.parametrize("p", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("m", [1, 2, 4, 7, 16])
def test_every_stage_runs_each_microbatch_once_forward_then_backward(p: int, m: int) -> None:
    for plan in (gpipe(p, m), one_f_one_b(p, m)):
        for ops in plan.stages:
            assert sorted((op.kind, op.microbatch) for op in ops) == sorted(
                [("F", k) for k in range(m)] + [("B", k) for k in range(m)]
            )
            for k in range(m):
                assert ops.index(next(o for o in ops if o.kind == "F" and o.microbatch == k)) < ops.index(
                    next(o for o in ops if o.kind == "B" and o.microbatch == k)
                )


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("m", [1, 4, 16])
def test_equal_costs_give_the_closed_form_bubble_and_1f1b_holds_at_most_p_microbatches(
    p: int, m: int
) -> None:
    """GPipe's bubble (p - 1) / (m + p - 1) on every stage, 1F1B's the same, and 1F1B keeps
    at most p - s microbatches' activations on stage s where GPipe keeps m."""
    for plan in (gpipe(p, m), one_f_one_b(p, m)):
        timeline = simulate(plan, [1.0] * p, [2.0] * p)
        assert timeline.makespan == (m + p - 1) * 3.0
        for s in range(p):
            assert timeline.bubble(s) == pytest.approx(bubble_fraction(p, m), rel=1e-12)
    assert gpipe(p, m).in_flight() == [m] * p
    assert one_f_one_b(p, m).in_flight() == [min(p - s, m) for s in range(p)]


def test_interleaved_goes_through_the_chunks_in_groups_of_p() -> None:
    """Megatron-LM's order: forwards of chunk 0 for microbatches 0..p-1, then chunk 1 for them,
    ...; backwards with the chunks reversed; stage s warms up with 2 (p - s - 1) + (v - 1) p."""
    assert str(interleaved(2, 4, 2)) == (
        "stage 0: F0.0 F1.0 F0.1 F1.1 F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 B1.0 B2.1 B3.1 B2.0 B3.0\n"
        "stage 1: F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 F2.0 B0.0 F3.0 B1.0 F2.1 B2.1 F3.1 B3.1 B2.0 B3.0"
    )
    assert str(interleaved(2, 2, 2)) == (  # m = p: every forward first
        "stage 0: F0.0 F1.0 F0.1 F1.1 B0.1 B1.1 B0.0 B1.0\nstage 1: F0.0 F1.0 F0.1 F1.1 B0.1 B1.1 B0.0 B1.0"
    )


@pytest.mark.parametrize(("p", "m", "v"), [(2, 2, 2), (2, 4, 2), (2, 6, 3), (3, 6, 2), (4, 4, 2), (4, 8, 2),
                                           (4, 16, 4), (8, 8, 2), (8, 32, 3)])  # fmt: skip
def test_interleaved_runs_every_chunk_and_microbatch_once_without_deadlock_and_shrinks_the_bubble(
    p: int, m: int, v: int
) -> None:
    plan = interleaved(p, m, v)
    for ops in plan.stages:
        pairs = [(op.kind, op.chunk, op.microbatch) for op in ops]
        assert sorted(pairs) == sorted((kind, c, k) for kind in "FB" for c in range(v) for k in range(m))
        for c in range(v):
            for k in range(m):
                assert pairs.index(("F", c, k)) < pairs.index(("B", c, k))
    timeline = simulate(plan, [1.0 / v] * (p * v), [2.0 / v] * (p * v))  # the same model cut finer
    for s in range(p):
        assert timeline.bubble(s) == pytest.approx(bubble_fraction(p, m, v), rel=1e-9)
    assert bubble_fraction(p, m, v) < bubble_fraction(p, m)


def test_interleaving_that_does_not_fit_is_one_line() -> None:
    with pytest.raises(ConfigError, match="a multiple of the 4 stages"):
        schedule("interleaved", 4, 6, 2)
    with pytest.raises(ConfigError, match="virtual_stages >= 2"):
        schedule("interleaved", 4, 8, 1)
    with pytest.raises(ConfigError, match="needs pipeline.schedule = 'interleaved'"):
        schedule("1f1b", 4, 8, 2)


def test_the_slowest_stage_sets_the_pace_and_transfers_add_up() -> None:
    """Two stages, the second twice as slow: in steady state one microbatch per its cycle."""
    timeline = simulate(gpipe(2, 8), [1.0, 2.0], [1.0, 2.0], transfer=0.5)
    # stage 1's forwards: the first waits for stage 0 (1 + 0.5), then back to back (8 x 2);
    # its backwards follow at once (8 x 2); stage 0's last backward waits for its gradient
    assert timeline.end[1][-1] == 1.5 + 16 + 16
    assert timeline.makespan == 1.5 + 16 + 16 + 0.5 + 1.0


def test_simulate_refuses_costs_of_another_stage_count() -> None:
    with pytest.raises(ValueError, match="costs for 2/2 stages, the schedule has 3"):
        simulate(gpipe(3, 2), [1.0, 1.0], [1.0, 1.0])


def test_schedule_names_and_bad_counts_are_one_line() -> None:
    assert schedule("1f1b", 2, 2) == one_f_one_b(2, 2)
    with pytest.raises(
        ConfigError,
        match="pipeline.schedule = 'pipedream' is not a schedule; schedules: gpipe, 1f1b, interleaved",
    ):
        schedule("pipedream", 2, 2)
    with pytest.raises(ConfigError, match="at least 1 stage and 1 microbatch"):
        gpipe(2, 0)


def _brute(costs: list[float], p: int) -> float:
    n = len(costs)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), p - 1):
        bounds = [0, *cuts, n]
        best = min(best, max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])))
    return best


def test_balance_by_cost_minimises_the_slowest_stage() -> None:
    assert balance_by_cost([1, 2, 3, 4, 5, 6, 7, 8, 9], 3) == [5, 2, 2]  # 15, 13, 17
    assert balance_by_cost([10, 1, 1, 1, 1], 2) == [1, 4]
    assert balance_by_cost([1.0] * 8, 4) == [2, 2, 2, 2]
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 10))
        p = int(rng.integers(1, n + 1))
        costs = rng.integers(0, 20, n).astype(float).tolist()
        sizes = balance_by_cost(costs, p)
        assert len(sizes) == p and sum(sizes) == n and min(sizes) >= 1
        bounds = np.cumsum([0, *sizes])
        worst = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
        assert worst == _brute(costs, p), (costs, p, sizes)


def test_balance_by_cost_refuses_what_cannot_be_cut() -> None:
    with pytest.raises(
        ConfigError, match="4 pipeline stages for 3 layers: every stage needs at least one layer"
    ):
        balance_by_cost([1, 2, 3], 4)
    with pytest.raises(ConfigError, match="negative"):
        balance_by_cost([1, -2, 3], 2)


# -- the partition description ---------------------------------------------------------------

#: digits-mlp's six top-level layers: parameters, forward and backward seconds, output bytes
_ROWS = [(0, 1e-6, 1e-6, 8192), (16640, 2e-5, 3e-5, 32768), (0, 5e-6, 3e-6, 32768),
         (65792, 5e-5, 9e-5, 32768), (0, 5e-6, 3e-6, 32768), (2570, 6e-6, 1e-5, 1280)]  # fmt: skip
MLP = [
    LayerInfo(str(i), params=p, forward_s=f, backward_s=b, output_bytes=o)
    for i, (p, f, b, o) in enumerate(_ROWS)
]


def test_a_balance_list_a_split_and_each_method_cut_where_they_should() -> None:
    assert partition(MLP, balance=[2, 4]).balance == (2, 4)
    assert partition(MLP, split=["3"]).balance == (3, 3)
    assert partition(MLP, split=["2", "5"]).balance == (2, 3, 1)
    assert partition(MLP, 2, balance="uniform").balance == (3, 3)
    # parameters: the 65,792 of layer 3 bound any cut; ties keep the earliest last cut
    assert partition(MLP, 2, balance="params").balance == (2, 4)  # 16,640 | 68,362
    params = [float(x.params) for x in MLP]
    three = partition(MLP, 3, balance="params").balance
    bounds = np.cumsum([0, *three])
    assert max(sum(params[a:b]) for a, b in zip(bounds, bounds[1:])) == _brute(params, 3) == 65792
    assert partition(MLP, 2, balance="time").balance == (3, 3)  # 65 us | 173 us
    assert partition(MLP, 2, balance="memory").balance == (3, 3)


def test_the_partition_prints_stage_layers_parameters_times_and_bytes_sent() -> None:
    assert partition(MLP, balance=[2, 4]).table() == (
        "partition (balance): balance = [2, 4]\n"
        "stage  layers                        params  forward ms  backward ms  sends bytes\n"
        "0      0 .. 1                        16,640       0.021        0.031       32,768\n"
        "1      2 .. 5                        68,362       0.066        0.106            0"
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"balance": [2, 3]}, "pipeline.balance = [2, 3] sums to 5; the model has 6 top-level layers"),
        ({"balance": [6, 0]}, "pipeline.balance gives stage 1 no layer: every stage needs one"),
        (
            {"split": ["7"]},
            "pipeline.split names '7', not a top-level layer of the model; layers: 0, 1, 2, 3, 4, 5",
        ),
        ({"split": ["3", "2"]}, "the names must follow the model's order, once each"),
        ({"split": ["0"]}, "and not name its first layer"),
        (
            {"balance": "flops", "stages": 2},
            "pipeline.balance = 'flops' is not a method; methods: uniform, params",
        ),
        (
            {"balance": "uniform", "stages": 7},
            "7 pipeline stages for a model of 6 top-level layers: use at most 6",
        ),
        ({"balance": [3, 3], "stages": 3}, "pipeline.balance describes 2 stages; the run has 3"),
        ({"balance": [3, 3], "split": ["3"]}, "by pipeline.balance or by pipeline.split (one of them)"),
    ],
)
def test_a_description_that_does_not_fit_is_one_line(kwargs: dict, message: str) -> None:
    stages = kwargs.pop("stages", None)
    with pytest.raises(ConfigError) as info:
        partition(MLP, stages, **kwargs)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_time_balance_needs_a_profile() -> None:
    bare = [LayerInfo(x.name, params=x.params) for x in MLP]
    with pytest.raises(ConfigError, match="needs per-layer times: give pipeline.profile"):
        partition(bare, 2, balance="time")
