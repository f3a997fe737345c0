"""Resume: bit-exact continuation, refused checkpoints, NaN stops, and their one-line errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from hpcdl.config import load_config
from hpcdl.errors import HpcdlError
from hpcdl.store.checkpoint import (
    CheckpointError,
    checkpoint_path,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from hpcdl.train import run

# a CNN with BatchNorm and dropout, Adam: every kind of state a checkpoint must carry
BASE = ["model.channels=4", "model.dropout=0.3", "train.epochs=2", "optimizer.name=adam",
        "optimizer.lr=0.003",
        "schedule.name=cosine", "schedule.warmup_epochs=0.5", "checkpoint.every=0"]  # fmt: skip


def _state(result) -> dict[str, bytes]:
    return {k: v.tobytes() for k, v in result.model.state_dict().items()} | {
        k: np.asarray(v).tobytes()
        for k, v in result.optimizer.state_dict().items()
        if isinstance(v, np.ndarray)
    }


@pytest.mark.parametrize("sampler", ["shuffle", "random"])
def test_stop_and_resume_is_bitwise_identical(tmp_path: Path, sampler: str) -> None:
    sets = [*BASE, f"data.sampler={sampler}"]
    whole = run(load_config("digits-cnn", sets), out=tmp_path / "whole.h5")
    first = run(load_config("digits-cnn", [*sets, "train.stop_at=57"]), out=tmp_path / "split.h5")
    assert first.stopped_by == "train.stop_at = 57" and first.steps == 57
    assert first.checkpoint == checkpoint_path(tmp_path / "split.h5", 57)
    rest = run(load_config("digits-cnn", sets), out=tmp_path / "split.h5", resume="auto")
    assert rest.steps == whole.steps == 88
    assert _state(rest) == _state(whole)  # parameters, BatchNorm statistics, Adam moments: every byte
    with h5py.File(tmp_path / "split.h5", "r") as f:
        np.testing.assert_array_equal(f["metrics/step"][...], np.arange(1, 89))
        assert list(f.attrs["resumed_at"]) == [57] and f.attrs["status"] == "finished"
        with h5py.File(tmp_path / "whole.h5", "r") as g:
            np.testing.assert_array_equal(f["metrics/loss"][...], g["metrics/loss"][...])


def test_rows_past_the_checkpoint_are_cut_and_counted(tmp_path: Path) -> None:
    out = tmp_path / "r.h5"
    sets = [*BASE, "checkpoint.every=20", "log.flush_every=1"]
    run(load_config("digits-cnn", sets), out=out)
    for p in list_checkpoints(out)[:1]:  # lose the final checkpoint: the job "died" after step 88
        p.unlink()
    rest = run(load_config("digits-cnn", sets), out=out, resume="auto")
    assert rest.steps == 88
    with h5py.File(out, "r") as f:
        assert list(f.attrs["resumed_at"]) == [80] and f.attrs["rows_cut"] == 8
        np.testing.assert_array_equal(f["metrics/step"][...], np.arange(1, 89))
        assert f["ranks/compute_time"].shape == (88, 1)


def test_auto_skips_a_damaged_newest_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.h5"
    sets = [*BASE, "checkpoint.every=40", "checkpoint.keep=3", "train.stop_at=80"]
    run(load_config("digits-cnn", sets), out=out)
    newest = checkpoint_path(out, 80)
    newest.write_bytes(newest.read_bytes()[:1000])  # truncated
    rest = run(load_config("digits-cnn", [*BASE]), out=out, resume="auto")
    assert "skipping a checkpoint" in capsys.readouterr().err
    with h5py.File(out, "r") as f:
        assert list(f.attrs["resumed_at"]) == [40]
    assert rest.steps == 88


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ("model.channels=8", "model.channels = 4; this run has 8"),
        ("data.batch_size=16", "data.batch_size = 32; this run has 16"),
        ("seed=3", "seed = 0; this run has 3"),
    ],
)
def test_mismatched_checkpoint_is_refused(tmp_path: Path, change: str, fragment: str) -> None:
    out = tmp_path / "r.h5"
    run(load_config("digits-cnn", [*BASE, "train.stop_at=10"]), out=out)
    with pytest.raises(CheckpointError, match=fragment):
        run(
            load_config("digits-cnn", [*BASE, change]),
            out=tmp_path / "new.h5",
            resume=str(checkpoint_path(out, 10)),
        )


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "r.h5"
    # a sane lr for 22 steps, then a million times larger: the loss blows up after a few checkpoints
    sets = ["train.steps=60", "checkpoint.every=10", "checkpoint.keep=5", "log.flush_every=1",
            "schedule.warmup_epochs=0", "schedule.name=step", "schedule.step_epochs=0.5",
            "schedule.gamma=1e6"]  # fmt: skip
    with pytest.raises(HpcdlError, match=r"loss is (nan|inf) at step (\d+)") as info:
        run(load_config("digits-mlp", sets), out=out)
    bad_step = int(str(info.value).split("at step ")[1].split(":")[0])
    kept = list_checkpoints(out)
    assert 22 < bad_step < 60 and kept, f"step {bad_step}, checkpoints {kept}"
    last_good = load_checkpoint(kept[0])
    assert last_good.step == 10 * ((bad_step - 1) // 10)  # the last one before the bad step
    assert all(np.isfinite(a).all() for a in last_good.pieces["model"]["params"].values())
    with h5py.File(out, "r") as f:
        assert f.attrs["status"] == "failed"


def _cmd(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "hpcdl.train", *args], capture_output=True, text=True,
                          timeout=120, env=env, check=False)  # fmt: skip


def test_command_line_errors(tmp_path: Path) -> None:
    proc = _cmd("--config", "digits-mlp", "--resume", "auto")
    assert proc.returncode == 2 and "--resume auto needs --out" in proc.stderr
    existing = tmp_path / "r.h5"
    existing.write_bytes(b"x")
    proc = _cmd("--config", "digits-mlp", "--out", str(existing))
    assert proc.returncode == 2 and "already exists: continue it with --resume auto" in proc.stderr
    assert existing.read_bytes() == b"x"
    proc = _cmd("--config", "digits-mlp", "--resume", str(tmp_path / "none.ckpt-00000001.h5"))
    assert proc.returncode == 2 and "does not exist" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_auto_with_no_checkpoint_starts_fresh(tmp_path: Path) -> None:
    result = run(load_config("digits-mlp", ["train.steps=3"]), out=tmp_path / "new.h5", resume="auto")
    assert result.steps == 3 and (tmp_path / "new.h5").exists()


def test_plain_sgd_without_momentum_resumes_bitwise(tmp_path: Path) -> None:
    """An optimizer with no array state: its empty group is still a group of the checkpoint."""
    sets = ["optimizer.momentum=0.0", "train.steps=30", "checkpoint.every=0"]
    whole = run(load_config("digits-mlp", sets), out=tmp_path / "whole.h5")
    run(load_config("digits-mlp", [*sets, "train.stop_at=13"]), out=tmp_path / "split.h5")
    rest = run(load_config("digits-mlp", sets), out=tmp_path / "split.h5", resume="auto")
    assert _state(rest) == _state(whole)


def test_auto_passes_over_a_checkpoint_of_another_model_before_changing_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r.h5"
    sets = [*BASE, "checkpoint.every=20", "checkpoint.keep=3", "train.stop_at=25"]
    run(load_config("digits-cnn", sets), out=out)
    newest = load_checkpoint(checkpoint_path(out, 25))  # as if written by a model with another layer name
    params = newest.pieces["model"]["params"]
    params["renamed.weight"] = params.pop(sorted(params)[0])
    save_checkpoint(newest, checkpoint_path(out, 25))
    rest = run(load_config("digits-cnn", BASE), out=out, resume="auto")
    err = capsys.readouterr().err
    assert "skipping a checkpoint" in err and "holds another model" in err, err
    assert rest.steps == 88
    with h5py.File(out, "r") as f:
        assert list(f.attrs["resumed_at"]) == [20]
