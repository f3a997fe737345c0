"""The Slurm and PBS job scripts, run under a fake scheduler (jobs/test/fake-scheduler.sh).

The harness stubs srun/scontrol/qsub/qstat, sends the walltime warning to the batch
shell and checks that it reaches every rank, that a stopped run is requeued or
resubmitted exactly once, and (HPCDL_TEST_REAL=1) that the real trainer resumes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_job_scripts_under_a_fake_scheduler() -> None:
    env = {**os.environ, "HPCDL_TEST_REAL": "1", "HPCDL_TEST_VENV": str(Path(sys.executable).parent.parent)}
    proc = subprocess.run(["bash", str(ROOT / "jobs/test/fake-scheduler.sh")], capture_output=True, text=True,
                          timeout=600, env=env, check=False)  # fmt: skip
    # the failed checks with the lines after each (what the harness shows of them), then the end
    lines = proc.stdout.splitlines()
    failed = ["\n".join(lines[i : i + 8]) for i, ln in enumerate(lines) if ln.lstrip().startswith("FAIL ")]
    assert proc.returncode == 0, "\n".join(failed) + "\n...\n" + proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "fake-scheduler: all checks passed" in proc.stdout
    assert " FAIL " not in proc.stdout
