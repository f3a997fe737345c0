"""The report's per pipeline stage bubble and activation memory: the lines under the table and stages.png."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from report_figures import written_plots

from hpcdl.report import format_stages, load, main, stage_stats, summarize
from hpcdl.store import RunFile

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write(
    path: Path,
    series: dict[str, np.ndarray],
    ranks: int = 3,
    m: int = 4,
    config: str = "",
    stage_of: list[int] | None = None,
) -> Path:
    """A finished pipeline run of three steps with ``series`` (steps, ranks) in ``ranks/``; rank r
    runs stage ``stage_of[r]`` (default: stage r)."""
    stage_of = stage_of or list(range(ranks))
    places = [{"role": f"stage {s}", "holds": f"stage {s}", "member": 0} for s in stage_of]
    placement = json.dumps({"strategy": "pipeline", "batch_size": 8, "micro_steps": m, "ranks": places})
    attrs = {"name": path.stem, "world": "sim", "ranks": ranks, "strategy": "pipeline"}
    attrs |= {"placement": placement, "config": config}
    with RunFile.create(path, attrs, ranks=ranks) as run:
        run.append_metrics([{"step": k, "time": 0.01 * k, "loss": 1.0 / k} for k in (1, 2, 3)])
        run.append_ranks({s: np.full((3, ranks), 1e-3) for s in run.h5["ranks"]})
        for name, data in series.items():
            run.h5["ranks"].create_dataset(name, data=data)
        run.set_attrs(status="finished")
    return path


#: per step (rows) and stage (columns): bubble fractions, activation bytes, microbatches held
BUBBLE = np.array([[0.50, 0.20, 0.40], [0.30, 0.25, np.nan], [0.40, 0.90, 0.45]])
ACTIVATIONS = np.array([[3.0, 2.0, 1.0], [3.0, 2.5, 1.0], [2.0, 2.0, 1.0]]) * 2**20
IN_FLIGHT = np.array([[3, 2, 1], [3, 2, 1], [2, 2, 1]], dtype=np.float64)


def _staged(path: Path) -> Path:
    return _write(path, {"bubble": BUBBLE, "activation_bytes": ACTIVATIONS, "in_flight": IN_FLIGHT})


def test_replicas_of_a_stage_are_named_by_rank_and_the_equal_stage_bubble_counts_stages(
    tmp_path: Path,
) -> None:
    path = _write(tmp_path / "rep.h5", {"bubble": BUBBLE}, m=4, stage_of=[0, 0, 1])
    st = stage_stats(load(path))
    assert st is not None and st.names == ["stage 0 (rank 0)", "stage 0 (rank 1)", "stage 1 (rank 2)"]
    assert st.equal_stages == pytest.approx(1 / 5)  # two stages, four microbatches


def test_each_stage_has_its_median_bubble_and_its_peak_activations(tmp_path: Path) -> None:
    st = stage_stats(load(_staged(tmp_path / "pipe.h5")))
    assert st is not None and st.names == ["stage 0", "stage 1", "stage 2"]
    np.testing.assert_allclose(st.bubble, [0.40, 0.25, 0.425])  # a NaN step is left out
    np.testing.assert_allclose(st.bubble_low, [0.30, 0.20, 0.40])
    np.testing.assert_allclose(st.bubble_high, [0.50, 0.90, 0.45])
    np.testing.assert_allclose(st.activation_bytes, [3 * 2**20, 2.5 * 2**20, 2**20])
    np.testing.assert_allclose(st.in_flight, [3, 2, 1])
    assert st.equal_stages == pytest.approx(2 / 6)  # (p - 1) / (m + p - 1), p = 3, m = 4
    row = summarize(tmp_path / "pipe.h5")
    np.testing.assert_allclose(row["stage_bubble"], st.bubble)
    np.testing.assert_allclose(row["stage_activation_bytes"], st.activation_bytes)


def test_stages_without_bubble_rows(tmp_path: Path, capsys) -> None:
    plain = _write(tmp_path / "plain.h5", {})  # a sync run, say: no ranks/bubble
    assert stage_stats(load(plain)) is None
    row = summarize(plain)
    assert row["stage_bubble"] is None and row["stage_activation_bytes"] is None
    assert format_stages([]) == ""
    assert main([str(plain), "--out", f"{tmp_path}/p/"]) == 0
    out = capsys.readouterr().out
    assert "per pipeline stage" not in out and "plain-stages.png" not in written_plots(out)


def test_the_report_prints_and_plots_the_stages(tmp_path: Path, figures, capsys) -> None:
    run = _staged(tmp_path / "pipe.h5")
    assert main([str(run), "--out", f"{tmp_path}/p/"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("run") and "bubble %" in line)
    rows = [line.split() for line in lines[header + 2 : header + 5]]
    assert rows[0][:7] == ["pipe", "stage", "0", "40.0", "(30.0-50.0)", "3.00", "3"]
    assert rows[1][:6] == ["stage", "1", "25.0", "(20.0-90.0)", "2.50", "2"]
    assert rows[2][:6] == ["stage", "2", "42.5", "(40.0-45.0)", "1.00", "1"]
    assert "(p-1)/(m+p-1) = 33.3%" in out
    assert "pipe-stages.png" in written_plots(out)
    assert (tmp_path / "p" / "pipe-stages.png").read_bytes()[:8] == PNG_MAGIC
    bub, act = figures["stages"].axes
    np.testing.assert_allclose([p.get_height() for p in bub.patches], [40.0, 25.0, 42.5])
    np.testing.assert_allclose([p.get_height() for p in act.patches], [3.0, 2.5, 1.0])
    assert [t.get_text() for t in act.texts] == ["3 held", "2 held", "1 held"]
    (equal,) = [ln for ln in bub.get_lines() if ln.get_label().startswith("equal stages")]
    assert equal.get_ydata()[0] == pytest.approx(100 / 3)  # (p - 1) / (m + p - 1), dashed


def test_interleaved_stages_are_held_to_the_bubble_of_v_chunks(tmp_path: Path) -> None:
    """pipeline.schedule = "interleaved" with v chunks per stage: equal stages idle (p-1)/(vm+p-1)."""
    config = '[parallel]\nstrategy = "pipeline"\n[pipeline]\nschedule = "interleaved"\nvirtual_stages = 2\n'
    st = stage_stats(load(_write(tmp_path / "v.h5", {"bubble": BUBBLE}, m=6, config=config)))
    assert st is not None and st.chunks == 2 and st.equal_stages == pytest.approx(2 / 14)
    assert "(p-1)/(vm+p-1), v=2 = 14.3%" in format_stages([("v", st)])
    one = config.replace('"interleaved"', '"1f1b"')  # virtual_stages is the interleaved schedule's only
    st = stage_stats(load(_write(tmp_path / "o.h5", {"bubble": BUBBLE}, m=6, config=one)))
    assert st is not None and st.chunks == 1 and st.equal_stages == pytest.approx(2 / 8)
    assert st.activation_bytes is None and st.in_flight is None  # not recorded: "-" in the table
    assert format_stages([("o", st)]).splitlines()[3].split()[-2:] == ["-", "-"]
