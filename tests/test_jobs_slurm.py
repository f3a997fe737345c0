"""jobs/slurm/train.sbatch under a real one-node Slurm, started here (munged, slurmctld, slurmd).

Needs root and Debian's ``slurm-wlm`` and ``munge`` (``.ci/run`` installs them); elsewhere
the tests skip, and ``jobs/test/fake-scheduler.sh`` (tests/test_jobs.py) covers the script
without a scheduler. Everything the cluster writes (munge key, slurm.conf, state, spool,
logs, the submission directory) is in a temporary directory, removed afterwards
(``HPCDL_TEST_KEEP=1`` keeps it). ``HPCDL_TEST_SLURM=require`` (set by ``.ci/run``) turns a
skip into a failure, so that CI cannot pass without running them.

The cluster: one node with this machine's CPUs, ``MpiDefault=pmi2`` (what PyPI's MPICH
needs; the job script also passes ``--mpi`` from ``jobs/site.sh``), ``cred_expire=10``
and ``sched_interval=2`` so that a requeued job starts again about ten seconds later,
``proctrack/linuxproc`` and ``task/none`` (no cgroups needed).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import h5py
import pytest

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(sys.executable).parent.parent
TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "squeue", "sinfo")
# the daemons are in sbin, which a non-login PATH may lack
PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/local/sbin", "/usr/sbin", "/sbin"])
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
            "DEADLINE"}  # fmt: skip

# The requeue chain: a 1-minute job with the warning 10 s before the end (--signal=B:USR1@10).
# slurmctld looks at time limits every 30 s and sends the warning at the first look that is
# less than 30 s + 10 s before the end: 20 to 50 s after the start (about 48 s for a requeued
# job, which starts about 12 s after the look that stopped it). The training is about 55 s of
# work at 2 ranks on an idle 2-core machine, and the reference run shares the cores with the
# first allocation, so it cannot finish in one allocation and needs at least one requeue; a
# loaded machine only adds requeues.
CHAIN_STEPS = 7000
CHAIN_SETS = ["--set", "model.width=1024", "--set", "data.batch_size=64",
              "--set", f"train.steps={CHAIN_STEPS}", "--set", f"train.eval_every={CHAIN_STEPS}",
              "--set", "train.log_every=1000", "--set", "checkpoint.every=0"]  # fmt: skip


def _unavailable(reason: str) -> None:
    if os.environ.get("HPCDL_TEST_SLURM") == "require":
        pytest.fail(f"real Slurm required (HPCDL_TEST_SLURM=require) but {reason}")
    pytest.skip(reason)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Cluster:
    """A running one-node Slurm: its directory, the clients' environment, the submission directory."""

    dir: Path
    env: dict[str, str]
    submit: Path

    def run(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=60, check=check,
                              cwd=self.submit)  # fmt: skip

    def sbatch(self, *args: str, env: dict[str, str] | None = None) -> int:
        """Submit from the submission directory (as a user does from the checkout); the job id."""
        env = {**self.env, **(env or {})}
        proc = subprocess.run(["sbatch", "--parsable", *args], env=env, cwd=self.submit, capture_output=True,
                              text=True, timeout=60, check=False)  # fmt: skip
        assert proc.returncode == 0, f"sbatch {' '.join(args)}: {proc.stderr.strip()}"
        return int(proc.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, ExitCode, Restarts, StdOut, ...)."""
        out = self.run("scontrol", "show", "job", "-o", str(job_id)).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait(self, job_id: int, timeout: float) -> dict[str, str]:
        """Wait until the job has ended for good (a requeued job passes through PENDING)."""
        deadline = time.monotonic() + timeout
        while True:
            fields = self.job(job_id)
            if fields.get("JobState") in TERMINAL:
                return fields
            if time.monotonic() > deadline:
                self.run("scancel", str(job_id), check=False)
                pytest.fail(f"job {job_id} not ended after {timeout:.0f} s: {fields.get('JobState')}\n"
                            f"{self.log(fields)[-3000:]}")  # fmt: skip
            time.sleep(1)

    def wait_for_text(self, job_id: int, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            fields = self.job(job_id)
            if text in self.log(fields):
                return
            if fields.get("JobState") in TERMINAL:
                break
            time.sleep(0.1)
        pytest.fail(f"{text!r} never appeared in job {job_id}'s output\n{self.log(self.job(job_id))[-3000:]}")

    def log(self, fields: dict[str, str]) -> str:
        path = Path(fields.get("StdOut", ""))
        return path.read_text(errors="replace") if path.is_file() else ""


def _start(tmp: Path, procs: list[subprocess.Popen[bytes]]) -> Cluster:  # noqa: PLR0915
    """Start munged, slurmctld and slurmd (appended to ``procs``) with their files in ``tmp``."""
    logs = tmp / "log"
    logs.mkdir()

    def daemon(name: str, *cmd: str) -> None:
        with open(logs / f"{name}.out", "wb") as out:
            exe = shutil.which(cmd[0], path=PATH) or cmd[0]
            procs.append(subprocess.Popen([exe, *cmd[1:]], stdout=out, stderr=subprocess.STDOUT,
                                          start_new_session=True))  # fmt: skip

    munge = tmp / "munge"
    munge.mkdir(mode=0o755)
    keydir = tmp / "munge-key"
    keydir.mkdir(mode=0o700)
    key = keydir / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    sock = munge / "munge.socket"
    daemon("munged", "munged", "-F", "--force", f"--socket={sock}", f"--key-file={key}",
           f"--pid-file={munge / 'munged.pid'}", f"--log-file={logs / 'munged.log'}",
           f"--seed-file={munge / 'munged.seed'}")  # fmt: skip
    deadline = time.monotonic() + 20
    while not sock.exists():
        if time.monotonic() > deadline or procs[0].poll() is not None:
            _unavailable(f"munged did not start: {(logs / 'munged.out').read_text()[-500:]}")
        time.sleep(0.1)

    host = socket.gethostname().split(".")[0]
    for sub in ("state", "spool"):
        (tmp / sub).mkdir()
    conf = tmp / "slurm.conf"
    conf.write_text(
        "\n".join([
            "ClusterName=hpcdltest",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={sock},cred_expire=10",
            f"StateSaveLocation={tmp / 'state'}",
            f"SlurmdSpoolDir={tmp / 'spool'}",
            f"SlurmctldPidFile={tmp / 'slurmctld.pid'}",
            f"SlurmdPidFile={tmp / 'slurmd.pid'}",
            f"SlurmctldLogFile={logs / 'slurmctld.log'}",
            f"SlurmdLogFile={logs / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/builtin",
            "SchedulerParameters=sched_interval=2",
            "MpiDefault=pmi2",
            # job ids that differ between runs: MPICH names its shared-memory segment after the PMI
            # world (job.step under pmi2) and leaves it behind when a step is killed (as the walltime
            # test does); a later run's job 3 opened the stale /dev/shm/mpich_shm_* of an earlier
            # one and MPI_Init failed ("Message ... truncated" in MPIDI_UCX_comm_set_vcis)
            f"FirstJobId={secrets.randbelow(50_000_000) + 1000}",
            "ReturnToService=2",
            "MinJobAge=900",
            "MailProg=/bin/true",
            f"NodeName={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count() or 1} State=UNKNOWN",
            f"PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP",
            "",
        ])
    )  # fmt: skip
    daemon("slurmctld", "slurmctld", "-D", "-i", "-f", str(conf))
    daemon("slurmd", "slurmd", "-D", "-f", str(conf))

    submit = tmp / "submit"  # a stand-in for the checkout: jobs/ and the runs/ every checkout has
    submit.mkdir()
    (submit / "jobs").symlink_to(ROOT / "jobs")
    (submit / "runs").mkdir()
    shutil.copy(ROOT / "runs" / ".gitignore", submit / "runs" / ".gitignore")
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SRUN_", "SBATCH_", "PMI_"))}
    env = {**keep, "PATH": PATH, "SLURM_CONF": str(conf), "HPCDL_VENV": str(VENV),
           "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}  # fmt: skip
    cluster = Cluster(tmp, env, submit)
    deadline = time.monotonic() + 60
    while True:
        state = cluster.run("sinfo", "-h", "-N", "-o", "%T", check=False).stdout.strip()
        if state == "idle":
            return cluster
        dead = [p.args[0] for p in procs if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            tails = "; ".join(f"{f.name}: {f.read_text(errors='replace')[-400:]}"
                              for f in sorted(logs.iterdir()))  # fmt: skip
            _unavailable(f"the one-node Slurm did not come up (node {state or '?'}, exited: {dead}): {tails}")
        time.sleep(0.5)


def _stop(cluster: Cluster | None, procs: list[subprocess.Popen[bytes]]) -> None:
    """Cancel the cluster's jobs, then stop its daemons (slurmd, slurmctld, munged)."""
    if cluster is not None:
        ids = cluster.run("squeue", "-h", "-o", "%i", check=False).stdout.split()
        if ids:
            cluster.run("scancel", *ids, check=False)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and cluster.run("squeue", "-h", check=False).stdout.strip():
                time.sleep(1)
    for proc in reversed(procs):
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.fixture(scope="module")
def slurm() -> Iterator[Cluster]:
    """A one-node Slurm for this module's tests, stopped and removed afterwards."""
    missing = [tool for tool in TOOLS if shutil.which(tool, path=PATH) is None]
    if missing:
        _unavailable(f"Slurm is not installed (no {', '.join(missing)}): apt-get install slurm-wlm munge")
    if os.geteuid() != 0:
        _unavailable("slurmd must run as root to start jobs (as in CI)")
    tmp = Path(tempfile.mkdtemp(prefix="hpcdl-slurm-"))
    cluster, procs = None, []
    try:
        cluster = _start(tmp, procs)
        yield cluster
    finally:
        _stop(cluster, procs)
        if os.environ.get("HPCDL_TEST_KEEP") == "1":
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def _params(checkpoint: Path) -> dict[str, bytes]:
    with h5py.File(checkpoint, "r") as f:
        params = f["pieces/model/params"]
        return {name: params[name][()].tobytes() for name in params}


def test_ranks_started_without_pmi_are_refused(slurm: Cluster) -> None:
    """srun --mpi=none starts two one-rank MPI worlds: each refuses with the same one line, exit 2."""
    job = slurm.sbatch("-n", "2", "--time=2", "--job-name=nopmi", "jobs/slurm/train.sbatch",
                       "--config", "digits-mlp", "--set", "train.steps=5",
                       env={"HPCDL_SRUN_MPI": "none"})  # fmt: skip
    fields = slurm.wait(job, timeout=120)
    log = slurm.log(fields)
    # the first task to refuse ends the step (--kill-on-bad-exit): the other exits 2 as well, or is
    # terminated first (143)
    assert fields["JobState"] == "FAILED" and fields["ExitCode"] in ("2:0", "143:0"), log
    # one line per task, or one for both when they exit together ("tasks 0-1")
    exited = r"^srun: error: \S+: (task [01]|tasks 0-1): Exited with exit code 2$"
    assert re.search(exited, log, re.MULTILINE), log
    assert "+ srun --mpi=none --kill-on-bad-exit=1 --ntasks=2 python -m hpcdl.train" in log
    refusals = {line for line in log.splitlines() if line.startswith("hpcdl.train: error:")}
    assert len(refusals) == 1, log  # one line, the same from each task
    (line,) = refusals
    assert "srun started 2 processes (SLURM_STEP_NUM_TASKS=2) but MPI sees 1 rank" in line
    assert "--mpi=pmi2" in line and "HPCDL_SRUN_MPI" in line
    assert "Traceback" not in log and not re.search(r"^step \d", log, re.MULTILINE)  # refused before training
    assert not (slurm.submit / "runs" / "nopmi.h5").exists()


def test_a_warning_while_the_ranks_start_is_held_until_they_can_take_it(slurm: Cluster) -> None:
    """USR1 before the ranks have their handlers: held, then a clean stop with a checkpoint (not exit 138)."""
    slow = slurm.dir / "slow-start"  # python that takes 3 s to start, as on a slow shared file system
    slow.mkdir(exist_ok=True)
    (slow / "sitecustomize.py").write_text("import time\n\ntime.sleep(3)\n")
    job = slurm.sbatch("-n", "2", "--time=5", "--job-name=early", "jobs/slurm/train.sbatch",
                       "--config", "digits-mlp", "--set", "train.steps=100000", "--set", "checkpoint.every=0",
                       env={"PYTHONPATH": str(slow), "HPCDL_REQUEUE": "0"})  # fmt: skip
    slurm.wait_for_text(job, "+ srun ", timeout=120)
    slurm.run("scancel", "--batch", "--signal=USR1", str(job))  # what --signal=B:USR1 sends
    fields = slurm.wait(job, timeout=180)
    log = slurm.log(fields)
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", log
    assert "before the ranks can take it: holding it" in log
    assert "ranks ready: forwarding the held SIGUSR1" in log
    assert "step exit 0, run status stopped, after SIGUSR1" in log  # the ranks' clean stop, read back
    assert list((slurm.submit / "runs").glob("early.ckpt-*.h5")), log
    assert "continue with: sbatch --job-name=early --ntasks=2 jobs/slurm/train.sbatch --config" in log


def test_walltime_warning_requeue_resume_is_bitwise_equal_to_one_run(slurm: Cluster, tmp_path: Path) -> None:
    """A 1-minute job whose training takes longer: warning, checkpoint, requeue, resume, until done."""
    args = ["--config", "digits-mlp", *CHAIN_SETS]
    # the reference, uninterrupted, at the same rank count, beside the chain: sharing the cores
    # with the first allocation, it also keeps the chain from finishing in one
    ref = tmp_path / "ref.h5"
    reference = subprocess.Popen(
        [str(VENV / "bin" / "mpiexec"), "-n", "2", sys.executable, "-m", "hpcdl.train", *args,
         "--progress", "none", "--out", str(ref)],
        env={k: v for k, v in slurm.env.items() if k != "SLURM_CONF"}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        # the chain starts once the reference trains (its run file exists), so that the reference
        # shares the cores with most of the chain's first allocation
        deadline = time.monotonic() + 120
        while not ref.exists() and reference.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ref.exists(), f"the reference wrote no run file in 120 s (exit status {reference.poll()})"
        # -n 2 overrides the script's --ntasks (with --ntasks-per-node=4 it could not fit 2 CPUs)
        job = slurm.sbatch("-n", "2", "--time=1", "--signal=B:USR1@10", "--job-name=chain",
                           "jobs/slurm/train.sbatch", *args)  # fmt: skip
        fields = slurm.wait(job, timeout=900)
        out, err = reference.communicate(timeout=600)
    finally:
        if reference.poll() is None:
            reference.kill()
            reference.communicate()
    log = slurm.log(fields)
    assert reference.returncode == 0, err
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", log[-4000:]
    restarts = int(fields["Restarts"])
    assert restarts >= 1, f"never requeued: the training fit in one allocation\n{log[-4000:]}"
    # every allocation but the last stopped at the warning with a checkpoint and was requeued
    # (the script's own lines), and every later one resumed (the run file's record)
    assert log.count("step exit 0, run status stopped, after SIGUSR1") == restarts, log[-4000:]
    assert log.count(f"+ scontrol requeue {job}") == restarts
    launch = "+ srun --mpi=pmi2 --kill-on-bad-exit=1 --ntasks=2 python -m hpcdl.train"
    assert log.count(launch) == restarts + 1
    assert log.count("run status finished") == 1
    runs = slurm.submit / "runs"
    with h5py.File(runs / "chain.h5", "r") as f:
        assert f.attrs["status"] == "finished" and f.attrs["ranks"] == 2
        assert len(f.attrs["resumed_at"]) == restarts
        assert f["metrics/step"][-1] == CHAIN_STEPS
    chain, whole = runs / f"chain.ckpt-{CHAIN_STEPS:08d}.h5", tmp_path / f"ref.ckpt-{CHAIN_STEPS:08d}.h5"
    a, b = _params(chain), _params(whole)
    assert a.keys() == b.keys() and a, (sorted(a), sorted(b))
    differ = [name for name in a if a[name] != b[name]]
    assert not differ, f"parameters differ from the uninterrupted run after {restarts} requeues: {differ}"
    # the job's log went to runs/ (kept in every checkout), nothing into the checkout's root
    assert Path(fields["StdOut"]) == runs / f"chain-{job}.out"
    assert sorted(p.name for p in slurm.submit.iterdir()) == ["jobs", "runs"]
    print(f"chain: {restarts} requeue(s); reference: {out.strip().splitlines()[-1] if out.strip() else ''}")


def _rank_pid(job_id: int, procid: int) -> int | None:
    """The pid of the job's task ``procid`` (the rank's python: srun execs the command itself)."""
    want = {f"SLURM_JOB_ID={job_id}".encode(), f"SLURM_PROCID={procid}".encode()}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = set((proc / "environ").read_bytes().split(b"\0"))
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:  # gone, or not ours to read
            continue
        if want <= environ and b"hpcdl.train" in cmdline and b"srun" not in cmdline.split(b"\0")[0]:
            return int(proc.name)
    return None


def _shm_segments(pid: int) -> set[str]:
    """The MPICH shared-memory segments a process has mapped."""
    maps = Path(f"/proc/{pid}/maps").read_text()
    return {m.split(" (deleted)")[0] for m in re.findall(r"/dev/shm/mpich_shm_\S+", maps)}


def test_a_killed_rank_ends_the_job_within_seconds(slurm: Cluster) -> None:
    """SIGKILL a rank mid-run (as the OOM killer does): the job ends within 10 s, names it, drops its shm."""
    job = slurm.sbatch("-n", "2", "--time=5", "--job-name=killed", "jobs/slurm/train.sbatch",
                       "--config", "digits-mlp", "--set", "train.steps=1000000",
                       "--set", "checkpoint.every=0", "--set", "train.log_every=50",
                       env={"HPCDL_REQUEUE": "0"})  # fmt: skip
    slurm.wait_for_text(job, "\nstep ", timeout=180)  # training, past MPI_Init and the handlers
    pid = _rank_pid(job, 1)
    assert pid is not None, f"no python process of job {job} with SLURM_PROCID=1"
    rank0 = _rank_pid(job, 0)
    assert rank0 is not None
    segments = _shm_segments(rank0) | _shm_segments(pid)
    assert segments, "the ranks map no /dev/shm/mpich_shm_* segment: nothing to test the cleanup with"
    # rank 1 stops first, so that rank 0 is left waiting for it in a communication, as in the
    # issue's hang: nothing in MPICH notices the death then. Killed while rank 0 reads its memory
    # (large messages go by process_vm_readv), rank 0 would get an MPI error and hpcdl would abort
    # the job by itself, the script untested.
    os.kill(pid, signal.SIGSTOP)
    time.sleep(1)
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    while (fields := slurm.job(job)).get("JobState") not in TERMINAL and time.monotonic() - killed < 60:
        time.sleep(0.1)
    seconds = time.monotonic() - killed
    log = slurm.log(fields)
    print(f"killed rank 1 (pid {pid}): job {job} {fields.get('JobState')} after {seconds:.1f} s")
    assert fields.get("JobState") == "FAILED", log[-3000:]
    assert seconds < 10, f"job {job} took {seconds:.1f} s to end after rank 1 was killed\n{log[-3000:]}"
    assert re.search(r"^srun: error: \S+: task 1: Killed$", log, re.MULTILINE), log[-3000:]
    # srun names the killed task, then the others it killed in turn; the script's line names the first
    assert re.search(r"^\S+ \S+ step exit 137, run status \w+, first failed: rank 1 on \S+ \(Killed\)$", log,
                     re.MULTILINE), log[-3000:]  # fmt: skip
    left = sorted(s for s in segments if Path(s).exists())
    assert not left, f"job {job} left its shared-memory segments behind: {left}\n{log[-3000:]}"
