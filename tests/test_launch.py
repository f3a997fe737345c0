"""hpcdl.driver.launch: unconnected ranks are refused; the ready file says every rank can take a stop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcdl.driver.launch import READY_FILE_VAR, check_world_size, launched_tasks, signal_ready, started
from hpcdl.errors import ConfigError, FileError

BIN = Path(sys.executable).parent
LAUNCH_VARS = ("SLURM_STEP_NUM_TASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")


class FakeComm:
    """Rank ``rank`` of ``size``; records its calls, and whether the ready file existed at each."""

    def __init__(self, rank: int, size: int, watch: Path | None = None) -> None:
        self.rank, self.size, self.watch = rank, size, watch
        self.calls: list[str] = []

    def Get_rank(self) -> int:  # noqa: N802  (mpi4py's names)
        return self.rank

    def Get_size(self) -> int:  # noqa: N802
        return self.size

    def Barrier(self) -> None:  # noqa: N802
        self.calls.append(f"Barrier(file exists: {self.watch is not None and self.watch.exists()})")


class FakeSimComm(FakeComm):
    sim_attrs = {"world": "sim"}  # noqa: RUF012  (what hpcdl.sim's communicator has)


@pytest.mark.parametrize(
    ("size", "env"),
    [
        (1, {}),  # a plain one-process run
        (1, {"SLURM_NTASKS": "4", "SLURM_JOB_ID": "7"}),  # python run by the batch script itself
        (1, {"SLURM_STEP_NUM_TASKS": "1", "PMI_SIZE": "1"}),  # srun -n 1
        (2, {"SLURM_STEP_NUM_TASKS": "2", "PMI_SIZE": "2"}),  # srun --mpi=pmi2 -n 2
        (3, {"PMI_SIZE": "3"}),  # mpiexec -n 3
        (2, {"SLURM_STEP_NUM_TASKS": "1"}),  # mpiexec -n 2 inside a one-task step
        (1, {"SLURM_STEP_NUM_TASKS": "", "PMI_SIZE": "x"}),  # not numbers: no launcher said anything
    ],
)
def test_connected_or_single_runs_are_accepted(size: int, env: dict[str, str]) -> None:
    check_world_size(size, env)


@pytest.mark.parametrize(
    ("env", "launcher", "var", "fix"),
    [
        ({"SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "2"}, "srun", "SLURM_STEP_NUM_TASKS=2", "--mpi=pmi2"),
        ({"PMI_SIZE": "3"}, "the launcher", "PMI_SIZE=3", "mpiexec of the MPI that mpi4py uses"),
        ({"OMPI_COMM_WORLD_SIZE": "4"}, "Open MPI's mpirun", "OMPI_COMM_WORLD_SIZE=4", "mpi4py"),
    ],
)
def test_unconnected_ranks_are_refused_naming_both_counts(
    env: dict[str, str], launcher: str, var: str, fix: str
) -> None:
    with pytest.raises(ConfigError) as err:
        check_world_size(1, env)
    text = str(err.value)
    assert "\n" not in text
    assert text.startswith(f"{launcher} started {var.split('=')[1]} processes ({var}) but MPI sees 1 rank")
    assert fix in text
    if var.startswith("SLURM"):
        assert "HPCDL_SRUN_MPI in jobs/site.sh" in text


def test_the_step_count_is_read_before_the_pmi_count() -> None:
    found = launched_tasks({"PMI_SIZE": "3", "SLURM_STEP_NUM_TASKS": "2"})
    assert found == (2, "SLURM_STEP_NUM_TASKS", "srun")
    assert launched_tasks({}) is None


def test_no_ready_file_asked_for_means_no_collective(tmp_path: Path) -> None:
    comm = FakeComm(0, 2)
    assert signal_ready(comm, {}) is None  # type: ignore[arg-type]
    assert comm.calls == []


@pytest.mark.parametrize("size", [1, 2, 3])
def test_rank_0_creates_the_ready_file_after_every_rank_reached_it(tmp_path: Path, size: int) -> None:
    ready = tmp_path / "run.h5.ready-42"
    env = {READY_FILE_VAR: str(ready)}
    comms = [FakeComm(rank, size, watch=ready) for rank in range(size)]
    for comm in reversed(comms):  # rank 0 last: the others have passed the barrier
        made = signal_ready(comm, env)  # type: ignore[arg-type]
        assert made == (ready if comm.rank == 0 else None)
    assert ready.exists()
    expected = [] if size == 1 else ["Barrier(file exists: False)"]
    assert all(comm.calls == expected for comm in comms)


def test_a_ready_file_that_cannot_be_created_is_one_line(tmp_path: Path) -> None:
    ready = tmp_path / "no-such-dir" / "run.h5.ready-1"
    with pytest.raises(FileError) as err:
        signal_ready(FakeComm(0, 1), {READY_FILE_VAR: str(ready)})  # type: ignore[arg-type]
    assert str(ready) in str(err.value) and "\n" not in str(err.value)


def test_the_simulator_is_neither_refused_nor_signalled(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    comm = FakeSimComm(0, 1)
    started(comm, {"SLURM_STEP_NUM_TASKS": "2", READY_FILE_VAR: str(ready)})  # type: ignore[arg-type]
    assert not ready.exists() and comm.calls == []


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and k != READY_FILE_VAR}
    return {**env, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", **extra}


def test_train_refuses_ranks_srun_did_not_connect(tmp_path: Path) -> None:
    # what each task of `srun --mpi=none -n 2` sees: Slurm's variables, and an MPI world of one
    out = tmp_path / "r.h5"
    cmd = [sys.executable, "-m", "hpcdl.train", "--config", "digits-mlp", "--set", "train.steps=2",
           "--out", str(out)]  # fmt: skip
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=120, check=False,
        env=_env(SLURM_STEP_NUM_TASKS="2", SLURM_NTASKS="2", SLURM_PROCID="1"),
    )  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("hpcdl.train: error: srun started 2 processes (SLURM_STEP_NUM_TASKS=2)")
    assert not out.exists() and proc.stdout == ""


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_stop_signal_after_the_ready_file_is_a_clean_stop(tmp_path: Path, ranks: int) -> None:
    """The promise the job scripts rely on: once the ready file exists, SIGUSR1 checkpoints and stops."""
    ready, out = tmp_path / "run.h5.ready-1", tmp_path / "run.h5"
    cmd = [sys.executable, "-m", "hpcdl.train", "--config", "digits-mlp", "--set", "train.steps=100000",
           "--set", "checkpoint.every=0", "--progress", "none", "--out", str(out)]  # fmt: skip
    if ranks > 1:
        cmd = [str(BIN / "mpiexec"), "-n", str(ranks), *cmd]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(**{READY_FILE_VAR: str(ready)}))  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists(), "the ready file never appeared"
        proc.send_signal(signal.SIGUSR1)  # MPICH's mpiexec forwards it to every rank
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, stderr
    assert "stopped by SIGUSR1" in stdout
    assert list(tmp_path.glob("run.ckpt-*.h5")), "no checkpoint written"
