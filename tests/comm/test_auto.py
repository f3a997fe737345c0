"""``auto``'s table: choosing, the fallback, JSON, loading errors, and segments from benchmark rows."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hpcdl.comm.collectives import ALGORITHMS, AutoTable
from hpcdl.comm.collectives.auto import (
    DEFAULT_THRESHOLD_BYTES,
    FALLBACK,
    Segment,
    format_segments,
    load_table,
    merge,
    ordinary_segments,
    save_table,
    table_from_rows,
    winners,
)
from hpcdl.errors import ConfigError, FileError

KB = 1024
#: two rank counts measured, with different segments
TABLE = AutoTable(
    {
        2: ((64 * KB, "mpi"), (4096 * KB, "doubling"), (None, "ring")),
        8: ((16 * KB, "mpi"), (None, "rabenseifner")),
    },
    meta={2: {"date": "2026-11-22", "sizes": [4096, 65536]}},
)


# -- choose ------------------------------------------------------------------------------


def test_choose_at_the_boundaries() -> None:
    assert TABLE.choose(0, 2) == "mpi"
    assert TABLE.choose(64 * KB - 1, 2) == "mpi"
    assert TABLE.choose(64 * KB, 2) == "doubling"  # bounds are exclusive
    assert TABLE.choose(4096 * KB - 1, 2) == "doubling"
    assert TABLE.choose(4096 * KB, 2) == "ring"
    assert TABLE.choose(1 << 40, 2) == "ring"
    assert TABLE.choose(16 * KB - 1, 8) == "mpi" and TABLE.choose(16 * KB, 8) == "rabenseifner"


def test_nearest_measured_rank_count_ties_to_the_smaller() -> None:
    assert TABLE.choose(100 * KB, 3) == "doubling"  # 2 is nearest
    assert TABLE.choose(100 * KB, 5) == "doubling"  # 2 and 8 are 3 away: the smaller
    assert TABLE.choose(100 * KB, 6) == "rabenseifner"
    assert TABLE.choose(100 * KB, 1024) == "rabenseifner"
    assert TABLE.segments_for(5) == TABLE.segments[2]


def test_one_rank_and_an_empty_table_take_the_fallback() -> None:
    assert TABLE.segments_for(1) == FALLBACK == ((DEFAULT_THRESHOLD_BYTES, "mpi"), (None, "ring"))
    for table, ranks in ((TABLE, 1), (AutoTable(), 2), (AutoTable(), 64)):
        assert table.choose(DEFAULT_THRESHOLD_BYTES - 1, ranks) == "mpi"
        assert table.choose(DEFAULT_THRESHOLD_BYTES, ranks) == "ring"


def test_threshold_override_applies_at_every_rank_count() -> None:
    table = AutoTable.threshold(4000)
    for ranks in (1, 2, 3, 512):
        assert table.choose(3999, ranks) == "mpi" and table.choose(4000, ranks) == "ring"
    assert AutoTable.threshold(0).choose(0, 4) == "ring"
    assert "4000" in table.note
    with pytest.raises(ConfigError, match="at least 0"):
        AutoTable.threshold(-1)


def test_table_is_immutable_and_merge_makes_a_new_one() -> None:
    with pytest.raises(TypeError):
        TABLE.segments[3] = ((None, "ring"),)  # type: ignore[index]
    with pytest.raises(AttributeError):
        TABLE.note = "changed"  # type: ignore[misc]
    new = merge(TABLE, 2, [(None, "mpi")], {"date": "today"})
    assert new.choose(1 << 30, 2) == "mpi" and new.segments[8] == TABLE.segments[8]
    assert new.meta[2] == {"date": "today"} and TABLE.choose(1 << 30, 2) == "ring"
    assert merge(AutoTable(), 3, [(None, "doubling")], {}).choose(1, 3) == "doubling"
    assert format_segments(TABLE.segments[2]) == "mpi < 64K <= doubling < 4M <= ring"


@pytest.mark.parametrize(
    ("segments", "match"),
    [
        ((), "no segments"),
        (((None, "tree"),), "unknown algorithm 'tree'"),
        (((100, "mpi"), (100, "ring"), (None, "mpi")), "increasing"),
        (((200, "mpi"), (100, "ring"), (None, "mpi")), "increasing"),
        (((0, "mpi"), (None, "ring")), "increasing"),
        (((100, "mpi"), (200, "ring")), "last segment must have no bound"),
        (((None, "mpi"), (None, "ring")), "increasing"),
    ],
)
def test_invalid_segments(segments: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        AutoTable({2: segments})


# -- JSON --------------------------------------------------------------------------------


def test_json_round_trip() -> None:
    text = json.dumps(TABLE.to_dict())
    back = AutoTable.from_dict(json.loads(text))
    assert back == TABLE and back.meta[2]["sizes"] == (4096, 65536)
    assert json.loads(text)["ranks"]["2"]["segments"][0] == {"below": 65536, "algorithm": "mpi"}
    override = AutoTable.threshold(1000)
    assert AutoTable.from_dict(json.loads(json.dumps(override.to_dict()))) == override


def test_save_then_load(tmp_path: Path) -> None:
    path = tmp_path / "table.json"
    save_table(TABLE, path)
    assert load_table(path) == TABLE == load_table(str(path))
    assert [p.name for p in tmp_path.iterdir()] == ["table.json"]  # no temporary left
    with pytest.raises(FileError, match="cannot write the auto table"):
        save_table(TABLE, tmp_path / "no-such-dir" / "table.json")


def test_packaged_table_loads() -> None:
    table = load_table(None)
    assert load_table("") == table
    assert table.fallback == FALLBACK
    assert {2, 3, 4} <= set(table.segments)
    for ranks in table.segments:  # the calibration's own winners are what auto chooses
        assert {"date", "mpi_library", "host", "winners"} <= set(table.meta[ranks])
        for size, winner, _ in table.meta[ranks]["winners"]:
            assert table.choose(size, ranks) == winner, (ranks, size)
    for segments in (*table.segments.values(), table.fallback):
        assert {s.algorithm for s in segments} <= set(ALGORITHMS)


def _write(tmp_path: Path, data: Any) -> Path:
    path = tmp_path / "auto.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


GOOD: dict[str, Any] = {"format": 1, "ranks": {"2": {"segments": [{"below": None, "algorithm": "ring"}]}}}


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        ("{not json", "is not valid JSON"),
        ([1, 2], "expected a JSON object"),
        ({"ranks": {}}, 'no "format" key'),
        ({**GOOD, "format": 99}, "unsupported format 99"),
        ({"format": 1, "ranks": {"two": GOOD["ranks"]["2"]}}, "keys are rank counts"),
        ({"format": 1, "ranks": {"2": {"segments": [["ring"]]}}}, "segments must be a list"),
        (
            {"format": 1, "ranks": {"2": {"segments": [{"below": None, "algorithm": "nccl"}]}}},
            "unknown algorithm 'nccl'",
        ),
        (
            {
                "format": 1,
                "ranks": {
                    "3": {
                        "segments": [
                            {"below": 4096, "algorithm": "mpi"},
                            {"below": 1024, "algorithm": "doubling"},
                            {"below": None, "algorithm": "ring"},
                        ]
                    }
                },
            },
            "3 ranks: bounds must be integers increasing",
        ),
        ({**GOOD, "fallback": [{"below": 10, "algorithm": "mpi"}]}, "fallback: the last segment"),
    ],
)
def test_load_errors_name_the_file_problem_and_fix(tmp_path: Path, data: Any, problem: str) -> None:
    path = _write(tmp_path, data)
    with pytest.raises(ConfigError) as info:
        load_table(path)
    message = str(info.value)
    assert "\n" not in message
    assert f"auto table {path}" in message and problem in message
    assert f"--calibrate --table {path}" in message


def test_load_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.json"
    with pytest.raises(ConfigError, match=r"absent\.json not found: .*--calibrate --table"):
        load_table(path)
    assert load_table(_write(tmp_path, GOOD)).choose(1, 2) == "ring"


# -- segments from benchmark rows ----------------------------------------------------------


def rows(times: dict[int, dict[str, float]], ranks: int = 2) -> list[dict[str, Any]]:
    """Benchmark rows (only the keys calibration reads) from size -> algorithm -> median seconds."""
    return [
        {"algorithm": a, "size_bytes": size, "ranks": ranks, "time_s": t}
        for size, ts in times.items()
        for a, t in ts.items()
    ]


def test_winner_changes_at_geometric_means() -> None:
    measured = {
        4096: {"mpi": 1.0, "doubling": 2.0, "ring": 3.0},
        16384: {"mpi": 1.0, "doubling": 2.0, "ring": 3.0},
        65536: {"mpi": 2.0, "doubling": 1.0, "ring": 3.0},
        262144: {"mpi": 3.0, "doubling": 2.0, "ring": 1.0},
        1048576: {"mpi": 3.0, "doubling": 2.0, "ring": 1.0},
    }
    segments = table_from_rows(rows(measured))
    assert segments == ((32768, "mpi"), (131072, "doubling"), (None, "ring"))  # sqrt(16K 64K), sqrt(64K 256K)
    assert all(isinstance(s, Segment) for s in segments)
    table = merge(AutoTable(), 2, segments, {})
    for size, ts in measured.items():  # every measured size gets its fastest
        assert table.choose(size, 2) == min(ts, key=ts.__getitem__)


def test_boundary_rounds_up_between_sizes_that_are_not_squares() -> None:
    segments = table_from_rows(rows({4096: {"mpi": 1.0, "ring": 2.0}, 8192: {"mpi": 2.0, "ring": 1.0}}))
    assert segments == ((5793, "mpi"), (None, "ring"))  # sqrt(4096 * 8192) = 5792.6
    segments = table_from_rows(rows({1: {"mpi": 1.0, "ring": 2.0}, 2: {"mpi": 2.0, "ring": 1.0}}))
    assert segments == ((2, "mpi"), (None, "ring"))  # 1 stays below, 2 is in


def test_equal_neighbours_merge_and_a_single_winner_is_one_segment() -> None:
    same = {s: {"mpi": 2.0, "ring": 1.0} for s in (4096, 8192, 16384)}
    assert table_from_rows(rows(same)) == ((None, "ring"),)
    back_and_forth = {
        4096: {"mpi": 1.0, "ring": 2.0},
        8192: {"mpi": 2.0, "ring": 1.0},
        16384: {"mpi": 1.0, "ring": 2.0},
    }
    assert table_from_rows(rows(back_and_forth)) == ((5793, "mpi"), (11586, "ring"), (None, "mpi"))


def test_previous_winner_kept_within_the_tolerance() -> None:
    measured = {
        4096: {"mpi": 1.00, "doubling": 1.50},
        8192: {"mpi": 1.02, "doubling": 1.00},  # mpi 2% slower: kept
        16384: {"mpi": 1.029, "doubling": 1.00},  # 2.9%: kept
        32768: {"mpi": 1.05, "doubling": 1.00},  # 5%: doubling takes over
        65536: {"mpi": 1.00, "doubling": 1.01},  # doubling 1% slower: kept
    }
    assert table_from_rows(rows(measured)) == ((23171, "mpi"), (None, "doubling"))
    assert [(w[0], w[1]) for w in winners(rows(measured))] == [
        (4096, "mpi"),
        (8192, "mpi"),
        (16384, "mpi"),
        (32768, "doubling"),
        (65536, "doubling"),
    ]
    assert winners(rows(measured))[1][2] == pytest.approx(1.02)
    strict = table_from_rows(rows(measured), tolerance=0.0)
    assert strict == ((5793, "mpi"), (46341, "doubling"), (None, "mpi"))


def test_rows_of_auto_are_ignored_and_bad_rows_refused() -> None:
    measured = rows({4096: {"mpi": 2.0, "ring": 1.0}})
    measured.append({"algorithm": "auto", "size_bytes": 4096, "ranks": 2, "time_s": 0.1})
    assert table_from_rows(measured) == ((None, "ring"),)
    with pytest.raises(ValueError, match="no benchmark rows"):
        table_from_rows([])
    with pytest.raises(ValueError, match=r"one rank count .*\[2, 3\]"):
        table_from_rows(rows({4096: {"mpi": 1.0}}, 2) + rows({8192: {"mpi": 1.0}}, 3))


def test_chooser_agrees_with_choose() -> None:
    sizes = [0, 1, 16 * KB - 1, 16 * KB, 64 * KB - 1, 64 * KB, 4096 * KB - 1, 4096 * KB, 1 << 40]
    for table in (TABLE, AutoTable(), AutoTable.threshold(64 * KB)):
        for ranks in (1, 2, 3, 5, 6, 8, 100):
            pick = table.chooser(ranks)
            assert [pick(n) for n in sizes] == [table.choose(n, ranks) for n in sizes]


def test_several_runs_pick_the_algorithm_never_far_from_the_best() -> None:
    """Run 0 favours ring slightly, run 1 favours doubling a lot: minimax picks doubling."""
    run0 = rows({1 << 20: {"ring": 1.0, "doubling": 1.05, "mpi": 1.3}})
    run1 = rows({1 << 20: {"ring": 1.6, "doubling": 1.0, "mpi": 2.0}})
    both = [*run0, *({**r, "run": 1} for r in run1)]
    assert winners(run0) == [(1 << 20, "ring", 1.0)]
    assert winners(both) == [(1 << 20, "doubling", pytest.approx(1.05))]
    assert winners([*run0, *run1]) == winners(run1)  # without run numbers the later rows replace


def test_an_algorithm_missing_from_a_run_is_scored_on_the_runs_that_have_it() -> None:
    run0 = rows({4096: {"mpi": 1.0, "doubling": 2.0}})
    run1 = [{**r, "run": 1} for r in rows({4096: {"doubling": 1.0, "ring": 3.0}})]
    assert winners([*run0, *run1]) == [(4096, "mpi", 1.0)]


# -- ordinary memory: where the winner is shm but the buffer is not node memory ---------------


NODE_TABLE = AutoTable(
    {2: ((64 * KB, "mpi"), (None, "shm")), 4: ((None, "shm"),)},
    ordinary={2: ((64 * KB, "mpi"), (4096 * KB, "doubling"), (None, "ring"))},
)


def test_ordinary_memory_takes_the_message_algorithms_segments() -> None:
    assert NODE_TABLE.choose(1 << 20, 2) == "shm" and NODE_TABLE.choose(1 << 20, 2, node=False) == "doubling"
    assert (
        NODE_TABLE.choose(1 << 30, 2, node=False) == "ring" and NODE_TABLE.choose(KB, 2, node=False) == "mpi"
    )
    assert NODE_TABLE.choose(1 << 30, 3, node=False) == "ring"  # 3 ranks: the nearest count, 2
    assert NODE_TABLE.chooser(2, node=False)(1 << 20) == "doubling"
    # a count without them (a table written before they were): MPI's own in shm's place
    assert NODE_TABLE.choose(1 << 30, 4) == "shm" and NODE_TABLE.choose(1 << 30, 4, node=False) == "mpi"
    assert TABLE.segments_for(2, node=False) == TABLE.segments[2]  # no node algorithm: the same


def test_ordinary_segments_round_trip_merge_and_refusals() -> None:
    back = AutoTable.from_dict(json.loads(json.dumps(NODE_TABLE.to_dict())))
    assert back == NODE_TABLE and "ordinary" not in NODE_TABLE.to_dict()["ranks"]["4"]
    kept = merge(NODE_TABLE, 4, [(None, "ring")], {})
    assert kept.ordinary[2] == NODE_TABLE.ordinary[2] and 4 not in kept.ordinary
    dropped = merge(NODE_TABLE, 2, [(None, "shm")], {}, [(None, "rabenseifner")])
    assert dropped.choose(1, 2, node=False) == "rabenseifner"
    with pytest.raises(ConfigError, match="ordinary memory: 'shm' needs node memory"):
        AutoTable({2: ((None, "shm"),)}, ordinary={2: ((None, "shm"),)})
    with pytest.raises(ConfigError, match="ordinary-memory segments for 3 ranks, which have no segments"):
        AutoTable({2: ((None, "shm"),)}, ordinary={3: ((None, "ring"),)})


def test_ordinary_segments_from_rows_leave_the_node_algorithm_out() -> None:
    times = {
        4 * KB: {"mpi": 1.0, "ring": 2.0, "shm": 3.0},
        1 << 20: {"mpi": 3.0, "ring": 2.0, "shm": 1.0},
    }
    assert table_from_rows(rows(times)) == ((Segment(2048 * 32, "mpi"), Segment(None, "shm")))
    assert ordinary_segments(rows(times)) == (Segment(2048 * 32, "mpi"), Segment(None, "ring"))
    no_node = {n: {a: t for a, t in ts.items() if a != "shm"} for n, ts in times.items()}
    assert ordinary_segments(rows(no_node)) is None
