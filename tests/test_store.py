"""The run file's layout and checkpoint files: read back with plain h5py, damage detected."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from hpcdl.config import load_config
from hpcdl.store import METRICS, RANK_SERIES, TRACE_FIELDS, RunFile, RunFileError
from hpcdl.store.checkpoint import (
    Checkpoint,
    CheckpointError,
    checkpoint_path,
    list_checkpoints,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
)
from hpcdl.train import run


def test_training_writes_the_documented_layout(tmp_path: Path) -> None:
    out = tmp_path / "runs" / "r.h5"
    cfg = load_config("digits-cnn", ["train.epochs=2", "model.channels=4", "profile.layers=true"])
    result = run(cfg, out=out)
    steps = result.steps
    with h5py.File(out, "r") as f:  # plain h5py: nothing from hpcdl needed to read it
        attrs = dict(f.attrs)
        for key in (
            "config",
            "hpcdl_version",
            "git_commit",
            "mpi_library",
            "ranks",
            "world",
            "start_time",
            "status",
            "end_time",
            "wall_s",
            "final_test_accuracy",
            "samples_per_s",
        ):
            assert key in attrs, key
        assert attrs["ranks"] == 1 and attrs["world"] == "mpi" and attrs["status"] == "finished"
        assert "MPICH" in attrs["mpi_library"] or "Open MPI" in attrs["mpi_library"]
        assert "[optimizer]" in attrs["config"] and 'name = "digits-cnn"' in attrs["config"]
        assert set(f["metrics"]) == set(METRICS)
        for name in METRICS:
            assert f["metrics"][name].shape == (steps,), name
        np.testing.assert_array_equal(f["metrics/step"][...], np.arange(1, steps + 1))
        assert np.all(np.diff(f["metrics/time"][...]) > 0)
        evaluated = ~np.isnan(f["metrics/test_accuracy"][...])
        assert evaluated.sum() == 2 and evaluated[-1]  # end of each epoch
        assert f["metrics/test_accuracy"][-1] == pytest.approx(result.test_accuracy)
        np.testing.assert_allclose(f["metrics/loss"][...], [r["loss"] for r in result.history])
        assert set(f["ranks"]) == set(RANK_SERIES)
        assert all(f["ranks"][n].shape == (steps, 1) for n in RANK_SERIES)
        assert set(f["trace"]) == set(TRACE_FIELDS)
        layers = [s.decode() for s in f["profile/layer"][...]]
        assert layers == [str(i) for i in range(len(result.model))]
        assert f["profile/output_bytes"][0] == 32 * 4 * 8 * 8 * 4
    ckpts = list_checkpoints(out)
    assert ckpts == [checkpoint_path(out, steps)]


def test_pandas_and_xarray_read_it(tmp_path: Path) -> None:
    pd = pytest.importorskip("pandas")
    out = tmp_path / "r.h5"
    run(load_config("digits-mlp", ["train.steps=5"]), out=out)
    with h5py.File(out, "r") as f:
        frame = pd.DataFrame({k: f["metrics"][k][...] for k in f["metrics"]})
    assert list(frame["step"]) == [1, 2, 3, 4, 5]


def test_run_file_is_never_overwritten(tmp_path: Path) -> None:
    out = tmp_path / "r.h5"
    out.write_bytes(b"precious")
    with pytest.raises(RunFileError, match="already exists"):
        RunFile.create(out, {}, 1)
    assert out.read_bytes() == b"precious"


def _ckpt(step: int, ranks: int = 1) -> Checkpoint:
    rng = np.random.default_rng(step)
    model = {"params": {"0.weight": rng.standard_normal((3, 4))},
             "optimizer": {"momentum_buffer/0": rng.standard_normal((3, 4))},
             "meta": {"optimizer": {"t": step}}}  # fmt: skip
    own = [({"bn.mean": np.full(2, 1.0 * r)}, {"random": {"dropout": {"state": step}}}) for r in range(ranks)]
    return Checkpoint(step=step, epoch=0, config="", placement="{}", pieces={"model": model}, ranks=own,
                      meta={"x": 1})  # fmt: skip


def test_checkpoint_round_trip_list_and_prune(tmp_path: Path) -> None:
    run_file = tmp_path / "r.h5"
    for step in (10, 20, 30):
        save_checkpoint(_ckpt(step), checkpoint_path(run_file, step))
    (tmp_path / "r.ckpt-00000040.h5.123.tmp").write_bytes(b"half")  # a write that never finished
    (tmp_path / "other.ckpt-00000050.h5").write_bytes(b"")  # another run's
    assert [p.name for p in list_checkpoints(run_file)] == [f"r.ckpt-000000{s}.h5" for s in (30, 20, 10)]
    back, want = load_checkpoint(checkpoint_path(run_file, 20)), _ckpt(20)
    for group in ("params", "optimizer"):
        for name, a in want.pieces["model"][group].items():
            np.testing.assert_array_equal(back.pieces["model"][group][name], a)
    assert back.pieces["model"]["meta"] == {"optimizer": {"t": 20}}
    assert back.step == 20 and back.meta == {"x": 1} and back.ranks[0][1]["random"]["dropout"]["state"] == 20
    prune_checkpoints(run_file, keep=2)
    assert [p.name for p in list_checkpoints(run_file)] == ["r.ckpt-00000030.h5", "r.ckpt-00000020.h5"]


def test_truncated_and_damaged_checkpoints_are_refused(tmp_path: Path) -> None:
    path = save_checkpoint(_ckpt(5), tmp_path / "r.ckpt-00000005.h5")
    data = path.read_bytes()
    truncated = tmp_path / "t.ckpt-00000005.h5"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"t\.ckpt-00000005\.h5 is damaged or truncated"):
        load_checkpoint(truncated)
    with h5py.File(path, "r+") as f:  # flip values behind the digest's back
        f["pieces/model/params/0.weight"][0, 0] += 1.0
    with pytest.raises(CheckpointError, match="do not match their SHA-256 digest"):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "none.h5")


WRITER = """
import sys, numpy as np
from hpcdl.store.checkpoint import Checkpoint, save_checkpoint
# 800 MB: long enough to kill mid-write
big = {f"p{i}": np.full((1024, 1024), i, dtype=np.float64) for i in range(100)}
ck = Checkpoint(step=2, epoch=0, config="", placement="{}", pieces={"model": {"params": big}},
                ranks=[({}, {})])
print("writing", flush=True)
save_checkpoint(ck, sys.argv[1])
"""


def test_kill_during_a_checkpoint_write_keeps_the_previous_one(tmp_path: Path) -> None:
    run_file = tmp_path / "r.h5"
    save_checkpoint(_ckpt(1), checkpoint_path(run_file, 1))
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(checkpoint_path(run_file, 2))],
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline().strip() == "writing"
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob("*.tmp")) and time.monotonic() < deadline:
        time.sleep(0.01)
    tmps = list(tmp_path.glob("*.tmp"))
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert tmps, "the writer never started its temporary file"
    assert list_checkpoints(run_file) == [checkpoint_path(run_file, 1)]
    assert load_checkpoint(checkpoint_path(run_file, 1)).step == 1


def test_xarray_reads_the_metrics_group(tmp_path: Path) -> None:
    xr = pytest.importorskip("xarray")
    pytest.importorskip("h5netcdf")
    out = tmp_path / "r.h5"
    run(load_config("digits-mlp", ["train.steps=4"]), out=out)
    ds = xr.open_dataset(out, group="metrics", engine="h5netcdf", phony_dims="sort")
    assert list(ds["step"].values) == [1, 2, 3, 4] and set(ds.data_vars) == set(METRICS)
    ds.close()


FULL_DISK_WRITER = """
import os, resource, signal, sys
import h5py, numpy as np
from hpcdl.errors import FileError
from hpcdl.store import RunFile, RANK_SERIES

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
path = sys.argv[1]
run = RunFile.create(path, {"name": "x", "config": ""}, ranks=4)
step = 0

def append(n):
    global step
    rows = [{"step": step + k + 1, "loss": 1.0} for k in range(n)]
    run.append_rows(rows, {s: np.ones((n, 4)) for s in RANK_SERIES})
    step += n

append(100)
# the disk fills up: the file may grow by 150 kB more (less than the next chunks take)
resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize(path) + 150_000, resource.RLIM_INFINITY))
try:
    while True:  # rows fill the first chunks in place; a new chunk needs space
        append(100)
except FileError as err:
    print(step, err)
run.close()
"""


def test_a_full_disk_keeps_every_flushed_row(tmp_path: Path) -> None:
    """A write that fails (the file may not grow) leaves a file that opens, with every flushed row."""
    path = tmp_path / "full.h5"
    proc = subprocess.run([sys.executable, "-c", FULL_DISK_WRITER, str(path)], capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    flushed, message = proc.stdout.split(" ", 1)
    assert "cannot write run file" in message and "File too large" in message, message
    assert int(flushed) >= 1000  # a chunk holds 1024 rows: the first new one did not fit
    with h5py.File(path, "r") as f:
        np.testing.assert_array_equal(f["metrics/step"][...], np.arange(1, int(flushed) + 1))
        assert f["ranks/other_time"].shape == (int(flushed), 4)


OLDER_FILE = """
import os, resource, signal, sys
import h5py, numpy as np
from hpcdl.errors import FileError
from hpcdl.store import RunFile, RANK_SERIES

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
path, ranks, rows = sys.argv[1], 200, 500
run = RunFile.create(path, {"name": "x", "config": "", "ranks": ranks}, ranks=ranks)
run.append_rows([{"step": k + 1} for k in range(rows)], {s: np.ones((rows, ranks)) for s in RANK_SERIES})
run.close()
with h5py.File(path, "r+") as f:
    del f["ranks/other_time"]  # as an hpcdl before the series wrote it
run = RunFile.resume(path, rows, ranks)  # recreates the series: its rows have no chunks on disk
limit = os.path.getsize(path) + (1 << 20) + 300_000  # the slack and more, less than the new chunk
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
try:
    new = [{"step": rows + k + 1} for k in range(10)]
    run.append_rows(new, {s: np.ones((10, ranks)) for s in RANK_SERIES})
    print("written")
except FileError as err:
    print("refused", err)
run.close()
"""


def test_a_full_disk_on_a_resumed_older_run_file_keeps_it(tmp_path: Path) -> None:
    """The new other_time series (1.6 MB a chunk at 200 ranks) is counted before writing."""
    path = tmp_path / "older.h5"
    proc = subprocess.run([sys.executable, "-c", OLDER_FILE, str(path)], capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip
    assert proc.returncode == 0 and proc.stdout.startswith("refused"), proc.stdout + proc.stderr
    assert "Exception ignored" not in proc.stderr, proc.stderr
    with h5py.File(path, "r") as f:
        assert f["metrics/step"].shape == (500,) and f["ranks/other_time"].shape == (500, 200)
