"""The training command in one process: it learns, its errors, its exit statuses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hpcdl.comm import world
from hpcdl.config import load_config
from hpcdl.train import main, run

BIN = Path(sys.executable).parent


def _env() -> dict[str, str]:
    return {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}


def test_short_run_learns() -> None:
    cfg = load_config("digits-mlp", ["train.epochs=3"])
    result = run(cfg, world())
    assert result.steps == 3 * (1437 // 32)
    losses = [row["loss"] for row in result.history]
    assert np.mean(losses[-10:]) < 0.5 * np.mean(losses[:10])
    assert result.test_accuracy > 0.85
    assert "test accuracy" in result.summary() and "samples/s" in result.summary()


def test_same_seed_same_result() -> None:
    cfg = load_config("digits-cnn", ["train.steps=5", "model.channels=4"])
    a, b = run(cfg), run(cfg)
    for p, q in zip(a.model.parameters(), b.model.parameters()):
        np.testing.assert_array_equal(p.data, q.data)


def test_accumulation_equals_the_whole_batch_at_once() -> None:
    """Micro-steps 4 x 8 accumulate to the gradient of the batch of 32 (mean loss, no dropout)."""
    common = ["train.steps=8", "dtype=float64", "optimizer.lr=0.05", "schedule.scale=none"]
    micro = run(load_config("digits-mlp", [*common, "data.batch_size=8", "exchange.accumulate=4"]))
    whole = run(load_config("digits-mlp", [*common, "data.batch_size=32"]))
    assert micro.steps == whole.steps == 8
    for p, q in zip(micro.model.parameters(), whole.model.parameters()):
        np.testing.assert_allclose(p.data, q.data, rtol=1e-10, atol=1e-13, err_msg=p.name)
    np.testing.assert_allclose(
        [r["loss"] for r in micro.history], [r["loss"] for r in whole.history], rtol=1e-10
    )
    assert micro.samples_per_s > 0 and micro.epochs == whole.epochs


def test_accumulation_names_itself_when_the_batch_does_not_fit() -> None:
    from hpcdl.errors import DataError

    cfg = load_config("digits-mlp", ["data.batch_size=500", "exchange.accumulate=4"])
    with pytest.raises(
        DataError, match=r"exchange.accumulate = 4, a rank's batch per step is 4 x data.batch_size 500"
    ):
        run(cfg)


def test_accumulation_scales_the_learning_rate_by_the_global_batch() -> None:
    from hpcdl.driver.factory import make_schedule

    cfg = load_config("digits-mlp", ["exchange.accumulate=4", "schedule.warmup_epochs=0"])
    assert make_schedule(cfg, 2 * 4, 10, 100)(0) == pytest.approx(cfg["optimizer.lr"] * 8)  # 2 ranks x 4


def test_profiler_table() -> None:
    cfg = load_config("digits-cnn", ["train.steps=3", "model.channels=4", "profile.layers=true"])
    result = run(cfg)
    assert result.profile is not None
    assert [row["layer"] for row in result.profile] == [str(i) for i in range(len(result.model))]
    assert all(
        row["calls"] == 3 and row["forward_s"] >= 0 and row["backward_s"] >= 0 for row in result.profile
    )
    assert [row["kind"] for row in result.profile][:3] == ["Conv2d", "BatchNorm2d", "ReLU"]
    assert result.profile[0]["output_shape"] == (32, 4, 8, 8)


@pytest.mark.parametrize("sampler", ["shuffle", "random"])
def test_other_optimizers_and_schedules(sampler: str) -> None:
    cfg = load_config(
        "digits-mlp",
        [
            "train.epochs=2",
            "optimizer.name=adamw",
            "optimizer.lr=0.002",
            "schedule.name=step",
            "schedule.step_epochs=1",
            "schedule.warmup_epochs=0.5",
            f"data.sampler={sampler}",
        ],
    )
    result = run(cfg)
    assert result.test_accuracy > 0.8
    assert result.history[-1]["lr"] == pytest.approx(0.002 * 0.1)


def test_main_prints_summary(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # the default run file goes to ./runs/
    assert main(["--config", "digits-mlp", "--set", "train.steps=2", "--progress", "none"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("digits-mlp: test accuracy")
    (run_file,) = [p for p in (tmp_path / "runs").glob("digits-mlp-*.h5") if ".ckpt-" not in p.name]
    assert out[0].endswith(f"run file {Path('runs') / run_file.name}")


def _run_cmd(*args: str, n: int | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "hpcdl.train", *args]
    if n is not None:
        cmd = [str(BIN / "mpiexec"), "-n", str(n), *cmd]
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout, env=_env())


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (
            ["--config", "digits-mlp", "--set", "optimizer.lrr=1"],
            "nearest valid key: 'optimizer.lr' (a float)",
        ),
        (["--config", "nosuch"], "neither a file nor a preset"),
        (
            ["--config", "digits-mlp", "--set", "data.name=mnist", "--set", "data.path=/nonexistent/mnist"],
            "/nonexistent/mnist",
        ),
        (["--config", "digits-mlp", "--set", "data.batch_size=2000"], "sampler"),
        (["--config", "digits-mlp", "--bogus"], "unrecognized arguments: --bogus"),
        ([], "the following arguments are required: --config"),
        (["--config", "digits-mlp", "--set", "model.dropout=1.0"], "'model.dropout' must be < 1.0"),
        (
            ["--config", "digits-mlp", "--set", "optimizer.nesterov=true", "--set", "optimizer.momentum=0"],
            "needs optimizer.momentum > 0",
        ),
        (
            [
                "--config",
                "digits-mlp",
                "--set",
                "model.name=cnn",
                "--set",
                "data.name=synthetic",
                "--set",
                "data.shape=[784]",
            ],
            "needs image inputs (C, H, W)",
        ),
        (["--config", "digits-mlp", "--set", 'data.shape=[1, "a"]'], "list of positive ints"),
    ],
)
def test_user_errors_exit_2_with_one_line(args: list[str], fragment: str) -> None:
    proc = _run_cmd(*args)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("hpcdl.train: error: ") and fragment in lines[0]
    assert "Traceback" not in proc.stderr


def test_help_exits_0() -> None:
    proc = _run_cmd("--help")
    assert proc.returncode == 0 and "--config" in proc.stdout and proc.stderr == ""


def test_user_error_under_mpiexec_is_one_line_and_nonzero() -> None:
    proc = _run_cmd("--config", "digits-mlp", "--set", "train.epochz=1", n=2)
    assert proc.returncode != 0
    ours = [ln for ln in proc.stderr.splitlines() if ln.startswith("hpcdl.train: error")]
    assert len(ours) == 1 and "train.epochs" in ours[0], proc.stderr


FAILING = """
import sys
from hpcdl.driver.cli import entry
from hpcdl.comm import world

def main(argv):
    comm = world()
    if comm.Get_rank() == {bad}:
        raise RuntimeError("deliberate failure")
    comm.Barrier()  # the other ranks wait here: without an abort they would hang
    comm.Barrier()
    return 0

entry(main, "failing")
"""


@pytest.mark.parametrize(("n", "bad"), [(2, 1), (3, 0), (3, 2)])
def test_exception_on_one_rank_ends_the_job(tmp_path: Path, n: int, bad: int) -> None:
    script = tmp_path / "failing.py"
    script.write_text(FAILING.format(bad=bad))
    proc = subprocess.run(
        [str(BIN / "mpiexec"), "-n", str(n), sys.executable, str(script)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        env=_env(),
    )
    assert proc.returncode != 0
    assert f"[rank {bad}] Traceback" in proc.stderr
    assert f"[rank {bad}] RuntimeError: deliberate failure" in proc.stderr


def test_data_parallel_command_runs(tmp_path: Path) -> None:
    out = str(tmp_path / "r.h5")
    proc = _run_cmd(
        "--config", "digits-mlp", "--set", "train.epochs=2", "--progress", "lines", "--out", out, n=2
    )
    assert proc.returncode == 0, proc.stderr
    assert "on 2 ranks" in proc.stdout and proc.stdout.count("test accuracy") == 1
    steps = 2 * (1437 // (2 * 32))  # per-rank batch 32: a global batch of 64
    assert proc.stderr.count(f"step {steps}/{steps}") == 1  # plain progress lines, rank 0 only


def test_a_pipelines_microbatches_name_themselves_when_the_batch_does_not_fit() -> None:
    from hpcdl.errors import DataError

    cfg = load_config(
        "digits-mlp", ["data.batch_size=500", "parallel.strategy=pipeline", "pipeline.microbatches=4"]
    )
    with pytest.raises(DataError, match=r"pipeline.microbatches = 4, a rank's batch per step is 4 x") as err:
        run(cfg)
    assert "exchange.accumulate" not in str(err.value)
