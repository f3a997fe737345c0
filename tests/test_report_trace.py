"""``python -m hpcdl.report RUN.h5 --trace OUT.json``: the timeline as Chrome trace JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

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


def test_a_run_without_events_gets_its_plots_and_one_line_for_the_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _run(tmp_path / "plain.h5", [])
    out = tmp_path / "timeline.json"
    assert main([str(run), "--trace", str(out), "--out", f"{tmp_path}/plots/"]) == 0
    assert not out.exists()
    printed = capsys.readouterr().out
    assert [line for line in printed.splitlines() if "trace" in line] == [
        f"{out}: not written: the runs have no trace/ events (recorded with log.trace = true)"
    ]
    assert printed.startswith("run ")  # the table and the PNGs as usual
    assert [Path(line).name for line in printed.splitlines() if line.endswith(".png")] == ["plain-loss.png"]
    assert (tmp_path / "plots" / "plain-loss.png").exists()


def test_a_traced_sync_run_records_each_buckets_pack_and_the_wait(tmp_path: Path) -> None:
    """log.trace = true on 2 virtual ranks: per rank and step, a pack per bucket, one wait, one
    unpack, in run time, ordered, inside the run; the export opens them. Off by default."""
    from hpcdl.comm import world
    from hpcdl.config import load_config
    from hpcdl.driver.run import train
    from hpcdl.sim.compute import make_compute
    from hpcdl.sim.engine import simulate
    from hpcdl.sim.network import load_network

    sets = ["train.steps=6", "log.flush_every=2", "exchange.bucket_mb=0.02", "checkpoint.every=0"]
    out, plain = tmp_path / "traced.h5", tmp_path / "plain.h5"
    for path, extra in ((out, ["log.trace=true"]), (plain, [])):
        cfg = load_config("digits-mlp", [*sets, *extra])
        run = lambda cfg=cfg, path=path: train(cfg, world(), out=path)  # noqa: E731
        simulate(2, run, network=load_network("eth10g", 2), compute=make_compute("measured"))
    import h5py

    with h5py.File(out) as f:
        rank, start, end = f["trace/rank"][...], f["trace/start"][...], f["trace/end"][...]
        kind = [k.decode() if isinstance(k, bytes) else k for k in f["trace/kind"][...]]
        bucket = f["trace/microbatch"][...]
        last = float(f["metrics/time"][-1])
    buckets = 1 + max(int(b) for b, k in zip(bucket, kind) if k == "pack")
    assert buckets >= 2  # 0.02 MiB buckets of digits-mlp's 85,002 parameters
    for r in (0, 1):
        mine = [k for k, rr in zip(kind, rank) if rr == r]
        assert mine.count("pack") == 6 * buckets and mine.count("wait") == 6 and mine.count("unpack") == 6
        times = [(s, e) for s, e, rr in zip(start, end, rank) if rr == r]
        assert all(0 <= s <= e <= last + 1e-9 for s, e in times)
        assert [s for s, _ in times] == sorted(s for s, _ in times)
    assert (
        len(chrome_trace([out])["traceEvents"]) == 2 + 2 * 6 * (buckets + 2) + 1
    )  # + names of 2 tracks, 1 process
    with h5py.File(plain) as f:
        assert f["trace/rank"].shape == (0,)
