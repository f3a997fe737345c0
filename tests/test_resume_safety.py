"""A resume never destroys a run, and the command printed after a stop continues it.

``--resume auto`` starts fresh only when there is no run yet; a run file written with
other settings, checkpoints that exist but do not fit or are damaged, and another rank
count are refused with one line, changing nothing (checked byte for byte). A fresh start
never deletes an earlier run's checkpoints.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import h5py
import pytest

from hpcdl.config import load_config
from hpcdl.errors import HpcdlError
from hpcdl.store.checkpoint import checkpoint_path, list_checkpoints
from hpcdl.train import continue_command, run

BIN = Path(sys.executable).parent


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", **extra}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"  # mpiexec and python as a user with .venv active
    env.pop("HPCDL_CONTINUE", None)
    return env


def _train(*args: str, n: int | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "hpcdl.train", "--progress", "none", *args]
    if n is not None:
        cmd = [str(BIN / "mpiexec"), "-n", str(n), *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env(), cwd=cwd, check=False)


def _files(directory: Path) -> dict[str, str]:
    """Every file of ``directory`` and its SHA-256."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def _error_line(proc: subprocess.CompletedProcess[str]) -> str:
    """The one ``error:`` line of a refused command (MPICH may add its own Abort line)."""
    errors = [line for line in proc.stderr.splitlines() if "error" in line and not line.startswith("Abort(")]
    assert len(errors) == 1, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    return errors[0]


def test_the_issues_data_loss_case_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    """The probe of the issue: another seed and more steps, --resume auto, on a finished run."""
    out = tmp_path / "R.h5"
    first = _train("--config", "digits-cnn", "--set", "checkpoint.every=50", "--set", "train.steps=200",
                   "--out", str(out))  # fmt: skip
    assert first.returncode == 0, first.stderr
    assert [p.name for p in list_checkpoints(out)] == ["R.ckpt-00000200.h5", "R.ckpt-00000150.h5"]
    before = _files(tmp_path)
    again = _train("--config", "digits-cnn", "--set", "seed=3", "--set", "train.steps=260",
                   "--out", str(out), "--resume", "auto")  # fmt: skip
    assert again.returncode == 2
    line = _error_line(again)
    assert "seed = 0" in line and "this run has 3" in line and "another --out" in line, line
    assert _files(tmp_path) == before  # the run file and both checkpoints, byte for byte


def _base(*sets: str) -> list[str]:
    return ["model.width=32", "train.steps=30", "checkpoint.every=10", "checkpoint.keep=5", *sets]


def _refused(out: Path, match: str, *sets: str, resume: str | None = "auto") -> None:
    """digits-mlp with ``_base(*sets)`` on ``out`` is refused with ``match``; no file beside it changes."""
    before = _files(out.parent)
    with pytest.raises(HpcdlError, match=match):
        run(load_config("digits-mlp", _base(*sets)), out=out, resume=resume)
    assert _files(out.parent) == before


def test_checkpoints_that_do_not_fit_are_refused_without_a_run_file(tmp_path: Path) -> None:
    out = tmp_path / "r.h5"
    run(load_config("digits-mlp", _base()), out=out)
    out.unlink()  # only the checkpoints are left
    refused = r"can continue this run: .*data.batch_size = 32; this run has 16 \(and 2 more checkpoints"
    _refused(out, refused, "data.batch_size=16")


def test_damaged_checkpoints_are_refused(tmp_path: Path) -> None:
    out = tmp_path / "r.h5"
    run(load_config("digits-mlp", _base()), out=out)
    for path in list_checkpoints(out):
        path.write_bytes(path.read_bytes()[:2000])
    _refused(out, "can continue this run: checkpoint .* is damaged or truncated")


def test_a_run_without_a_checkpoint_is_compared_by_its_config(tmp_path: Path) -> None:
    out = tmp_path / "r.h5"
    run(load_config("digits-mlp", _base()), out=out)
    for path in list_checkpoints(out):
        path.unlink()  # as if killed before its first checkpoint
    _refused(out, r"r.h5 was written with model.width = 32; this run has 64", "model.width=64")


def test_settings_outside_the_trajectory_may_change_and_are_recorded(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r.h5"
    run(load_config("digits-mlp", _base()), out=out)
    rest = run(load_config("digits-mlp", _base("train.steps=40")), out=out, resume="auto")
    assert rest.steps == 40
    assert "continues with changed settings: train.steps 30 -> 40" in capsys.readouterr().err
    with h5py.File(out, "r") as f:
        assert json.loads(f.attrs["config_changes"]) == [{"step": 30, "changed": {"train.steps": [30, 40]}}]
        assert "steps = 40" in f.attrs["config"] and list(f.attrs["resumed_at"]) == [30]


def test_a_fresh_start_never_takes_over_another_runs_checkpoints(tmp_path: Path) -> None:
    out = tmp_path / "r.h5"
    run(load_config("digits-mlp", _base()), out=out)
    out.unlink()
    _refused(out, r"r.ckpt-00000030.h5 of an earlier run lies beside .*r.h5", "seed=5", resume=None)


def test_auto_removes_its_runs_orphaned_temporary_checkpoints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r.h5"
    run(load_config("digits-mlp", _base("train.stop_at=20")), out=out)
    orphan = checkpoint_path(out, 30).with_name("r.ckpt-00000030.h5.4242.tmp")
    orphan.write_bytes(b"half a checkpoint")
    other = tmp_path / "other.ckpt-00000030.h5.4242.tmp"  # another run's: not ours to remove
    other.write_bytes(b"x")
    run(load_config("digits-mlp", _base()), out=out, resume="auto")
    assert not orphan.exists() and other.exists()
    assert "removed 1 partial checkpoint file a killed run left: r.ckpt-00000030.h5.4242.tmp" in (
        capsys.readouterr().err
    )


def test_the_printed_command_continues_a_stopped_run_under_mpiexec(tmp_path: Path) -> None:
    out = tmp_path / "r.h5"
    proc = _train("--config", "digits-mlp", "--set", "train.steps=40", "--set", "train.stop_at=20",
                  "--out", str(out), n=3)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    command = re.search(r"continue with: (.*)$", proc.stdout, re.M)
    assert command is not None, proc.stdout
    assert command.group(1).startswith("mpiexec -n 3 python -m hpcdl.train "), command.group(1)
    again = subprocess.run(command.group(1), shell=True, capture_output=True, text=True, timeout=300,
                           env=_env(), check=False)  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert "resuming from" in again.stderr and "40 steps" in again.stdout, again.stdout + again.stderr


def test_another_rank_count_is_one_line_naming_both(tmp_path: Path) -> None:
    out = tmp_path / "r.h5"
    assert _train("--config", "digits-mlp", "--set", "train.steps=20", "--out", str(out), n=3).returncode == 0
    before = _files(tmp_path)
    proc = _train("--config", "digits-mlp", "--set", "train.steps=20", "--out", str(out), "--resume", "auto",
                  n=2)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    line = _error_line(proc)
    assert "was written by 3 ranks and this run has 2" in line and "continue it on 3 ranks" in line, line
    assert _files(tmp_path) == before


def test_the_continue_command_of_a_job_script_and_of_the_simulator(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from hpcdl.comm import world

    monkeypatch.setenv("HPCDL_CONTINUE", "sbatch --job-name=cnn jobs/slurm/train.sbatch --config digits-cnn")
    assert continue_command(["--config", "x"], tmp_path / "r.h5", world()).startswith("sbatch --job-name=cnn")
    monkeypatch.delenv("HPCDL_CONTINUE")
    monkeypatch.setenv("PATH", f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")  # .venv active: "python"
    from hpcdl.simulate import main as simulate

    out = tmp_path / "s.h5"
    argv = ["-n", "2", "--network", "ib-hdr", "-m", "hpcdl.train", "--config", "digits-mlp",
            "--set", "train.steps=12", "--set", "train.stop_at=6", "--out", str(out)]  # fmt: skip
    assert simulate(argv) == 0
    line = re.search(r"continue with: (.*)$", capsys.readouterr().out, re.M)
    assert line is not None
    head = "python -m hpcdl.simulate -n 2 --network ib-hdr -m hpcdl.train --config"
    assert line.group(1).startswith(head), line
    printed = line.group(1).split()
    assert simulate(printed[3:]) == 0  # what follows "python -m hpcdl.simulate", as printed
    assert "12 steps" in capsys.readouterr().out


def test_a_finished_run_without_checkpoints_is_not_restarted(tmp_path: Path) -> None:
    """Checkpoints deleted to save space: --resume auto must not start the finished run over."""
    out = tmp_path / "r.h5"
    run(load_config("digits-mlp", _base()), out=out)
    for path in list_checkpoints(out):
        path.unlink()
    _refused(out, r"r.h5 is a finished run with no checkpoint to continue from", "train.steps=5")


def test_a_run_killed_before_its_first_checkpoint_starts_again(tmp_path: Path) -> None:
    """A requeued job whose first allocation ended before any checkpoint: same settings, from 0."""
    out = tmp_path / "r.h5"
    run(load_config("digits-mlp", _base()), out=out)
    for path in list_checkpoints(out):
        path.unlink()
    with h5py.File(out, "r+") as f:
        f.attrs["status"] = "running"  # as SIGKILL leaves it
    rest = run(load_config("digits-mlp", _base()), out=out, resume="auto")
    assert rest.steps == 30
    with h5py.File(out, "r") as f:
        assert list(f.attrs["resumed_at"]) == [0] and f.attrs["rows_cut"] == 30
        assert f["metrics/step"].shape == (30,)


@pytest.mark.parametrize("resume", [[], ["--resume", "auto"]])
def test_out_naming_a_directory_says_so_and_what_to_give_instead(tmp_path: Path, resume: list[str]) -> None:
    from hpcdl.train import main

    (tmp_path / "earlier.h5").write_bytes(b"another run")
    before = _files(tmp_path)
    with pytest.raises(HpcdlError) as err:
        main(["--config", "digits-mlp", "--progress", "none", "--out", str(tmp_path), *resume])
    assert str(err.value) == (
        f"--out {tmp_path} is a directory: --out names the run file, its checkpoints go beside it; "
        f"give a file in it, e.g. --out {tmp_path / 'digits-mlp.h5'}"
    )
    assert _files(tmp_path) == before
    with pytest.raises(HpcdlError, match=r"--out .*new/ is a directory: --out names the run file"):
        main(["--config", "digits-mlp", "--progress", "none", "--out", f"{tmp_path}/new/", *resume])
    assert not (tmp_path / "new").exists()


def test_a_truncated_run_file_is_damaged_to_train_and_report_alike(tmp_path: Path) -> None:
    from hpcdl.report import load

    out = tmp_path / "r.h5"
    run(load_config("digits-mlp", _base()), out=out)
    whole = out.read_bytes()
    out.write_bytes(whole[: len(whole) // 2])  # a copy cut short
    cut = len(whole) // 2
    damaged = rf"cannot (open|read) run file .*r.h5: it is damaged \(truncated: {cut} of its \d+ bytes\)"
    fix = (
        r"nothing was changed: move it aside and run again; --resume auto then continues from its newest "
        r"checkpoint that loads \(r.ckpt-00000030.h5 is the newest\) in a new run file"
    )
    _refused(out, damaged + " or not an hpcdl run file; " + fix, "train.steps=40")
    with pytest.raises(HpcdlError, match=damaged + " or not an hpcdl run file$"):
        load(out)
    out.rename(tmp_path / "r.h5.damaged")  # the fix the line gives
    rest = run(load_config("digits-mlp", _base("train.steps=40")), out=out, resume="auto")
    assert rest.steps == 40
    with h5py.File(out, "r") as f:
        assert f["metrics/step"][0] == 31 and f.attrs["status"] == "finished"
