"""``report`` tells a killed run from a running one (host, pid and heartbeat of the writer)."""

from __future__ import annotations

import datetime
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from hpcdl.report import format_table, main, summarize
from hpcdl.store.liveness import ago, process_alive
from hpcdl.store.runfile import RunFile

NAN = float("nan")


def _iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.UTC).isoformat(timespec="seconds")


def _write(path: Path, **attrs: object) -> Path:
    """A run file of 6 steps, evaluated at step 4 (73 %), with these root attributes."""
    rows = [{"step": k, "time": 0.1 * k, "loss": 1.0 / k, "test_accuracy": 0.73 if k == 4 else NAN}
            for k in range(1, 7)]  # fmt: skip
    with RunFile.create(path, {"name": "mlp", "world": "mpi", "ranks": 2}, ranks=2) as run:
        run.append_metrics(rows)
        run.append_ranks({s: np.full((6, 2), 1e-3) for s in run.h5["ranks"]})
        for key in ("host", "pid", "pid_start", "heartbeat"):  # only what the test gives (a writer sets them)
            if key not in attrs and key in run.h5.attrs:
                del run.h5.attrs[key]
        run.set_attrs(**attrs)
    return path


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


NOW = time.time()
HERE = socket.gethostname()


def test_a_dead_writer_is_interrupted_and_its_accuracy_is_not_a_result(tmp_path: Path) -> None:
    path = _write(tmp_path / "killed.h5", status="running", host=HERE, pid=_dead_pid(),
                  heartbeat=_iso(NOW - 300))  # fmt: skip
    row = summarize(path, now=NOW)
    assert row["state"] == "interrupted" and row["status"] == "interrupted"
    assert row["final"] is False and row["accuracy_step"] == 4
    table = format_table([row])
    line = table.splitlines()[2]
    assert "73.00*" in line and line.endswith("interrupted")
    assert "not a final result" in table and "killed at step 4" in table


def test_a_live_writer_is_running_with_the_time_since_it_last_wrote(tmp_path: Path) -> None:
    path = _write(tmp_path / "live.h5", status="running", host=HERE, pid=os.getpid(),
                  heartbeat=_iso(time.time()))  # fmt: skip
    row = summarize(path, now=time.time() + 180)  # (this process started before its heartbeat)
    assert row["state"] == "running" and row["status"] == "running, last written 3 min ago"
    assert "73.00*" in format_table([row])  # the last evaluation so far, not a result either


def test_on_another_host_we_cannot_tell(tmp_path: Path) -> None:
    path = _write(tmp_path / "remote.h5", status="running", host="node-elsewhere.invalid",
                  pid=_dead_pid(), heartbeat=_iso(NOW - 2 * 3600))  # fmt: skip
    row = summarize(path, now=NOW)
    assert row["state"] == "running" and row["status"] == "running, last written 2 h ago"


def test_an_old_file_without_heartbeat_uses_its_modification_time(tmp_path: Path) -> None:
    path = _write(tmp_path / "old.h5", status="running")
    os.utime(path, (NOW - 3 * 86400, NOW - 3 * 86400))
    assert summarize(path, now=NOW)["status"] == "running, last written 3 days ago"


def test_a_finished_run_is_unchanged(tmp_path: Path) -> None:
    path = _write(tmp_path / "done.h5", status="finished", host=HERE, pid=_dead_pid(), heartbeat=_iso(NOW))
    row = summarize(path, now=NOW)
    assert row["status"] == "finished" and row["final"] is True
    assert "73.00 " in format_table([row]) + " " and "*" not in format_table([row])


def test_a_reused_pid_is_not_the_writer() -> None:
    assert process_alive(os.getpid()) is True
    assert process_alive(_dead_pid()) is False
    other = subprocess.Popen(["sleep", "30"])  # alive, but not Python: the pid was reused
    try:
        assert process_alive(other.pid) is False
    finally:
        other.kill()
        other.wait()
    later = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.2)
        assert process_alive(later.pid, started_by=time.time() + 60) is True
        assert process_alive(later.pid, started_by=time.time() - 3600) is False  # started after the heartbeat
    finally:
        later.kill()
        later.wait()


def test_ago() -> None:
    assert [ago(s) for s in (0, 59, 600, 7199, 7200, 86400, 3 * 86400)] == [
        "0 s", "59 s", "10 min", "120 min", "2 h", "24 h", "3 days"]  # fmt: skip


WRITER = textwrap.dedent(
    """
    import datetime, os, socket, sys, time
    import numpy as np
    from hpcdl.store.runfile import RunFile
    run = RunFile.create(sys.argv[1], {"name": "mlp", "world": "mpi", "ranks": 1}, ranks=1)
    run.append_metrics([{"step": 1, "time": 0.1, "loss": 2.0, "test_accuracy": 0.4}])
    run.append_ranks({s: np.full((1, 1), 1e-3) for s in run.h5["ranks"]})
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    run.set_attrs(host=socket.gethostname(), pid=os.getpid(), heartbeat=now)
    run.flush()
    print("ready", flush=True)
    time.sleep(120)
    """
)


def test_report_reads_a_run_being_written_then_tells_it_was_killed(tmp_path: Path, capsys) -> None:
    """The real case: the writer holds the file open (HDF5 locks it), then dies of SIGKILL."""
    path = tmp_path / "run.h5"
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "ready"
        assert main([str(path), "--out", f"{tmp_path}/"]) == 0
        line = capsys.readouterr().out.splitlines()[2]
        assert "40.00*" in line and "running, last written" in line
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait()
    assert main([str(path), "--out", f"{tmp_path}/"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[2].endswith("interrupted") and "40.00*" in out


def test_table_without_any_status(tmp_path: Path) -> None:
    path = _write(tmp_path / "bare.h5")
    import h5py

    with h5py.File(path, "r+") as f:
        del f.attrs["status"]
    row = summarize(path)
    assert row["status"] is None and "-" in format_table([row]).splitlines()[2].split()
    pytest.importorskip("matplotlib")


def test_a_stalled_run_says_why_under_the_table(tmp_path: Path) -> None:
    head = "stall: rank 2 did not respond (stopped, dead, ...); it holds up the others"
    report = f"{head}\n  rank 0 waits 5.0 s in wait"
    row = summarize(_write(tmp_path / "stuck.h5", status="stalled", error=report), now=NOW)
    assert row["state"] == "stalled" and row["error"] == report and row["final"] is False
    fine = summarize(_write(tmp_path / "fine.h5", status="finished"), now=NOW)
    lines = format_table([row, fine]).splitlines()
    assert lines[-1] == f"stuck: stalled: {head}"
    assert not any(line.startswith("fine:") for line in lines)


def test_a_resumed_run_drops_the_error_of_the_segment_before(tmp_path: Path) -> None:
    path = _write(tmp_path / "again.h5", status="stalled", error="stall: rank 2 did not respond")
    RunFile.resume(path, step=4, ranks=2).close()
    row = summarize(path, now=NOW)
    assert row["error"] is None and all("stall" not in line for line in format_table([row]).splitlines())
