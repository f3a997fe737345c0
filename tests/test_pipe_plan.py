"""Pipeline plans (``hpcdl.parallel.pipe_plan``) against literal tables, closed forms and brute force."""

from __future__ import annotations

import itertools
import math
from collections import deque

import numpy as np
import pytest

from hpcdl.errors import ConfigError
from hpcdl.parallel.pipe_plan import (
    EXCHANGE,
    LayerInfo,
    Op,
    ReplicatedSchedule,
    balance_by_cost,
    bubble_fraction,
    gpipe,
    interleaved,
    one_f_one_b,
    partition,
    replica_windows,
    replicated,
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


# -- replicated stages -----------------------------------------------------------------------


def test_replicated_gpipe_gives_each_replica_its_microbatches_k_mod_r() -> None:
    assert str(replicated("gpipe", 4, [2, 1])) == (
        "stage 0 replica 0: F0 F2 B2 B0 AR\n"
        "stage 0 replica 1: F1 F3 B3 B1 AR\n"
        "stage 1:           F0 F1 F2 F3 B3 B2 B1 B0"
    )
    assert str(replicated("gpipe", 4, [1, 2])) == (
        "stage 0:           F0 F1 F2 F3 B3 B2 B1 B0\n"
        "stage 1 replica 0: F0 F2 B2 B0 AR\n"
        "stage 1 replica 1: F1 F3 B3 B1 AR"
    )
    assert str(replicated("gpipe", 6, [3, 1, 2])) == (
        "stage 0 replica 0: F0 F3 B3 B0 AR\n"
        "stage 0 replica 1: F1 F4 B4 B1 AR\n"
        "stage 0 replica 2: F2 F5 B5 B2 AR\n"
        "stage 1:           F0 F1 F2 F3 F4 F5 B5 B4 B3 B2 B1 B0\n"
        "stage 2 replica 0: F0 F2 F4 B4 B2 B0 AR\n"
        "stage 2 replica 1: F1 F3 F5 B5 B3 B1 AR"
    )


def test_replicated_1f1b_warms_up_by_the_replicas_after_it() -> None:
    """Stage s's order has h_s r_s - 1 warm-up forwards (h: replica_windows), each replica runs
    its share: [2, 1] holds 2 per replica of stage 0, [1, 2] 3 on stage 0 (1 + 2 replicas below)."""
    assert str(replicated("1f1b", 4, [2, 1])) == (
        "stage 0 replica 0: F0 F2 B0 B2 AR\n"
        "stage 0 replica 1: F1 F3 B1 B3 AR\n"
        "stage 1:           F0 B0 F1 B1 F2 B2 F3 B3"
    )
    assert str(replicated("1f1b", 4, [1, 2])) == (
        "stage 0:           F0 F1 F2 B0 F3 B1 B2 B3\n"
        "stage 1 replica 0: F0 B0 F2 B2 AR\n"
        "stage 1 replica 1: F1 B1 F3 B3 AR"
    )
    assert str(replicated("1f1b", 6, [3, 1, 2])) == (
        "stage 0 replica 0: F0 F3 B0 B3 AR\n"
        "stage 0 replica 1: F1 F4 B1 B4 AR\n"
        "stage 0 replica 2: F2 F5 B2 B5 AR\n"
        "stage 1:           F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5\n"
        "stage 2 replica 0: F0 B0 F2 B2 F4 B4 AR\n"
        "stage 2 replica 1: F1 B1 F3 B3 F5 B5 AR"
    )
    assert str(replicated("1f1b", 12, [1, 3])).splitlines()[1:] == [  # two-digit microbatches: wider columns
        "stage 1 replica 0: F0  B0  F3  B3  F6  B6  F9  B9  AR",
        "stage 1 replica 1: F1  B1  F4  B4  F7  B7  F10 B10 AR",
        "stage 1 replica 2: F2  B2  F5  B5  F8  B8  F11 B11 AR",
    ]


@pytest.mark.parametrize("p", [1, 2, 3, 5])
@pytest.mark.parametrize("m", [1, 2, 4, 7])
def test_one_replica_per_stage_is_todays_schedule(p: int, m: int) -> None:
    for name in ("gpipe", "1f1b"):
        plan, today = replicated(name, m, [1] * p), schedule(name, p, m)
        assert tuple(lanes[0] for lanes in plan.stages) == today.stages
        assert all(len(lanes) == 1 for lanes in plan.stages)
        assert str(plan) == str(today)
        timeline, flat = simulate(plan, [1.0] * p, [2.0] * p, 0.5), simulate(today, [1.0] * p, [2.0] * p, 0.5)
        assert [t[0] for t in timeline.end] == list(flat.end) and timeline.makespan == flat.makespan
    assert replica_windows([1] * p) == [p - s for s in range(p)]


@pytest.mark.parametrize(
    ("m", "replicas", "message"),
    [
        (5, [2, 3], "pipeline.microbatches = 5 is not a multiple of every stage's replicas "
                    "(pipeline.replicas = [2, 3], multiples of 6): use 6"),
        (8, [2, 3], "multiples of 6): use 6"),
        (10, [2, 3], "multiples of 6): use 12"),
        (3, [2, 1], "multiples of 2): use 2 or 4"),
        (1, [4, 1], "multiples of 4): use 4"),
        (4, [2, 0], "pipeline.replicas = [2, 0]: every stage needs at least 1 replica"),
        (4, [2, 2], None),
    ],
)  # fmt: skip
def test_microbatches_not_a_multiple_of_the_replicas_is_one_line_naming_the_nearest(
    m: int, replicas: list[int], message: str | None
) -> None:
    if message is None:
        assert replicated("1f1b", m, replicas).replicas == (2, 2)
        return
    with pytest.raises(ConfigError) as info:
        replicated("1f1b", m, replicas)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_interleaved_and_unknown_schedules_refuse_replicas() -> None:
    with pytest.raises(ConfigError, match="'interleaved' cannot run replicated stages .* use gpipe or 1f1b"):
        replicated("interleaved", 4, [2, 2])
    with pytest.raises(ConfigError, match="at least 1 stage and 1 microbatch"):
        replicated("gpipe", 4, [])


def _run_with_messages(plan: ReplicatedSchedule) -> list[tuple[str, int, int]]:
    """Run ``plan`` as ranks would, independently of :func:`simulate`: sends are buffered
    (nonblocking), a receive blocks until the message at the head of its channel (one FIFO
    per sender, receiver and direction, as MPI's non-overtaking order) is there and must be
    the one it expects, the exchange blocks until every replica of its stage reaches it.
    Returns the operations ``(kind, stage, microbatch)`` in the order they completed."""
    p, reps = len(plan.stages), plan.replicas
    channels: dict[tuple, deque[int]] = {}
    nxt = {(s, j): 0 for s in range(p) for j in range(reps[s])}
    order: list[tuple[str, int, int]] = []

    def channel(*key: int | str) -> deque[int]:
        return channels.setdefault(key, deque())

    while True:
        moved = False
        for (s, j), i in nxt.items():
            ops = plan.stages[s][j]
            if i == len(ops):
                continue
            op = ops[i]
            if op.kind == "AR":
                waiting = [nxt[s, q] for q in range(reps[s])]
                if any(w < len(plan.stages[s][q]) - 1 for q, w in enumerate(waiting)):
                    continue  # the allreduce: every replica of the stage at it
                for q in range(reps[s]):
                    nxt[s, q] += 1
                order.append(("AR", s, -1))
                moved = True
                continue
            k = op.microbatch
            assert k % reps[s] == j, (s, j, op)
            if op.kind == "F" and s > 0:
                box = channel("act", s - 1, k % reps[s - 1], j)
                if not box:
                    continue
                assert box[0] == k, f"stage {s} replica {j} receives activation {box[0]} expecting {k}"
                box.popleft()
            if op.kind == "B" and s < p - 1:
                box = channel("grad", s + 1, k % reps[s + 1], j)
                if not box:
                    continue
                assert box[0] == k, f"stage {s} replica {j} receives gradient {box[0]} expecting {k}"
                box.popleft()
            if op.kind == "F" and s < p - 1:
                channel("act", s, j, k % reps[s + 1]).append(k)
            if op.kind == "B" and s > 0:
                channel("grad", s, j, k % reps[s - 1]).append(k)
            order.append((op.kind, s, k))
            nxt[s, j] += 1
            moved = True
        if all(i == len(plan.stages[s][j]) for (s, j), i in nxt.items()):
            return order
        if not moved:
            raise AssertionError(f"deadlock: ranks wait at {nxt}")


def test_the_message_checker_finds_a_deadlock_and_an_out_of_order_receive() -> None:
    """A test of the test: a replica of stage 0 that alternates (1F1B) under a GPipe stage 1
    waits for a gradient that waits for its next forward; one that takes its microbatches
    out of order meets the wrong message."""
    good = replicated("gpipe", 4, [2, 1])
    alternating = (Op("F", 0), Op("B", 0), Op("F", 2), Op("B", 2), EXCHANGE)
    stuck = ReplicatedSchedule("x", 4, (2, 1), ((alternating, good.stages[0][1]), good.stages[1]))
    with pytest.raises(AssertionError, match="deadlock"):
        _run_with_messages(stuck)
    swapped = (Op("F", 2), Op("F", 0), Op("B", 2), Op("B", 0), EXCHANGE)
    crossed = ReplicatedSchedule("x", 4, (2, 1), ((swapped, good.stages[0][1]), good.stages[1]))
    with pytest.raises(AssertionError, match="stage 1 replica 0 receives activation 2 expecting 0"):
        _run_with_messages(crossed)


def _replications(p_max: int, r_max: int) -> list[tuple[int, ...]]:
    return [r for p in range(1, p_max + 1) for r in itertools.product(range(1, r_max + 1), repeat=p)]


@pytest.mark.parametrize("replicas", _replications(3, 3) + [(1, 4, 2, 1), (4, 1, 1, 2), (2, 3, 3, 2)])
def test_every_replicated_schedule_runs_with_blocking_receives_and_keeps_each_microbatch_in_order(
    replicas: tuple[int, ...],
) -> None:
    """Deadlock-free with receives matched in send order; F k on s before F k on s + 1, B k on
    s + 1 before B k on s; every microbatch once per stage on replica k mod r_s; one exchange
    per replicated stage, last; the simulator agrees that nothing deadlocks."""
    p, whole = len(replicas), math.lcm(*replicas)
    for name, m in itertools.product(("gpipe", "1f1b"), (whole, 2 * whole, 3 * whole)):
        plan = replicated(name, m, replicas)
        when = {op: i for i, op in enumerate(_run_with_messages(plan))}
        for s in range(p):
            done = sorted((op.kind, op.microbatch) for ops in plan.stages[s] for op in ops if op.kind != "AR")
            assert done == sorted((kind, k) for kind in "FB" for k in range(m))
            for k in range(m):
                assert when["F", s, k] < when["B", s, k]
                if s < p - 1:
                    assert when["F", s, k] < when["F", s + 1, k] and when["B", s + 1, k] < when["B", s, k]
            assert [ops[-1] == EXCHANGE for ops in plan.stages[s]] == [replicas[s] > 1] * replicas[s]
            for j, ops in enumerate(plan.stages[s]):
                assert all(plan.replica(s, op.microbatch) == j for op in ops if op.kind != "AR")
        simulate(plan, [1.0] * p, [2.0] * p, 0.1, exchange=[0.5] * p)


@pytest.mark.parametrize("replicas", _replications(4, 3))
def test_a_replica_holds_what_the_windows_say(replicas: tuple[int, ...]) -> None:
    """1F1B: at most min(h_s, m / r_s) per replica, h_{p-1} = 1, h_s = 1 + ceil(h_{s+1} r_{s+1} / r_s);
    GPipe: all m / r_s."""
    h, p, whole = replica_windows(replicas), len(replicas), math.lcm(*replicas)
    assert h[-1] == 1 and all(h[s] == 1 + -(-h[s + 1] * replicas[s + 1] // replicas[s]) for s in range(p - 1))
    for m in (whole, 4 * whole):
        held = replicated("1f1b", m, replicas).in_flight()
        assert held == [[min(h[s], m // r)] * r for s, r in enumerate(replicas)]
        assert replicated("gpipe", m, replicas).in_flight() == [[m // r] * r for r in replicas]
    assert replica_windows([1, 4, 2, 1]) == [9, 2, 2, 1]


def test_a_heavy_stage_on_two_replicas_keeps_the_balanced_pace() -> None:
    """Two stages, the first twice as heavy (forward 2, backward 4 against 1, 2) on 2 replicas.
    By hand (GPipe, m = 4): stage 0's replicas run F0 | F1 over [0, 2] and F2 | F3 over [2, 4];
    stage 1 runs F0..F3 over [2, 6], then B3..B0 over [6, 14]; the replicas' last backwards,
    B0 on replica 0, end at 14 + 4 = 18 = (m + 2) 3. The balanced unreplicated pipeline takes
    (m + 1) 3: each further microbatch costs the same 3, the heavy stage's latency one 3 more;
    unreplicated, the heavy stage sets the pace: 6 a microbatch."""
    for name in ("gpipe", "1f1b"):
        for m in (2, 4, 8, 16):
            plan = replicated(name, m, [2, 1])
            timeline = simulate(plan, [2.0, 1.0], [4.0, 2.0])
            balanced = simulate(schedule(name, 2, m), [1.0, 1.0], [2.0, 2.0])
            assert timeline.makespan == (m + 2) * 3.0 == balanced.makespan + 3.0
            alone = simulate(schedule(name, 2, m), [2.0, 1.0], [4.0, 2.0]).makespan
            assert alone == (m - 1) * 6.0 + (9.0 if name == "gpipe" else 7.0)  # 1F1B: B0 overlaps F1
            assert [timeline.busy(0, 0), timeline.busy(0, 1), timeline.busy(1)] == [m / 2 * 6.0] * 3
            # transfers of 0.5 on the first forward and the last gradient; the exchange after all
            late = simulate(plan, [2.0, 1.0], [4.0, 2.0], 0.5, exchange=[0.25, 0.0])
            assert late.makespan == (m + 2) * 3.0 + 0.5 + 0.5 + 0.25
            assert [late.end[0][j][-1] for j in (0, 1)] == [late.makespan] * 2
            assert late.bubble(0, 1) == pytest.approx(1 - m / 2 * 6.0 / late.makespan, rel=1e-12)


def test_a_replicated_stage_adds_the_pace_of_the_slowest_stage_per_microbatch() -> None:
    """With any costs, each further microbatch adds max_s (forward_s + backward_s) / r_s to the
    step, under GPipe and 1F1B alike: the replicas share the stage's load."""
    rng = np.random.default_rng(1)
    for replicas in _replications(3, 4):
        p, whole = len(replicas), math.lcm(*replicas)
        forward = rng.integers(1, 7, p).astype(float).tolist()
        backward = [2 * f for f in forward]
        pace = max((f + b) / r for f, b, r in zip(forward, backward, replicas))
        for name in ("gpipe", "1f1b"):
            short, long = (simulate(replicated(name, m, replicas), forward, backward).makespan
                           for m in (6 * whole, 12 * whole))  # fmt: skip
            assert long - short == pytest.approx(6 * whole * pace, rel=1e-12), (name, replicas, forward)


def test_simulate_of_replicas_refuses_costs_that_do_not_fit_and_names_a_stuck_replica() -> None:
    plan = replicated("gpipe", 4, [2, 1])
    with pytest.raises(ValueError, match="exchange costs for 1 stages, the schedule has 2"):
        simulate(plan, [1.0, 1.0], [1.0, 1.0], exchange=[1.0])
    with pytest.raises(ValueError, match="costs for 3/3 stages, the schedule has 2"):
        simulate(plan, [1.0] * 3, [1.0] * 3)
    alternating = (Op("F", 0), Op("B", 0), Op("F", 2), Op("B", 2), EXCHANGE)
    stuck = ReplicatedSchedule("x", 4, (2, 1), ((alternating, plan.stages[0][1]), plan.stages[1]))
    with pytest.raises(
        ValueError, match=r"deadlocks: stages wait at \{\(0, 0\): 'B0', \(0, 1\): 'B3', \(1, 0\): 'F2'\}"
    ):
        simulate(stuck, [1.0, 1.0], [1.0, 1.0])


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
