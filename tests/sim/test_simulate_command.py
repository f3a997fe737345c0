"""``python -m hpcdl.simulate``: the commands run unchanged on virtual ranks; run files say so."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest

from hpcdl.simulate import EXIT_DEADLOCK, main

TRAIN = ["-m", "hpcdl.train", "--config", "digits-mlp", "--set", "train.steps=6", "--progress", "none"]


def test_simulated_training_writes_a_run_file_of_the_simulated_world(tmp_path: Path) -> None:
    out = tmp_path / "sim.h5"
    assert main(["-n", "4", "--network", "ib-hdr", "--compute", "none", *TRAIN, "--out", str(out)]) == 0
    with h5py.File(out) as f:
        assert f.attrs["world"] == "sim" and f.attrs["ranks"] == 4 and f.attrs["status"] == "finished"
        assert json.loads(f.attrs["network"])["name"] == "ib-hdr"
        assert json.loads(f.attrs["compute"])["mode"] == "none"
        assert f.attrs["peak_rss_mb"] > 0
        assert f["ranks/comm_time"].shape == (6, 4)
        assert (f["metrics/step_time"][...] > 0).all()  # messages take virtual time even with no compute


def test_the_network_files_contention_is_applied_to_measured_compute_and_recorded(tmp_path: Path) -> None:
    net = tmp_path / "node.toml"
    net.write_text(
        "ranks_per_node = 2\n[intra]\nlatency_us = 1\nbandwidth_GBps = 5\n"
        "[inter]\nlatency_us = 2\nbandwidth_GBps = 5\n[compute]\ncontention = [1.0, 1.25]\n"
    )
    out = tmp_path / "m.h5"
    assert main(["-n", "3", "--network", str(net), *TRAIN, "--set", "train.steps=1", "--out", str(out)]) == 0
    with h5py.File(out) as f:
        compute = json.loads(f.attrs["compute"])
        assert compute["mode"] == "measured"
        assert compute["contention"]["factor_by_ranks_on_node"] == {"1": 1.0, "2": 1.25}
        assert json.loads(f.attrs["network"])["compute"] == {"contention": [1.0, 1.25]}
    out = tmp_path / "n.h5"
    assert main(["-n", "3", "--network", str(net), "--compute", "none", *TRAIN, "--out", str(out)]) == 0
    with h5py.File(out) as f:
        assert json.loads(f.attrs["compute"]) == {"mode": "none"}


def test_no_compute_gives_the_same_metrics_bit_for_bit(tmp_path: Path) -> None:
    runs = []
    for k in range(2):
        out = tmp_path / f"r{k}.h5"
        assert main(["-n", "3", "--compute", "none", *TRAIN, "--out", str(out)]) == 0
        with h5py.File(out) as f:
            runs.append({name: f["metrics"][name][...] for name in f["metrics"]})
    for name in runs[0]:
        np.testing.assert_array_equal(runs[0][name], runs[1][name], err_msg=name)


def test_simulated_bench_writes_the_same_rows_as_a_real_one(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    argv = ["-n", "3", "--compute", "none", "-m", "hpcdl.bench", "allreduce", "--sizes", "4K",
            "--repeat", "1", "--min-time", "0.0001", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    rows = json.loads(out.read_text())
    # shm-local: one node with a memory rate, so "shm" is timed, as on one real node
    assert {r["algorithm"] for r in rows} == {"ring", "doubling", "rabenseifner", "mpi", "shm", "auto"}
    assert all(r["ranks"] == 3 and r["time_s"] > 0 and "busbw_GBps" in r for r in rows)
    where = rows[0]["machine"]  # the simulator is the "MPI library", its ranks one process's
    assert where["mpi"] == "hpcdl.sim (virtual ranks)" and where["ranks"] == where["ranks_per_node"] == 3


def test_a_user_error_is_one_line_and_status_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["-n", "2", "-m", "hpcdl.train", "--config", "digits-mlp", "--set", "nope=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown config key 'nope'" in err[0]


def test_the_commands_help_is_printed_once(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["-n", "3", "-m", "hpcdl.train", "--help"]) == 0
    out = capsys.readouterr()
    assert out.out.count("usage: python -m hpcdl.train") == 1 and "Traceback" not in out.err


def test_bad_options_of_the_simulator_itself() -> None:
    from hpcdl.errors import ConfigError

    with pytest.raises(ConfigError, match=r"argument -n: expected a whole number above 0 \(got '0'\)"):
        main(["-n", "0", "-m", "hpcdl.train"])
    with pytest.raises(ConfigError, match="cannot import it"):
        main(["-n", "2", "-m", "hpcdl.no_such_command"])
    with pytest.raises(ConfigError, match="--straggler takes RANK:FACTOR"):
        main(["-n", "2", "--straggler", "1", "-m", "hpcdl.train"])
    with pytest.raises(ConfigError, match="outside"):
        main(["-n", "2", "--straggler", "5:2", "-m", "hpcdl.train"])


@pytest.mark.parametrize(
    ("option", "value", "expected"),
    [
        ("--stall-s", "-1", "a number above 0"),
        ("--stall-s", "0", "a number above 0"),
        ("--stall-s", "nan", "a number above 0"),
        ("--poll-cost-us", "-1", "a number, 0 or more"),
        ("--poll-cost-us", "inf", "a number, 0 or more"),
    ],
)
def test_numbers_out_of_range_are_refused_in_one_line(option: str, value: str, expected: str) -> None:
    """``--stall-s -1`` was accepted (and ``nan`` a traceback): each refused by the option's type."""
    from hpcdl.errors import ConfigError

    with pytest.raises(ConfigError, match=rf"argument {option}: expected {expected} \(got '{value}'\)"):
        main(["-n", "2", option, value, *TRAIN])


def test_a_deadlocked_command_exits_3_with_the_waits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    module = tmp_path / "deadlocker.py"
    module.write_text(
        "import numpy as np\nimport hpcdl.comm as hc\n"
        "def main(argv):\n"
        "    c = hc.world()\n"
        "    c.Recv(np.zeros(1), source=(c.Get_rank() + 1) % c.Get_size(), tag=4)\n"
        "    return 0\n"
    )
    import sys

    sys.path.insert(0, str(tmp_path))
    try:
        assert main(["-n", "3", "--compute", "none", "-m", "deadlocker"]) == EXIT_DEADLOCK
    finally:
        sys.path.remove(str(tmp_path))
    err = capsys.readouterr().err
    assert "rank 2 at t=" in err and "a receive from rank 0, tag 4" in err


@pytest.mark.slow
def test_1024_virtual_ranks_train_digits_mlp(tmp_path: Path) -> None:
    """The scale case of the issue: 1,024 virtual ranks, random sampler, 10 steps (about 35 s here)."""
    out = tmp_path / "sim1024.h5"
    argv = ["-n", "1024", "--network", "ib-hdr", "-m", "hpcdl.train", "--config", "digits-mlp",
            "--set", "train.steps=10", "--set", "data.sampler=random", "--progress", "none",
            "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    with h5py.File(out) as f:
        assert f.attrs["ranks"] == 1024 and f.attrs["world"] == "sim" and f.attrs["status"] == "finished"
        assert f["ranks/compute_time"].shape == (10, 1024)
        print(f"\n1,024 virtual ranks: peak RSS {f.attrs['peak_rss_mb']:.0f} MiB")


def test_a_file_system_error_on_a_rank_is_one_line_and_status_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "notes.txt"
    blocker.write_text("a file, not a directory\n")
    out = blocker / "runs" / "sim.h5"
    assert main(["-n", "2", "--compute", "none", *TRAIN, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(blocker) in err[0] and "Traceback" not in err[0], err
    assert blocker.read_text() == "a file, not a directory\n"
