"""Graceful stops: SIGUSR1 to mpiexec stops every rank at a step boundary; --resume auto finishes it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import h5py
import pytest

from hpcdl.driver.signals import StopRequest, install_handlers

BIN = Path(sys.executable).parent
# slow enough steps (tens of ms) that a signal lands well inside the run
SETS = ["--set", "data.batch_size=128", "--set", "model.channels=48", "--set", "train.epochs=12",
        "--set", "checkpoint.every=0", "--set", "train.log_every=1"]  # fmt: skip


def _train(out: Path, *extra: str) -> subprocess.Popen[str]:
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    cmd = [str(BIN / "mpiexec"), "-n", "2", sys.executable, "-m", "hpcdl.train", "--config", "digits-cnn",
           *SETS, "--progress", "lines", "--out", str(out), *extra]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _params(ckpt: Path) -> dict[str, bytes]:
    with h5py.File(ckpt, "r") as f:
        params = f["pieces/model/params"]
        return {k: params[k][()].tobytes() for k in params} | {
            f"{r}/{k}": f[f"ranks/{r}"][k][()].tobytes() for r in (0, 1) for k in f[f"ranks/{r}"]
        }


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM])
def test_signal_stops_within_two_steps_and_resume_matches(tmp_path: Path, sig: signal.Signals) -> None:
    proc = _train(tmp_path / "split.h5")
    assert proc.stderr is not None
    seen = 0
    for line in proc.stderr:  # rank 0's progress lines, one per step
        m = re.match(r"step (\d+)/", line)
        if m and int(m.group(1)) >= 30:
            seen = int(m.group(1))
            proc.send_signal(sig)  # mpiexec forwards it to every rank
            break
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    stopped = int(re.search(rf"stopped by {sig.name} after step (\d+)", out).group(1))
    print(f"signal sent after step {seen}, stopped after step {stopped}")
    assert seen <= stopped <= seen + 2
    assert "--resume auto" in out
    with h5py.File(tmp_path / "split.h5", "r") as f:
        assert f.attrs["status"] == "stopped" and f["metrics/step"][-1] == stopped

    resumed = _train(tmp_path / "split.h5", "--resume", "auto")
    whole = _train(tmp_path / "whole.h5")
    for p in (resumed, whole):
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    total = 12 * (1437 // 256)
    a = _params(tmp_path / f"split.ckpt-{total:08d}.h5")
    b = _params(tmp_path / f"whole.ckpt-{total:08d}.h5")
    assert a.keys() == b.keys() and all(a[k] == b[k] for k in a)


def test_stop_request_handlers(monkeypatch: pytest.MonkeyPatch) -> None:
    installed = {}
    monkeypatch.setattr(signal, "signal", installed.__setitem__)
    req = StopRequest()
    install_handlers(req)
    assert set(installed) == {signal.SIGUSR1, signal.SIGTERM, signal.SIGINT}
    installed[signal.SIGUSR1](signal.SIGUSR1, None)
    assert req.requested and req.name == "SIGUSR1"
    installed[signal.SIGTERM](signal.SIGTERM, None)
    assert req.name == "SIGUSR1"  # the first reason is kept
    with pytest.raises(KeyboardInterrupt):  # a second Ctrl-C: out now
        installed[signal.SIGINT](signal.SIGINT, None)


def _single(out: Path) -> subprocess.Popen[str]:
    """One process of digits-cnn, its progress as plain lines on stderr."""
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "hpcdl.train", "--config", "digits-cnn", *SETS, "--set", "log.flush_every=5",
           "--progress", "lines", "--out", str(out)]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _after_step(proc: subprocess.Popen[str], step: int) -> None:
    assert proc.stderr is not None
    for line in proc.stderr:
        m = re.match(r"step (\d+)/", line)
        if m and int(m.group(1)) >= step:
            return
    raise AssertionError(f"the run ended before step {step}")


def test_a_run_killed_with_sigkill_is_reported_interrupted(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from hpcdl.report import main as report

    out = tmp_path / "killed.h5"
    proc = _single(out)
    _after_step(proc, 12)
    proc.kill()
    proc.communicate(timeout=60)
    with h5py.File(out, "r") as f:  # what the writer left: still "running", with its pid and heartbeat
        assert f.attrs["status"] == "running" and int(f.attrs["pid"]) == proc.pid
        assert str(f.attrs["heartbeat"]) >= str(f.attrs["start_time"]) and f["metrics/step"].shape[0] >= 10
    assert report([str(out), "--out", f"{tmp_path}/"]) == 0
    assert capsys.readouterr().out.splitlines()[2].rstrip().endswith("interrupted")


def test_a_second_ctrl_c_marks_the_run_interrupted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The handler raises KeyboardInterrupt on a second Ctrl-C (tested above); the loop records it."""
    from hpcdl import train
    from hpcdl.config import load_config
    from hpcdl.parallel import sync

    calls = {"n": 0}
    real = sync.forward_backward

    def interrupted_at_step_5(*args: object) -> tuple[float, int]:
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(sync, "forward_backward", interrupted_at_step_5)
    out = tmp_path / "twice.h5"
    with pytest.raises(KeyboardInterrupt):
        train.run(load_config("digits-mlp", ["train.steps=20", "log.flush_every=2"]), out=out)
    with h5py.File(out, "r") as f:
        assert f.attrs["status"] == "interrupted" and list(f["metrics/step"][...]) == [1, 2, 3, 4]
