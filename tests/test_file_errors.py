"""File-system errors of train, report, bench and simulate: one line naming the path, exit 2, nothing lost.

Each case runs the real command in a subprocess: without the capabilities that let root
ignore permissions (``CAP_DAC_OVERRIDE`` and ``CAP_DAC_READ_SEARCH``, dropped from the
bounding set before the command starts) for a read-only directory, with ``RLIMIT_FSIZE`` standing in
for a full disk (``SIGXFSZ`` ignored, so that a write fails with EFBIG instead of
killing the process), and with a path component that is a file. A file an earlier run
left where the command writes must be kept as it was.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import h5py
import numpy as np
import pytest

from hpcdl.store.runfile import RunFile

OLD = b"an earlier run's output\n"


#: prctl(2) option and capability(7) numbers
_PR_CAPBSET_DROP, _CAP_DAC_OVERRIDE, _CAP_DAC_READ_SEARCH = 24, 1, 2


#: runs ``python -m MODULE ARGS`` once writes past LIMIT bytes fail with EFBIG (a "full disk"):
#: MPI starts first, as it does when the command imports it (its shared memory is not the disk)
FULL_DISK = """
import resource, runpy, signal, sys
import hpcdl.comm.mpi
module, limit = sys.argv[1], int(sys.argv[2])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
sys.argv = [module, *sys.argv[3:]]
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


def _preexec(unprivileged: bool) -> Callable[[], None]:
    """What the child does before it runs the command (after fork, before exec)."""

    def setup() -> None:
        if unprivileged and os.geteuid() == 0:  # root after exec: only the capabilities left in the set
            libc = ctypes.CDLL(None, use_errno=True)
            for cap in (_CAP_DAC_OVERRIDE, _CAP_DAC_READ_SEARCH):
                if libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
                    raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")

    return setup


@pytest.fixture(scope="module")
def place() -> Iterator[Path]:
    """A directory every user can use, with a warm matplotlib cache (so that it writes nothing)."""
    root = Path(tempfile.mkdtemp(prefix="hpcdl-fs-", dir="/tmp"))
    root.chmod(0o777)
    (root / "mpl").mkdir(mode=0o777)
    env = {**os.environ, "MPLCONFIGDIR": str(root / "mpl")}
    subprocess.run([sys.executable, "-c", "import matplotlib.pyplot"], env=env, check=True)
    for path in [root / "mpl", *(root / "mpl").rglob("*")]:
        path.chmod(0o777 if path.is_dir() else 0o666)
    if os.geteuid() == 0:
        (root / "ro").mkdir(mode=0o555)
        probe = subprocess.run(
            [sys.executable, "-c", f"open({str(root / 'ro' / 'x')!r}, 'w')"],
            preexec_fn=_preexec(True),
            capture_output=True,
            check=False,
        )
        if b"PermissionError" not in probe.stderr:
            shutil.rmtree(root)
            pytest.skip(f"cannot run a command as an unprivileged user here: {probe.stderr[-200:]!r}")
    else:
        (root / "ro").mkdir(mode=0o555)
    yield root
    (root / "ro").chmod(0o755)
    shutil.rmtree(root)


def _run(
    place: Path,
    argv: list[str],
    *,
    unprivileged: bool = False,
    fsize: int | None = None,
    cwd: Path | None = None,
):
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
           "MPLCONFIGDIR": str(place / "mpl"), "HOME": str(place)}  # fmt: skip
    command = ["-m", *argv] if fsize is None else ["-c", FULL_DISK, argv[0], str(fsize), *argv[1:]]
    return subprocess.run(
        [sys.executable, *command],
        preexec_fn=_preexec(unprivileged),
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=cwd or place,
        check=False,
    )


def _one_line(done: subprocess.CompletedProcess, path: Path, reason: str) -> str:
    """The command failed with status 2 and exactly one line on stderr naming ``path`` and ``reason``."""
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert str(path) in lines[0] and reason in lines[0], lines[0]
    assert "Traceback" not in done.stderr
    return lines[0]


def _kept(path: Path, content: bytes = OLD) -> None:
    """An earlier file is as it was, and no temporary file was left beside it."""
    assert path.read_bytes() == content
    assert not [p for p in path.parent.iterdir() if ".tmp" in p.name]


@pytest.fixture(scope="module")
def run_file(place: Path) -> Path:
    path = place / "run.h5"
    rows = [{"step": k, "time": 0.1 * k, "loss": 1.0 / k, "test_accuracy": 0.5} for k in range(1, 5)]
    with RunFile.create(path, {"name": "mlp", "world": "mpi", "ranks": 2}, ranks=2) as run:
        run.append_metrics(rows)
        run.append_ranks({s: np.full((4, 2), 1e-3) for s in run.h5["ranks"]})
        run.set_attrs(status="finished")
    path.chmod(0o644)
    return path


@pytest.fixture
def a_file(place: Path) -> Path:
    path = place / "notes.txt"
    path.write_text("not a directory\n")
    return path


def _old(path: Path, content: bytes = OLD) -> Path:
    """Put an earlier run's output at ``path`` (in a read-only directory too)."""
    parent = path.parent
    mode = parent.stat().st_mode & 0o777
    parent.chmod(0o755)
    path.write_bytes(content)
    path.chmod(0o644)
    parent.chmod(mode)
    return path


# -- train -----------------------------------------------------------------------------------

TRAIN = ["hpcdl.train", "--config", "digits-mlp", "--set", "train.steps=30", "--progress", "none"]


def test_train_in_a_read_only_working_directory(place: Path) -> None:
    done = _run(place, TRAIN, unprivileged=True, cwd=place / "ro")  # the default --out: runs/NAME-TIME.h5
    line = _one_line(done, Path("runs"), "Permission denied")
    assert "cannot create directory runs" in line and "--out" in line, line


def test_train_out_under_a_read_only_parent(place: Path) -> None:
    done = _run(place, [*TRAIN, "--out", str(place / "ro" / "sub" / "r.h5")], unprivileged=True)
    _one_line(done, place / "ro" / "sub", "Permission denied")


def test_train_out_in_a_read_only_directory(place: Path) -> None:
    out = place / "ro" / "r.h5"
    done = _run(place, [*TRAIN, "--out", str(out)], unprivileged=True)
    line = _one_line(done, out, "Permission denied")
    assert "cannot create run file" in line and "flags" not in line, line  # no raw HDF5 text
    assert not out.exists()


def test_train_out_under_a_file(place: Path, a_file: Path) -> None:
    done = _run(place, [*TRAIN, "--out", str(a_file / "r.h5")])
    _one_line(done, a_file, "Not a directory")


def test_train_on_a_full_disk_keeps_the_run_file_and_the_earlier_checkpoints(place: Path) -> None:
    """A checkpoint (2.4 MB at width 512) no longer fits: the earlier state stays usable."""
    out = place / "full" / "t.h5"
    out.parent.mkdir(exist_ok=True)
    sets = ["--set", "train.steps=40", "--set", "checkpoint.every=10", "--set", "model.width=64",
            "--set", "log.flush_every=5"]  # fmt: skip
    first = _run(place, [*TRAIN, *sets, "--set", "train.stop_at=10", "--out", str(out)])
    assert first.returncode == 0, first.stderr
    kept = {p: p.read_bytes() for p in out.parent.glob("t.ckpt-*.h5")}
    assert len(kept) == 1
    # the run file (about 1.2 MB with its reserve) fits in 1.5 MB; the first checkpoint does not
    done = _run(place, [*TRAIN, *sets, "--set", "model.width=512", "--out", str(out.with_name("u.h5"))],
                fsize=1_500_000)  # fmt: skip
    line = _one_line(done, out.with_name("u.ckpt-00000010.h5"), "File too large")
    assert "earlier checkpoints are kept" in line, line
    with h5py.File(out.with_name("u.h5"), "r") as f:  # it opens, with every row flushed before the failure
        assert list(f["metrics/step"][...]) == list(range(1, 11))
    assert {p: p.read_bytes() for p in out.parent.glob("t.ckpt-*.h5")} == kept
    assert not list(out.parent.glob("*.tmp"))


def test_train_when_the_run_file_cannot_grow(place: Path) -> None:
    """The first flush of the run file fails: the file still opens (no rows yet), one line."""
    out = place / "full" / "v.h5"
    out.parent.mkdir(exist_ok=True)
    done = _run(place, [*TRAIN, "--out", str(out)], fsize=200_000)
    line = _one_line(done, out, "File too large")
    assert "rows up to the last flush are kept" in line, line
    with h5py.File(out, "r") as f:
        assert f["metrics/step"].shape == (0,) and f.attrs["status"] == "running"


# -- report ---------------------------------------------------------------------------------


def test_report_into_a_read_only_directory(place: Path, run_file: Path) -> None:
    old = _old(place / "ro" / "run-loss.png")
    done = _run(place, ["hpcdl.report", str(run_file), "--out", f"{place / 'ro'}/"], unprivileged=True)
    _one_line(done, old, "Permission denied")
    assert "run " in done.stdout  # the table was printed before the plots
    _kept(old)


def test_report_into_a_directory_it_cannot_create(place: Path, run_file: Path) -> None:
    out = f"{place / 'ro' / 'plots'}/"
    done = _run(place, ["hpcdl.report", str(run_file), "--out", out], unprivileged=True)
    _one_line(done, place / "ro" / "plots", "cannot create the plot directory")


def test_report_out_under_a_file(place: Path, run_file: Path, a_file: Path) -> None:
    done = _run(place, ["hpcdl.report", str(run_file), "--out", f"{a_file}/plots/"])
    _one_line(done, a_file / "plots", "Not a directory")


def test_report_on_a_full_disk_keeps_the_earlier_plot(place: Path, run_file: Path) -> None:
    out = place / "full"
    out.mkdir(exist_ok=True)
    old = _old(out / "run-loss.png")
    done = _run(place, ["hpcdl.report", str(run_file), "--out", f"{out}/"], fsize=4096)
    _one_line(done, old, "File too large")
    _kept(old)


def test_report_of_an_unreadable_run_file(place: Path, run_file: Path) -> None:
    private = place / "private.h5"
    shutil.copy(run_file, private)
    private.chmod(0o600)
    os.chown(private, 65534, 65534)  # another user's file (nobody's)
    done = _run(place, ["hpcdl.report", str(private)], unprivileged=True)
    _one_line(done, private, "Permission denied")


# -- bench --json -----------------------------------------------------------------------------

STEP = ["hpcdl.bench", "step", "--model", "mlp", "--batch", "4", "--repeat", "1", "--steps", "1"]


def test_bench_json_into_a_read_only_directory_fails_before_the_benchmark(place: Path) -> None:
    old = _old(place / "ro" / "step.json")
    done = _run(place, [*STEP, "--json", str(old)], unprivileged=True)
    _one_line(done, old, "Permission denied")
    assert "samples/s" not in done.stdout  # checked before an hour of benchmarking, not after
    _kept(old)


def test_bench_json_under_a_file(place: Path, a_file: Path) -> None:
    done = _run(place, [*STEP, "--json", str(a_file / "step.json")])
    _one_line(done, a_file / "step.json", "Not a directory")


def test_bench_json_on_a_full_disk_keeps_the_earlier_rows(place: Path) -> None:
    out = place / "full"
    out.mkdir(exist_ok=True)
    old = _old(out / "step.json")
    done = _run(place, [*STEP, "--json", str(old)], fsize=64)
    _one_line(done, old, "File too large")
    assert "samples/s" in done.stdout  # the table was shown; only the file failed
    _kept(old)


# -- simulate: bench calibrate --out, bench allreduce --calibrate --table, --json -----------------

# --compute none: the fit sees the network model alone, not this machine's load (the tests are
# about the file, and an 8 B against 64 KiB fit under a measured Python step can find no slope)
CALIBRATE = ["hpcdl.simulate", "-n", "2", "--compute", "none", "-m", "hpcdl.bench", "calibrate",
             "--sizes", "8", "64K", "--repeat", "1", "--min-time", "0.0001"]  # fmt: skip
TABLE = ["hpcdl.simulate", "-n", "2", "--compute", "none", "-m", "hpcdl.bench", "allreduce", "--calibrate",
         "--sizes", "4K", "--repeat", "1", "--min-time", "0.0001", "--algorithms", "ring", "mpi"]  # fmt: skip


def test_calibrate_out_into_a_read_only_directory(place: Path) -> None:
    old = _old(place / "ro" / "net.toml")
    done = _run(place, [*CALIBRATE, "--out", str(old)], unprivileged=True)
    _one_line(done, old, "Permission denied")
    _kept(old)


def test_calibrate_out_on_a_full_disk_keeps_the_earlier_file(place: Path) -> None:
    out = place / "full"
    out.mkdir(exist_ok=True)
    old = _old(out / "net.toml")
    done = _run(place, [*CALIBRATE, "--out", str(old)], fsize=200)
    _one_line(done, old, "File too large")
    _kept(old)


def test_calibrated_table_into_a_read_only_directory(place: Path) -> None:
    from hpcdl.comm.collectives.auto import AutoTable, merge, save_table

    save_table(merge(AutoTable(), 5, [(None, "ring")], {"note": "five ranks"}), place / "t.json")
    content = (place / "t.json").read_bytes()
    old = _old(place / "ro" / "table.json", content)
    old.chmod(0o666)  # writable in place, but it is replaced whole or not at all
    done = _run(place, [*TABLE, "--table", str(old)], unprivileged=True)
    _one_line(done, old, "Permission denied")
    _kept(old, content)


def test_calibrated_table_under_a_file(place: Path, a_file: Path) -> None:
    done = _run(place, [*TABLE, "--table", str(a_file / "table.json")])
    _one_line(done, a_file / "table.json", "Not a directory")


def test_simulated_bench_json_on_a_full_disk(place: Path) -> None:
    out = place / "full"
    out.mkdir(exist_ok=True)
    old = _old(out / "rows.json")
    argv = ["hpcdl.simulate", "-n", "3", "--compute", "none", "-m", "hpcdl.bench", "allreduce",
            "--sizes", "4K", "--repeat", "1", "--min-time", "0.0001", "--json", str(old)]  # fmt: skip
    done = _run(place, argv, fsize=100)
    _one_line(done, old, "File too large")
    _kept(old)


def test_simulate_with_an_unreadable_cost_table(place: Path) -> None:
    table = place / "costs.toml"
    table.write_text('[[layers]]\nlayer = "0"\nforward_s = 1e-4\nbackward_s = 1e-4\n')
    table.chmod(0o600)
    os.chown(table, 65534, 65534)  # nobody's, unreadable to others
    argv = ["hpcdl.simulate", "-n", "2", "--compute", f"table:{table}", "-m", "hpcdl.train", "--config",
            "digits-mlp", "--set", "train.steps=1"]  # fmt: skip
    done = _run(place, argv, unprivileged=True)
    _one_line(done, table, "cannot read the compute table")
