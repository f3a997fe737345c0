"""The stall watchdog ends hung MPI jobs: a receive deadlock, and a rank stopped with SIGSTOP.

Each test starts its own ``mpiexec`` (the job must end by itself: a hung one is killed by
the test's timeout, far beyond ``debug.stall_s``, and the test fails).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import pytest

BIN = Path(sys.executable).parent

DEADLOCK = """
import numpy as np
from hpcdl.driver.cli import entry
from hpcdl.comm import watch

def main(argv):
    with watch(2.0) as comm:
        comm.Barrier()
        buf = np.zeros(4)
        comm.Recv(buf, source=(comm.Get_rank() + 1) % comm.Get_size(), tag=7)  # everyone receives
    return 0

entry(main, "deadlock")
"""


def _env() -> dict[str, str]:
    return {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}


@pytest.mark.parametrize("n", [2, 3])
def test_a_receive_deadlock_is_reported_and_ends_the_job(tmp_path: Path, n: int) -> None:
    script = tmp_path / "deadlock.py"
    script.write_text(DEADLOCK)
    t0 = time.monotonic()
    proc = subprocess.run([str(BIN / "mpiexec"), "-n", str(n), sys.executable, str(script)],
                          capture_output=True, text=True, timeout=40, env=_env(), check=False)  # fmt: skip
    print(f"deadlock at -n {n}: the job ended after {time.monotonic() - t0:.1f} s (stall_s = 2)")
    assert proc.returncode == 3, proc.stderr
    assert "stall: every rank is waiting for another (a deadlock)" in proc.stderr, proc.stderr
    for r in range(n):
        assert f"rank {r} waits " in proc.stderr
        assert f"Recv from rank {(r + 1) % n} tag 7 on world" in proc.stderr
    assert proc.stderr.count("stall: ") == 1, proc.stderr  # one report, not one per rank


def _rank_pids(launcher: int) -> dict[int, int]:
    """The pids of the ranks started under ``launcher`` (by PMI_RANK in their environment)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"hpcdl.train" not in cmdline:
            continue
        env = dict(item.split(b"=", 1) for item in environ if b"=" in item)
        if env.get(b"HPCDL_TEST_LAUNCHER") == str(launcher).encode() and b"PMI_RANK" in env:
            found[int(env[b"PMI_RANK"])] = int(entry.name)
    return found


#: (id, settings, the ranks stopped in turn): every strategy and role under mpiexec -n 3
STOPPED = [
    ("sync", [], (1, 0, 2)),
    ("pipeline-1f1b", ["parallel.strategy=pipeline", "pipeline.schedule=1f1b"], (0, 1, 2)),
    ("pipeline-gpipe", ["parallel.strategy=pipeline", "pipeline.schedule=gpipe"], (1,)),
    ("ps-async", ["parallel.strategy=ps"], (0, 2, 1)),
    ("ps-ssp", ["parallel.strategy=ps", "ps.mode=ssp", "ps.staleness=1"], (2, 0)),
    ("ps-sync", ["parallel.strategy=ps", "ps.mode=sync", "train.steps=1000000"], (1,)),
    ("ps-2-servers", ["parallel.strategy=ps", "ps.servers=2"], (1, 2)),
]
#: cases of ``make test``: each role once (sync's worker; the first, a middle and the last stage; a
#: server, a second server, a worker, an ssp-held worker); the others (``make test-slow``) repeat a
#: role, or another schedule's or mode's same waits
REGULAR = {("sync", 1), ("pipeline-1f1b", 0), ("pipeline-1f1b", 1), ("pipeline-1f1b", 2), ("ps-async", 0),
           ("ps-async", 2), ("ps-ssp", 2), ("ps-2-servers", 1)}  # fmt: skip


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the ranks through /proc")
@pytest.mark.parametrize(
    ("settings", "stopped"),
    [
        pytest.param(sets, r, id=f"{name}-rank{r}", marks=() if (name, r) in REGULAR else pytest.mark.slow)
        for name, sets, ranks in STOPPED
        for r in ranks
    ],
)
def test_a_stopped_rank_is_named_and_the_job_ends(tmp_path: Path, settings: list[str], stopped: int) -> None:
    """SIGSTOP of one rank of a training job: the report names exactly that rank, lists what
    the others wait for, the job ends with status 3 within stall_s + 10 s, and the run file
    records it (``stalled`` and the report, when rank 0 can write; when rank 0 is the one
    stopped nobody can, and the report tells the run from its dead writer)."""
    from hpcdl.report import load, summarize

    stall_s = 4
    out, ready = tmp_path / "r.h5", tmp_path / "ready"
    sets = ["debug.stall_s=4", "train.steps=1000000", "checkpoint.every=0", *settings]
    cmd = [str(BIN / "mpiexec"), "-n", "3", sys.executable, "-m", "hpcdl.train", "--config", "digits-mlp",
           *(a for kv in sets for a in ("--set", kv)), "--progress", "none", "--out", str(out)]  # fmt: skip
    tag = str(os.getpid())
    env = {**_env(), "HPCDL_TEST_LAUNCHER": tag, "HPCDL_READY_FILE": str(ready)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    pid = None
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        pids = _rank_pids(int(tag))
        assert len(pids) == 3 and ready.exists(), f"ranks not found: {pids}; {proc.poll()}"
        time.sleep(3.0)  # the data, the model and the run file: training is under way
        assert proc.poll() is None, proc.communicate()
        pid = pids[stopped]
        os.kill(pid, signal.SIGSTOP)
        t_stop = time.monotonic()
        _, err = proc.communicate(timeout=stall_s + 40)
        ended = time.monotonic() - t_stop
        print(f"SIGSTOP of rank {stopped} ({' '.join(settings) or 'sync'}): the job ended {ended:.1f} s "
              f"later (stall_s = {stall_s})")  # fmt: skip
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        if pid is not None:
            for sig in (signal.SIGKILL, signal.SIGCONT):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
    assert proc.returncode == 3, err
    assert f"stall: rank {stopped} did not respond" in err, err
    waits = re.findall(r"rank (\d) waits [0-9.]+ s in ", err)
    assert sorted(int(r) for r in waits) == [r for r in range(3) if r != stopped], err  # each with its wait
    assert err.count("stall: ") == 1, err  # one report
    assert ended <= stall_s + 10, f"the report came {ended:.1f} s after the stop"
    row = summarize(load(out))
    if stopped == 0:
        assert row["state"] == "interrupted", row  # its writer is gone
    else:
        assert row["state"] == "stalled", row
        with h5py.File(out) as f:
            assert f"stall: rank {stopped} did not respond" in f.attrs["error"]


WITHDRAWN = """
import time
import numpy as np
from hpcdl.driver.cli import entry
from hpcdl.comm import long_wait, watch

def main(argv):
    with watch(2.0) as w:
        w.Barrier()
        buf = np.zeros(1)
        if w.Get_rank() == 0:
            w.Recv(buf, source=1, tag=1)  # 2.5 s late: rank 0 asks at 2 s, then its wait completes
            with long_wait("an idle server"):
                w.Recv(buf, source=2, tag=2)
        elif w.Get_rank() == 1:
            time.sleep(2.5)
            w.Send(buf, dest=0, tag=1)
            w.Recv(buf, source=2, tag=2)  # rank 2 never sends
        else:
            time.sleep(60)  # hung outside any communication
    return 0

entry(main, "withdrawn")
"""

SUBCOMM = """
import time
from hpcdl.driver.cli import entry
from hpcdl.comm import subcomm, watch

def main(argv):
    with watch(2.0) as w:
        w.Barrier()
        if w.Get_rank() == 1:
            time.sleep(60)  # hung outside any communication
        subcomm(w, [0, 1])
    return 0

entry(main, "subcomm")
"""


def _job(tmp_path: Path, program: str, n: int) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "program.py"
    script.write_text(program)
    return subprocess.run([str(BIN / "mpiexec"), "-n", str(n), sys.executable, str(script)],
                          capture_output=True, text=True, timeout=40, env=_env(), check=False)  # fmt: skip


def test_a_withdrawn_question_does_not_hide_the_rank_that_hangs(tmp_path: Path) -> None:
    """Rank 0 asks, then its wait completes (it withdraws); rank 1 stalls next: rank 2 is named."""
    proc = _job(tmp_path, WITHDRAWN, 3)
    assert proc.returncode == 3, proc.stderr
    assert "hpcdl: rank 0 waited" in proc.stderr and "and it completed" in proc.stderr, proc.stderr
    assert "stall: rank 2 did not respond" in proc.stderr, proc.stderr
    assert "rank 1 waits" in proc.stderr and "Recv from rank 2 tag 2" in proc.stderr, proc.stderr
    assert "rank 0 waits" in proc.stderr and "(by design: an idle server)" in proc.stderr, proc.stderr


def test_creating_a_sub_communicator_is_watched(tmp_path: Path) -> None:
    proc = _job(tmp_path, SUBCOMM, 2)
    assert proc.returncode == 3, proc.stderr
    assert "stall: rank 1 did not respond" in proc.stderr and "subcomm of ranks" in proc.stderr, proc.stderr
