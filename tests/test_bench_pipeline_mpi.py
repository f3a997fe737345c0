"""``bench pipeline`` under mpiexec (-n 2, -n 3): its rows (figures are not asserted: not a test).

The pipeline and the one process train the same samples: the same count, and their
samplers stand at the same place afterwards. That they then hold equal parameters is
``test_pipeline_mpi``'s.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from hpcdl.bench import main
from hpcdl.comm import world

TINY = ["model.name=mlp", "model.depth=4", "model.width=32", "data.batch_size=8"]
M, REPS, STEPS, WARMUP = 4, 2, 1, 1
KEYS = {"impl", "schedule", "stages", "balance", "microbatches", "batch_per_microbatch", "samples_per_step",
        "samples_per_s", "step_s", "samples", "sampler", "vs_one_process", "vs_torch", "repeat"}  # fmt: skip


@pytest.mark.mpi(min_size=2)
def test_rows_per_schedule_and_contender_on_the_same_samples(tmp_path: Path) -> None:
    comm = world()
    out = Path(comm.bcast(str(tmp_path / "pipeline.json"), root=0))
    sets = [arg for s in TINY for arg in ("--set", s)]
    args = ["pipeline", *sets, "--microbatches", str(M), "--reps", str(REPS), "--steps", str(STEPS),
            "--warmup", str(WARMUP), "--vs", "torch", "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    if comm.Get_rank() != 0:
        return
    rows = json.loads(out.read_text())
    # torch when it is installed; without it, --vs torch is one line and the other contenders run
    contenders = ["hpcdl-pipeline", "one-process"]
    if importlib.util.find_spec("torch") is not None:
        contenders.append("torch-pipelining")
    expected = [(s, c) for s in ("gpipe", "1f1b") for c in contenders]
    assert [(r["schedule"], r["impl"]) for r in rows] == expected
    samples = (WARMUP + REPS * STEPS) * M * 8
    for r in rows:
        assert KEYS <= set(r)
        assert r["stages"] == comm.Get_size() and len(r["balance"]) == comm.Get_size()
        assert r["microbatches"] == M and r["samples_per_step"] == M * 8 and r["repeat"] == REPS
        assert r["samples"] == samples
        assert r["samples_per_s"] == pytest.approx(M * 8 / r["step_s"])
    for schedule in ("gpipe", "1f1b"):
        by = {r["impl"]: r for r in rows if r["schedule"] == schedule}
        pipe, one = by["hpcdl-pipeline"], by["one-process"]
        assert pipe["sampler"] == one["sampler"] and pipe["sampler"]["step"] > 0
        assert pipe["vs_one_process"] == pytest.approx(pipe["samples_per_s"] / one["samples_per_s"])
        assert one["vs_one_process"] == pytest.approx(1.0)
        if "torch-pipelining" in by:
            assert by["torch-pipelining"]["sampler"] is None  # it trains the first step's batch
            assert pipe["vs_torch"] == pytest.approx(
                pipe["samples_per_s"] / by["torch-pipelining"]["samples_per_s"]
            )
        else:
            assert pipe["vs_torch"] is None
