"""The report's Gantt chart (gantt.png, from trace/).

Run files are written with ``RunFile`` with known events; one is a pipeline
run in the simulator with a cost table, whose bars must follow the 1F1B schedule and
last what the table says.
"""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest
from report_figures import written_plots

from hpcdl.errors import ConfigError
from hpcdl.report import load, main, stage_stats
from hpcdl.report.gantt import Bar, timeline
from hpcdl.store import RunFile

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MS = 1e-3

#: rank 0's step ends (metrics/time), s: step 1 ends at 10 ms, step 2 at 20 ms, step 3 at 30 ms
STEP_ENDS = [0.010, 0.020, 0.030]
#: (rank, kind, start s, end s, microbatch): two stages, two microbatches a step, three steps
EVENTS = [
    (0, "forward", 0.0005, 0.0025, 0),  # step 1
    (1, "recv", 0.0004, 0.0026, 0),
    (1, "forward", 0.0026, 0.0046, 0),
    (1, "backward", 0.0046, 0.0086, 0),
    (0, "backward", 0.0088, 0.0098, 0),
    (0, "forward", 0.0105, 0.0125, 0),  # step 2
    (0, "send", 0.0125, 0.0127, 0),
    (0, "forward", 0.0125, 0.0145, 1),
    (1, "recv", 0.0103, 0.0126, 0),
    (1, "forward", 0.0126, 0.0146, 0),
    (1, "backward", 0.0146, 0.0186, 0),
    (0, "backward", 0.0188, 0.0190, 0),  # 0.2 ms: too narrow for its label
    (0, "forward", 0.0205, 0.0225, 0),  # step 3
    (1, "forward", 0.0227, 0.0247, 0),
    (1, "backward", 0.0247, 0.0287, 0),
    (0, "backward", 0.0289, 0.0299, 0),
]
FIELDS = ("rank", "kind", "start", "end", "microbatch")


def _placement(ranks: int, m: int) -> str:
    places = [{"role": f"stage {s}", "holds": f"stage {s}", "member": 0} for s in range(ranks)]
    return json.dumps({"strategy": "pipeline", "batch_size": 8, "micro_steps": m, "ranks": places})


def _write(path: Path, events: list[tuple], *, ranks: int = 2, m: int = 2) -> Path:
    """A finished pipeline run of three steps with ``events`` in ``trace/``."""
    attrs = {"name": path.stem, "world": "sim", "ranks": ranks, "strategy": "pipeline",
             "placement": _placement(ranks, m)}  # fmt: skip
    with RunFile.create(path, attrs, ranks=ranks) as run:
        run.append_metrics([{"step": k + 1, "time": t, "loss": 1.0 / (k + 1), "step_time": 0.009}
                            for k, t in enumerate(STEP_ENDS)])  # fmt: skip
        run.append_ranks({s: np.full((3, ranks), 1e-3) for s in run.h5["ranks"]})
        if events:
            run.append_trace({name: [e[i] for e in events] for i, name in enumerate(FIELDS)})
        run.set_attrs(status="finished")
    return path


def _bars(events: list[tuple], origin: float) -> list[tuple]:
    """The bars ``events`` should give: (rank, start ms from ``origin``, duration ms, kind, microbatch)."""
    rows = [(r, (s - origin) / MS, (e - s) / MS, k, mb) for r, k, s, e, mb in events]
    return sorted(rows, key=lambda b: (b[0], b[1]))


def _astuples(bars: list[Bar]) -> list[tuple]:
    return [(b.rank, b.start, b.duration, b.kind, b.microbatch) for b in bars]


def _assert_bars(got: list[Bar], want: list[tuple]) -> None:
    got_t = _astuples(got)
    assert [(g[0], g[3], g[4]) for g in got_t] == [(w[0], w[3], w[4]) for w in want]
    np.testing.assert_allclose([g[1:3] for g in got_t], [w[1:3] for w in want], rtol=0, atol=1e-9)


def _trace(events: list[tuple]) -> dict[str, np.ndarray]:
    return {name: np.array([e[i] for e in events]) for i, name in enumerate(FIELDS)}


METRICS = {"step": np.array([1, 2, 3]), "time": np.array(STEP_ENDS)}


# -- the bars, as data ---------------------------------------------------------------------------


def test_the_last_two_steps_are_every_event_after_rank_0_ended_the_step_before() -> None:
    tl = timeline(_trace(EVENTS), METRICS)  # default: the last 2 steps
    assert tl is not None and (tl.first_step, tl.last_step) == (2, 3)
    window = [e for e in EVENTS if e[2] >= STEP_ENDS[0]]
    assert len(window) == 11
    origin = min(e[2] for e in window)  # rank 1's recv of step 2, at 10.3 ms
    assert tl.origin == pytest.approx(origin)
    _assert_bars(tl.bars, _bars(window, origin))
    assert tl.bars[0] == Bar(0, pytest.approx(0.2), pytest.approx(2.0), "forward", 0)
    assert [s for s, _ in tl.step_ends] == [2, 3]
    np.testing.assert_allclose([t for _, t in tl.step_ends], [9.7, 19.7], atol=1e-9)
    assert tl.ranks == 2 and tl.end == pytest.approx(19.7)


@pytest.mark.parametrize(("steps", "first", "count"), [(1, 3, 4), (3, 1, 16), (9, 1, 16), (0, 1, 16)])
def test_the_window_holds_the_steps_asked_for(steps: int, first: int, count: int) -> None:
    tl = timeline(_trace(EVENTS), METRICS, steps)
    assert tl is not None and (tl.first_step, tl.last_step) == (first, 3)
    window = EVENTS[-count:] if count < len(EVENTS) else EVENTS
    assert len(tl.bars) == count
    _assert_bars(tl.bars, _bars(window, min(e[2] for e in window)))
    assert [s for s, _ in tl.step_ends] == list(range(first, 4))


def test_without_step_times_every_event_is_drawn_and_without_events_nothing() -> None:
    tl = timeline(_trace(EVENTS), {})
    assert tl is not None and tl.first_step is None and len(tl.bars) == len(EVENTS) and tl.step_ends == []
    assert timeline(_trace([]), METRICS) is None
    assert timeline({}, METRICS) is None
    late = [(0, "forward", 0.001, 0.002, 0)]  # only before the window: none in it
    assert timeline(_trace(late), METRICS, 1) is None
    with pytest.raises(ValueError, match="-1 < 0"):
        timeline(_trace(EVENTS), METRICS, -1)


def test_an_event_that_ends_before_it_starts_lasts_nothing_and_kinds_may_be_bytes() -> None:
    trace = _trace([(0, "wait", 0.0120, 0.0110, -1)])
    trace["kind"] = np.array([b"wait"], dtype=object)  # as h5py reads a string column
    tl = timeline(trace, METRICS)
    assert tl is not None and _astuples(tl.bars) == [(0, 0.0, 0.0, "wait", -1)]


def test_bar_labels_name_the_microbatch_of_what_occupies_the_rank() -> None:
    assert Bar(0, 0, 1, "forward", 3).text == "F3"
    assert Bar(0, 0, 1, "backward", 0).text == "B0"
    assert Bar(0, 0, 1, "pack", 2).text == "2"  # sync: the bucket
    assert Bar(0, 0, 1, "send", 2).text == "" and Bar(0, 0, 1, "recv", 2).text == ""  # not the row's work
    assert Bar(0, 0, 1, "unpack", -1).text == "" and Bar(0, 0, 1, "wait", -1).text == ""


# -- the figures -----------------------------------------------------------------------------


def test_the_report_draws_the_gantt_chart_of_the_last_steps(tmp_path: Path, figures, capsys) -> None:
    run = _write(tmp_path / "pipe.h5", EVENTS)
    assert main([str(run), "--out", f"{tmp_path}/p/"]) == 0
    assert "pipe-gantt.png" in written_plots(capsys.readouterr().out)
    png = (tmp_path / "p" / "pipe-gantt.png").read_bytes()
    assert png[:8] == PNG_MAGIC and len(png) > 10_000
    (ax,) = figures["gantt"].axes
    assert len(ax.patches) == 11  # a bar per event of steps 2 and 3
    widths = sorted(round(p.get_width(), 6) for p in ax.patches)
    want = sorted(round((e - s) / MS, 6) for _, _, s, e, _ in EVENTS[5:])
    assert widths == want
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0 (stage 0)", "rank 1 (stage 1)"]
    assert ax.get_ylim()[0] > ax.get_ylim()[1]  # rank 0 on top
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["forward", "backward", "recv (waiting for data)", "send (posted to complete)"]
    labels = sorted(t.get_text() for t in ax.texts if not t.get_text().startswith("step"))
    assert labels == ["B0", "B0", "B0", "F0", "F0", "F0", "F0", "F1"]  # all but rank 0's 0.2 ms B0
    assert sorted(t.get_text() for t in ax.texts if t.get_text().startswith("step")) == [
        "step 2 ends ", "step 3 ends "]  # fmt: skip
    assert "steps 2-3" in ax.get_title() and ax.get_xlabel().startswith("time (ms)")


def test_gantt_steps_chooses_the_window(tmp_path: Path, figures, capsys) -> None:
    run = _write(tmp_path / "pipe.h5", EVENTS)
    assert main([str(run), "--out", f"{tmp_path}/p/", "--gantt-steps", "1"]) == 0
    (ax,) = figures["gantt"].axes
    assert len(ax.patches) == 4 and "step 3" in ax.get_title()
    assert main([str(run), "--out", f"{tmp_path}/p/", "--gantt-steps", "0"]) == 0
    (ax,) = figures["gantt"].axes
    assert len(ax.patches) == len(EVENTS) and "steps 1-3" in ax.get_title()
    for bad in ("-1", "two"):
        with pytest.raises(ConfigError, match="--gantt-steps"):
            main([str(run), "--gantt-steps", bad])


@pytest.mark.parametrize("how", ["no events", "no trace group"])
def test_a_run_without_trace_events_has_no_gantt_chart(tmp_path: Path, capsys, how: str) -> None:
    run = _write(tmp_path / "plain.h5", [])
    if how == "no trace group":  # a file written before trace/ existed
        with h5py.File(run, "r+") as h5:
            del h5["trace"]
    assert load(run).trace == {} or len(load(run).trace["start"]) == 0
    traced = _write(tmp_path / "traced.h5", EVENTS)
    assert main([str(run), "--out", f"{tmp_path}/p/"]) == 0
    written = written_plots(capsys.readouterr().out)
    assert written == ["plain-loss.png", "plain-ranks.png"]  # absent plots are not listed (nor written)
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == written
    assert main([str(run), str(traced), "--out", f"{tmp_path}/q/"]) == 0  # beside a traced run: its panel
    assert "plain+traced-gantt.png" in written_plots(capsys.readouterr().out)


def test_several_runs_get_a_panel_each(tmp_path: Path, figures, capsys) -> None:
    a = _write(tmp_path / "a.h5", EVENTS)
    b = _write(tmp_path / "b.h5", [(r, k, s, e, mb) for r, k, s, e, mb in EVENTS if r == 0])
    assert main([str(a), str(b), "--out", f"{tmp_path}/p/"]) == 0
    top, bottom = figures["gantt"].axes
    assert top.get_title().startswith("a:") and bottom.get_title().startswith("b:")
    assert (len(top.patches), len(bottom.patches)) == (11, 6)


def test_a_traced_sync_run_draws_pack_wait_and_unpack(tmp_path: Path, figures, capsys) -> None:
    events = [(r, "pack", 0.0101 + 1e-3 * b, 0.0104 + 1e-3 * b, b) for r in (0, 1) for b in range(3)]
    events += [(r, "wait", 0.0130, 0.0150, -1) for r in (0, 1)]
    events += [(r, "unpack", 0.0150, 0.0160, -1) for r in (0, 1)]
    run = _write(tmp_path / "sync.h5", events)  # in step 2
    assert main([str(run), "--out", f"{tmp_path}/p/"]) == 0
    (ax,) = figures["gantt"].axes
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "pack (bucket k)", "wait (for the exchange)", "unpack"]  # fmt: skip
    assert len(ax.patches) == len(events)
    heights = {round(p.get_height(), 3) for p in ax.patches}
    assert len(heights) == 2  # waiting is thinner than work


def test_at_scale_every_bar_fills_its_row(tmp_path: Path, figures, capsys) -> None:
    """100 ranks: rows of a few pixels, where a thin bar would alias; no labels, ticks not one per rank."""
    ranks = 100
    events = [(r, kind, 0.0105 + 1e-3 * i, 0.0115 + 1e-3 * i, 0) for r in range(ranks)
              for i, kind in enumerate(("send", "forward", "recv"))]  # fmt: skip
    assert main([str(_write(tmp_path / "wide.h5", events, ranks=ranks)), "--out", f"{tmp_path}/p/"]) == 0
    (ax,) = figures["gantt"].axes
    assert len(ax.patches) == 3 * ranks and {round(p.get_height(), 6) for p in ax.patches} == {1.0}
    assert not [t for t in ax.texts if t.get_text() == "F0"]
    figures["gantt"].canvas.draw()
    assert 2 <= len([t for t in ax.get_yticklabels() if t.get_text()]) <= 13
    assert ax.get_ylabel() == "rank"


# -- a real pipeline run ----------------------------------------------------------------------


def test_a_simulated_1f1b_run_draws_each_stage_in_schedule_order_for_the_tabled_time(
    tmp_path: Path, figures, capsys
) -> None:
    """3 stages, 1F1B, m = 4 in the simulator, every layer costing 1 ms forward and 2 ms backward:
    the last step's bars on each rank are its schedule's operations, each as long as its layers."""
    from hpcdl.comm import world
    from hpcdl.config import load_config
    from hpcdl.driver.run import train
    from hpcdl.parallel.pipe_plan import schedule
    from hpcdl.sim.compute import make_compute
    from hpcdl.sim.engine import simulate
    from hpcdl.sim.network import load_network

    layers = 16  # digits-mlp of depth 8: Flatten, then 8 Linear with a ReLU between each
    table = tmp_path / "costs.toml"
    table.write_text("".join(f'[[layers]]\nlayer = "{i}"\nforward_s = 1e-3\nbackward_s = 2e-3\n'
                             for i in range(layers)))  # fmt: skip
    sets = ["model.depth=8", "model.width=32", "data.batch_size=8", "checkpoint.every=0", "train.steps=3",
            "parallel.strategy=pipeline", "pipeline.schedule=1f1b", "pipeline.microbatches=4",
            "pipeline.balance=[6, 5, 5]", "log.trace=true"]  # fmt: skip
    cfg = load_config("digits-mlp", sets)
    out = tmp_path / "pipe.h5"
    simulate(3, lambda: train(cfg, world(), out=out), network=load_network("eth10g", 3),
             compute=make_compute(f"table:{table}"))  # fmt: skip
    run = load(out)
    tl = timeline(run.trace, run.metrics, steps=1)
    assert tl is not None and (tl.first_step, tl.last_step) == (3, 3) and tl.ranks == 3
    plan = schedule("1f1b", 3, 4)
    for s, n_layers in enumerate([6, 5, 5]):
        ops = [b for b in tl.bars if b.rank == s and b.kind in ("forward", "backward")]
        assert [f"{b.kind[0].upper()}{b.microbatch}" for b in ops] == [str(op) for op in plan.stages[s]]
        for b in ops:
            assert b.duration == pytest.approx(n_layers * (1.0 if b.kind == "forward" else 2.0), rel=1e-6)
        assert all(b.start >= 0 for b in tl.bars)
    assert main([str(out), "--out", f"{tmp_path}/p/", "--gantt-steps", "1"]) == 0
    (ax,) = figures["gantt"].axes
    labels = {t.get_text() for t in ax.texts}
    assert {f"{k}{m}" for k in "FB" for m in range(4)} <= labels  # 5 ms bars at one step's width: labelled
    st = stage_stats(run)  # the report reads the same run's stages
    assert st is not None and st.in_flight.tolist() == plan.in_flight() and np.isfinite(st.bubble).all()
