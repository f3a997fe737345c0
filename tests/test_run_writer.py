"""One writer per run: a resume of a run that another job still writes is refused, changing nothing.

HDF5's file lock keeps a second job off a run file only where locking works; with
``HDF5_USE_FILE_LOCKING=FALSE`` (Lustre, NFS) the check of the run's writer (host, pid
and its start, heartbeat: :mod:`hpcdl.store.liveness`) is the only guard. On this host a
writer is alive while its process runs; from another, while its heartbeat is fresh.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import h5py
import pytest

from hpcdl.config import load_config
from hpcdl.errors import file_error
from hpcdl.store.checkpoint import list_checkpoints
from hpcdl.store.liveness import start_ticks
from hpcdl.store.runfile import RunFile, RunFileError
from hpcdl.train import continue_command, run

BIN = Path(sys.executable).parent
HERE = socket.gethostname()
REFUSED = r"is being written by another job \(host (\S+), pid (\d+), heartbeat (\d+) s ago"


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", **extra}
    env.pop("HPCDL_CONTINUE", None)
    return env


def _files(directory: Path) -> dict[str, str]:
    """Every file of ``directory`` and its SHA-256."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def _iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.UTC).isoformat(timespec="seconds")


# -- the case: a real job writing the run, locking off -----------------------------------


def _sibling_rank(rank0: int) -> int:
    """The other rank of a 2-rank job: the hpcdl.train process with rank 0's parent (the proxy)."""
    parent = int(Path(f"/proc/{rank0}/stat").read_text().rsplit(")", 1)[1].split()[1])
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == rank0:
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and b"hpcdl.train" in cmdline:
            return int(entry.name)
    raise AssertionError(f"no sibling rank of pid {rank0}")


def _writer_pid(path: Path, deadline: float) -> int:
    """Rank 0's pid, as the run file records it, once the file has rows and a checkpoint."""
    while time.time() < deadline:
        try:
            with h5py.File(path, "r", locking=False) as f:
                if f["metrics/step"].shape[0] >= 5 and list_checkpoints(path):
                    return int(f.attrs["pid"])
        except (OSError, KeyError):
            pass  # not written yet
        time.sleep(0.2)
    raise AssertionError(f"{path} got no rows and checkpoint in time")


def _quiet(directory: Path, deadline: float) -> dict[str, str]:
    """The files of ``directory`` once they stay the same for a second."""
    before = _files(directory)
    while time.time() < deadline:
        time.sleep(1.0)
        now = _files(directory)
        if now == before:
            return now
        before = now
    raise AssertionError("the run file kept changing")


def test_a_second_job_on_a_live_run_is_refused_with_locking_off(tmp_path: Path) -> None:
    """The issue's probe: a job writes the run (2 ranks, HDF5 locking off), a second ``--resume
    auto`` of it exits 2 with one line and changes no byte; once the job is killed, it resumes.

    Rank 1 is stopped (SIGSTOP) so that rank 0, the writer, runs on but cannot write (it
    waits for rank 1 in the exchange): the files stay as they are, byte for byte, and any
    change is the second job's.
    """
    out = tmp_path / "live.h5"
    locking_off = _env(HDF5_USE_FILE_LOCKING="FALSE")
    args = ["--config", "mlp32-synthetic", "--progress", "none", "--out", str(out),
            "--set", "checkpoint.every=5", "--set", "log.flush_every=1"]  # fmt: skip
    train = [str(BIN / "mpiexec"), "-n", "2", sys.executable, "-m", "hpcdl.train", *args]
    job = subprocess.Popen(
        [*train, "--set", "train.steps=100000"],
        env=locking_off,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        rank0 = _writer_pid(out, time.time() + 120)
        rank1 = _sibling_rank(rank0)
        os.kill(rank1, signal.SIGSTOP)
        orphan = tmp_path / "live.ckpt-00099999.h5.4242.tmp"  # what a second job's --resume auto removes
        orphan.write_bytes(b"half a checkpoint")
        before = _quiet(tmp_path, time.time() + 60)
        assert job.poll() is None and Path(f"/proc/{rank0}").exists()  # the writer runs

        newest = int(list_checkpoints(out)[0].name.split("ckpt-")[1][:8])

        def resume_auto() -> subprocess.CompletedProcess[str]:  # a second job's --resume auto
            argv = [*train, "--set", f"train.steps={newest + 3}", "--resume", "auto"]
            return subprocess.run(
                argv, env=locking_off, capture_output=True, text=True, timeout=300, check=False
            )

        second = resume_auto()  # (were it to resume, it would end soon: no wait for a timeout)
        assert second.returncode == 2, second.stderr
        errors = [
            line for line in second.stderr.splitlines() if "error" in line and not line.startswith("Abort(")
        ]
        assert len(errors) == 1 and "Traceback" not in second.stderr, second.stderr
        line = errors[0]
        print(line)
        found = re.search(REFUSED, line)
        assert found is not None, line
        assert found.group(1) == HERE and int(found.group(2)) == rank0
        assert line.startswith(f"hpcdl.train: error: {out} is being written by another job")
        assert "nothing was changed" in line and "if you know it is dead, add --take-over" in line
        assert _files(tmp_path) == before  # the run file, its checkpoints, the partial one: byte for byte
    finally:
        os.killpg(job.pid, signal.SIGKILL)  # the job dies without a word: status stays "running"
        job.communicate(timeout=60)
    with h5py.File(out, "r") as f:
        assert f.attrs["status"] == "running" and int(f.attrs["pid"]) == rank0
    resumed = resume_auto()
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming from" in resumed.stderr, resumed.stderr
    assert not orphan.exists()  # removed once the run was taken, as before
    with h5py.File(out, "r") as f:
        assert f.attrs["status"] == "finished" and list(f.attrs["resumed_at"]) == [newest]


# -- the writer's attributes, written by hand -----------------------------------------------------


def _finished_run(path: Path) -> Path:
    run(load_config("digits-mlp", ["model.width=16", "train.steps=8", "checkpoint.every=4"]), out=path)
    return path


def _resume(path: Path, *, take_over: bool = False) -> None:
    cfg = load_config("digits-mlp", ["model.width=16", "train.steps=12", "checkpoint.every=4"])
    run(cfg, out=path, resume="auto", take_over=take_over)


def _as_written_by(path: Path, **attrs: object) -> None:
    """Mark the run as still running, written by the writer these attributes name."""
    with h5py.File(path, "r+") as f:
        f.attrs["status"] = "running"
        for key, value in attrs.items():
            f.attrs[key] = value


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """A live Python process of this host, to stand as a run's writer."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    time.sleep(0.2)
    yield proc
    proc.kill()
    proc.wait()


def test_a_live_writer_on_this_host_is_refused_and_take_over_overrides(
    tmp_path: Path, sleeper: subprocess.Popen[bytes], capsys: pytest.CaptureFixture[str]
) -> None:
    out = _finished_run(tmp_path / "r.h5")
    _as_written_by(
        out,
        host=HERE,
        pid=sleeper.pid,
        pid_start=start_ticks(sleeper.pid),
        heartbeat=_iso(time.time() - 3600),
    )
    (tmp_path / "r.ckpt-00000012.h5.4242.tmp").write_bytes(b"half")
    before = _files(tmp_path)
    with pytest.raises(
        RunFileError,
        match=r"r.h5 is being written by another job \(host \S+, pid \d+, heartbeat 60 min ago\)",
    ) as err:
        _resume(out)
    assert f"pid {sleeper.pid}," in str(err.value) and "from another host" not in str(err.value)
    assert _files(tmp_path) == before
    _resume(out, take_over=True)
    assert f"taking over {out} from its writer (host {HERE}, pid {sleeper.pid}" in capsys.readouterr().err
    with h5py.File(out, "r") as f:
        assert f.attrs["status"] == "finished" and list(f.attrs["resumed_at"]) == [8]


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.mark.parametrize("case", ["dead pid", "pid reused", "stale heartbeat elsewhere"])
def test_a_writer_that_is_gone_resumes_as_before(
    tmp_path: Path, sleeper: subprocess.Popen[bytes], case: str
) -> None:
    out = _finished_run(tmp_path / "r.h5")
    now = time.time()
    if case == "dead pid":  # killed a moment ago: the heartbeat is fresh, the process gone
        writer = {"host": HERE, "pid": _dead_pid(), "heartbeat": _iso(now)}
    elif case == "pid reused":  # a live Python process with the pid, started at another tick
        writer = {
            "host": HERE,
            "pid": sleeper.pid,
            "pid_start": start_ticks(sleeper.pid) - 1,
            "heartbeat": _iso(now),
        }
    else:  # another host, its heartbeat older than 3 of its longest gaps (100 s)
        writer = {
            "host": "node-elsewhere.invalid",
            "pid": sleeper.pid,
            "heartbeat": _iso(now - 301),
            "heartbeat_gap_s": 100.0,
        }
    _as_written_by(out, **writer)
    _resume(out)
    with h5py.File(out, "r") as f:
        assert f.attrs["status"] == "finished" and list(f.attrs["resumed_at"]) == [8]


@pytest.mark.parametrize(("age", "gap", "bound"), [(5, 0.0, "2 min"), (250, 100.0, "5 min")])
def test_a_writer_on_another_host_is_alive_while_its_heartbeat_is_fresh(
    tmp_path: Path, age: float, gap: float, bound: str
) -> None:
    out = _finished_run(tmp_path / "r.h5")
    _as_written_by(
        out, host="node-elsewhere.invalid", pid=4242, heartbeat=_iso(time.time() - age), heartbeat_gap_s=gap
    )
    before = _files(tmp_path)
    with pytest.raises(RunFileError) as err:
        _resume(out)
    line = str(err.value)
    assert "(host node-elsewhere.invalid, pid 4242, heartbeat " in line, line
    assert f"from another host a writer counts as alive until its heartbeat is {bound} old" in line, line
    assert _files(tmp_path) == before


LOCKED_WRITER = textwrap.dedent(
    """
    import datetime, os, socket, sys, time
    import h5py
    from hpcdl.store.liveness import start_ticks
    f = h5py.File(sys.argv[1], "r+")  # HDF5 locks it, as a writer's RunFile does
    f.attrs.update(status="running", host=socket.gethostname(), pid=os.getpid(), pid_start=start_ticks(),
                   heartbeat=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"))
    f.flush()
    print("ready", flush=True)
    time.sleep(120)
    """
)


def test_with_locking_on_the_refusal_names_the_writer_too(tmp_path: Path) -> None:
    """HDF5's lock would refuse the second job with "the file is locked"; the writer's line is clearer."""
    out = _finished_run(tmp_path / "r.h5")
    env = {k: v for k, v in os.environ.items() if k != "HDF5_USE_FILE_LOCKING"}
    writer = subprocess.Popen(
        [sys.executable, "-c", LOCKED_WRITER, str(out)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert writer.stdout is not None and writer.stdout.readline().strip() == "ready"
        with pytest.raises(
            RunFileError, match=rf"pid {writer.pid}, heartbeat \d+ s ago\): nothing was changed"
        ):
            _resume(out)
    finally:
        writer.kill()
        writer.wait()


def test_the_lock_message_says_what_turning_locking_off_costs() -> None:
    locked = OSError(
        "Unable to synchronously open file (unable to lock file, errno = 11, "
        "error message = 'Resource temporarily unavailable')"
    )
    line = str(file_error("r.h5", locked, what="run file", verb="open"))
    assert "set HDF5_USE_FILE_LOCKING=FALSE" in line
    assert "leaves hpcdl's check of a run's writer (its host, pid and heartbeat) as the only guard" in line


def test_the_heartbeat_is_renewed_between_flushes_and_its_longest_gap_recorded(tmp_path: Path) -> None:
    with RunFile.create(tmp_path / "r.h5", {"name": "x"}, ranks=1) as runfile:
        first = dict(runfile.h5.attrs)
        assert first["heartbeat_gap_s"] == 0.0 and first["pid"] == os.getpid()
        assert first["pid_start"] == start_ticks()
        runfile.beat()  # less than HEARTBEAT_S since the file was opened: nothing written
        assert runfile.h5.attrs["heartbeat_gap_s"] == 0.0
        runfile._beat_at -= 45.0  # as if 45 s went by in steps
        runfile.beat()
        assert runfile.h5.attrs["heartbeat_gap_s"] >= 45.0
    with h5py.File(tmp_path / "r.h5", "r") as f:  # flushed, so that another job reads it
        assert f.attrs["heartbeat_gap_s"] >= 45.0 and f.attrs["heartbeat"] >= first["heartbeat"]


def test_take_over_goes_with_resume_and_is_not_repeated_in_the_continue_command(tmp_path: Path) -> None:
    from hpcdl.comm import world
    from hpcdl.errors import ConfigError
    from hpcdl.train import main

    with pytest.raises(ConfigError, match="--take-over goes with --resume"):
        main(["--config", "digits-mlp", "--take-over", "--out", str(tmp_path / "r.h5")])
    again = continue_command(
        ["--config", "x", "--resume", "auto", "--take-over", "--out", "r.h5"], Path("r.h5"), world()
    )
    assert "--take-over" not in again and again.endswith("--config x --out r.h5 --resume auto")
