"""Parameter-server plans: shards against literal tables, SSP's staleness bound against every interleaving."""

from __future__ import annotations

import pytest

from hpcdl.errors import ConfigError
from hpcdl.parallel.ps_plan import max_staleness, shard_plan, ssp_may_pull, staleness


@pytest.mark.parametrize(
    "elements, servers, ranges",
    [
        (10, 1, [(0, 10)]),
        (10, 3, [(0, 3), (3, 6), (6, 10)]),
        (12, 4, [(0, 3), (3, 6), (6, 9), (9, 12)]),
        (7, 7, [(k, k + 1) for k in range(7)]),
        (101_770, 3, [(0, 33_923), (33_923, 67_846), (67_846, 101_770)]),  # digits-mlp's size, say
    ],
)
def test_shards_are_contiguous_and_balanced_by_bytes(elements: int, servers: int, ranges: list) -> None:
    plan = shard_plan(elements, servers, itemsize=4)
    assert list(plan.ranges) == ranges
    sizes = [plan.nbytes(k) for k in range(plan.servers)]
    assert sum(sizes) == 4 * elements and max(sizes) - min(sizes) <= 4


def test_a_shard_plan_prints_one_line_per_server() -> None:
    assert str(shard_plan(10, 2, itemsize=8)).splitlines() == [
        "server 0: elements 0..4 (40 bytes)",
        "server 1: elements 5..9 (40 bytes)",
    ]


def test_layouts_that_do_not_fit_are_one_line() -> None:
    with pytest.raises(ConfigError, match="at least 1 server"):
        shard_plan(10, 0)
    with pytest.raises(ConfigError, match="ps.servers = 11 for a model of 10 parameters"):
        shard_plan(10, 11)


def test_the_ssp_gate() -> None:
    assert ssp_may_pull(3, [3, 2, 5], bound=1)  # the slowest is 1 behind: allowed
    assert not ssp_may_pull(3, [3, 1, 5], bound=1)  # 2 behind: wait
    assert ssp_may_pull(3, [3, 1, 5], bound=2)
    assert not ssp_may_pull(1, [1, 0], bound=0)  # s = 0: in lock step
    assert staleness(7, 4) == 3
    with pytest.raises(ValueError, match="cannot come from a pull"):
        staleness(3, 4)


def _largest_tau(workers: int, bound: int, pushes: int) -> int:
    """The largest tau over every interleaving of SSP's pulls and applies, ``pushes`` pushes per worker.

    A state is (clocks, the version each worker pulled at or -1, the server's version). A
    worker not computing may pull when the gate lets it; a computing one's push may be
    applied at any moment.
    """
    start = ((0,) * workers, (-1,) * workers, 0)
    seen, todo, best = {start}, [start], 0
    while todo:
        clocks, pulled, version = todo.pop()
        for w in range(workers):
            if pulled[w] < 0:
                if clocks[w] < pushes and ssp_may_pull(clocks[w], clocks, bound):
                    nxt = (clocks, pulled[:w] + (version,) + pulled[w + 1 :], version)
                else:
                    continue
            else:
                best = max(best, staleness(version, pulled[w]))
                nxt = (clocks[:w] + (clocks[w] + 1,) + clocks[w + 1 :], pulled[:w] + (-1,) + pulled[w + 1 :],
                       version + 1)  # fmt: skip
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return best


@pytest.mark.parametrize("workers", [1, 2, 3])
@pytest.mark.parametrize("bound", [0, 1, 2])
def test_the_largest_staleness_ssp_allows_is_reached_and_never_exceeded(workers: int, bound: int) -> None:
    """(W - 1)(2 s + 1), against an exhaustive search (enough pushes for the worst window to occur)."""
    assert _largest_tau(workers, bound, pushes=2 * bound + 3) == max_staleness(workers, bound)


def test_max_staleness_arguments() -> None:
    assert max_staleness(1024, 0) == 1023 and max_staleness(4, 3) == 21
    with pytest.raises(ValueError, match="workers >= 1 and bound >= 0"):
        max_staleness(0, 1)


def test_settings_are_read_from_the_keys_they_name() -> None:
    from hpcdl.config import load_config
    from hpcdl.parallel.ps_plan import PsSettings

    sets = ["parallel.strategy=ps", "ps.servers=2", "ps.mode=ssp", "ps.staleness=3",
            "ps.compensation=dc", "ps.dc_lambda=0.25"]  # fmt: skip
    got = PsSettings.from_config(load_config("digits-mlp", sets))
    assert got == PsSettings(servers=2, mode="ssp", staleness=3, compensation="dc", dc_lambda=0.25)
    assert set(PsSettings.KEYS) == {"servers", "mode", "staleness", "compensation", "dc_lambda"}
