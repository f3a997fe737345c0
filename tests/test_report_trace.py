"""``python -m hpcdl.report RUN.h5 --trace OUT.json``: the timeline as Chrome trace JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpcdl.errors import ConfigError
from hpcdl.report import main
from hpcdl.report.trace import chrome_trace
from hpcdl.store import RunFile

#: (rank, kind, start s, end s, microbatch): two stages' forwards and a send, an exchange's allreduce
EVENTS = [
    (0, "forward", 0.001, 0.003, 0),
    (0, "send", 0.003, 0.0032, 0),
    (1, "forward", 0.0032, 0.005, 0),
    (0, "forward", 0.003, 0.005, 1),
    (1, "allreduce", 0.010, 0.012, -1),
]


def _run(path: Path, events: list[tuple[int, str, float, float, int]]) -> Path:
    with RunFile.create(path, {"name": path.stem, "world": "sim", "ranks": 2}, ranks=2) as run:
        run.append_metrics([{"step": 1, "time": 0.02, "loss": 1.0}])
        if events:
            columns = ("rank", "kind", "start", "end", "microbatch")
            run.append_trace({name: [e[i] for e in events] for i, name in enumerate(columns)})
        run.set_attrs(status="finished")
    return path


def test_the_trace_is_chrome_trace_event_format(tmp_path: Path) -> None:
    """Complete events in microseconds on one track per rank, named processes and tracks."""
    trace = chrome_trace([_run(tmp_path / "pipe.h5", EVENTS)])
    assert set(trace) == {"traceEvents", "displayTimeUnit"}
    events = trace["traceEvents"]
    meta = [e for e in events if e["ph"] == "M"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {(e["name"], e["tid"], e["args"]["name"]) for e in meta} == {
        ("process_name", 0, "pipe"), ("thread_name", 0, "rank 0"), ("thread_name", 1, "rank 1")}  # fmt: skip
    assert len(spans) == len(EVENTS)
    for e in spans:  # the keys and types the format requires of a complete event
        assert isinstance(e["name"], str) and isinstance(e["cat"], str) and e["pid"] == 0
        assert isinstance(e["tid"], int) and isinstance(e["ts"], float) and e["dur"] >= 0
    by_key = {(e["tid"], e["name"]): e for e in spans}
    assert by_key[(0, "forward 1")]["ts"] == pytest.approx(3000.0) and by_key[(0, "forward 1")][
        "dur"
    ] == pytest.approx(2000.0)
    assert by_key[(1, "allreduce")]["args"] == {"microbatch": -1}  # no microbatch: the kind alone
    assert [e["ts"] for e in spans if e["tid"] == 0] == sorted(e["ts"] for e in spans if e["tid"] == 0)


def test_report_writes_the_trace_beside_the_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _run(tmp_path / "pipe.h5", EVENTS)
    other = _run(tmp_path / "other.h5", EVENTS[:2])
    out = tmp_path / "timeline.json"
    assert main([str(run), str(other), "--trace", str(out), "--out", f"{tmp_path}/plots/"]) == 0
    trace = json.loads(out.read_text())
    assert {e["pid"] for e in trace["traceEvents"]} == {0, 1}  # a process per run file
    assert f"{out}: 7 trace events" in capsys.readouterr().out


def test_a_run_without_events_writes_nothing(tmp_path: Path) -> None:
    run = _run(tmp_path / "plain.h5", [])
    out = tmp_path / "timeline.json"
    with pytest.raises(ConfigError, match="no trace/ events to write .* nothing was written"):
        main([str(run), "--trace", str(out), "--out", f"{tmp_path}/plots/"])
    assert not out.exists()
