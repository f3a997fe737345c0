"""Replicated pipeline stages under mpiexec, against one process accumulating the same m microbatches.

Per world size the replica layouts of issue 23: ``[2]`` (one stage on two ranks) at -n 2,
``[2, 1]`` and ``[1, 2]`` at -n 3, ``[2, 2]`` and ``[1, 3]`` at -n 4 (the slow suite runs every
MPI test at -n 4). For GPipe and 1F1B the losses and the final parameters equal one
process's with ``exchange.accumulate = m`` (float64, relative 1e-10), and every replica of a
stage holds bitwise the same parameters.
A stop and ``--resume auto`` repeating the run bit for bit is checked at -n 3 (``[2, 1]``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

from hpcdl.comm import world
from hpcdl.config import load_config
from hpcdl.train import run

COMMON = [
    "dtype=float64", "model.depth=6", "model.width=32", "data.batch_size=8", "optimizer.lr=0.05",
    "schedule.name=constant", "schedule.warmup_epochs=0", "checkpoint.every=0",
]  # fmt: skip
#: world size -> the replica layouts checked there
LAYOUTS = {2: [[2]], 3: [[2, 1], [1, 2]], 4: [[2, 2], [1, 3]]}


def cfg(*sets: str) -> Any:
    return load_config("digits-mlp", [*COMMON, *sets])


def layouts(size: int) -> list[list[int]]:
    return LAYOUTS.get(size, [])


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("which", [0, 1])
def test_replicated_stages_end_where_one_process_accumulating_does(kind: str, which: int) -> None:
    comm = world()
    size = comm.Get_size()
    if which >= len(layouts(size)):
        pytest.skip(f"-n {size} has {len(layouts(size))} layout(s)")
    reps = layouts(size)[which]
    m = 2 * max(reps) * (3 if len(reps) > 1 else 1)  # a multiple of every replica count, > p
    sets = ["train.steps=5", "train.eval_every=5"]
    piped = run(cfg(*sets, "parallel.strategy=pipeline", f"pipeline.microbatches={m}",
                    f"pipeline.schedule={kind}", f"pipeline.replicas={reps}"), comm)  # fmt: skip
    mine = {name: p.data.copy() for name, p in piped.strategy.model.named_parameters()}
    every = comm.gather((piped.strategy.s, mine), root=0)
    alone_comm = comm.Split(comm.Get_rank(), 0)
    try:
        alone = run(cfg(*sets, f"exchange.accumulate={m}"), alone_comm)
    finally:
        alone_comm.Free()
    np.testing.assert_allclose(
        [r["loss"] for r in piped.history], [r["loss"] for r in alone.history], rtol=1e-10
    )
    assert piped.test_accuracy == alone.test_accuracy
    if comm.Get_rank() != 0:
        return
    want = dict(alone.strategy.model.named_parameters())
    scale = max(np.abs(p.data).max() for p in want.values())
    by_stage: dict[int, list[dict[str, np.ndarray]]] = {}
    for stage, params in every:
        by_stage.setdefault(stage, []).append(params)
    assert sorted(by_stage) == list(range(len(reps)))
    assert [len(by_stage[s]) for s in range(len(reps))] == reps
    got: dict[str, np.ndarray] = {}
    for stage, copies in by_stage.items():
        for other in copies[1:]:  # every replica bitwise the first
            assert set(other) == set(copies[0])
            for name in other:
                assert np.array_equal(other[name], copies[0][name]), (stage, name)
        got.update(copies[0])
    assert set(got) == set(want)
    for name, param in want.items():
        np.testing.assert_allclose(got[name], param.data, rtol=0, atol=1e-10 * scale, err_msg=name)


@pytest.mark.mpi(min_size=3)
def test_a_stopped_replicated_run_resumes_bit_for_bit(tmp_path: Path) -> None:
    comm = world()
    if comm.Get_size() != 3:
        pytest.skip("checked at -n 3")
    out = Path(comm.bcast(str(tmp_path / "rep.h5"), root=0))
    whole = Path(comm.bcast(str(tmp_path / "whole.h5"), root=0))
    sets = ["parallel.strategy=pipeline", "pipeline.replicas=[2, 1]", "pipeline.microbatches=4",
            "train.eval_every=3", "checkpoint.every=3"]  # fmt: skip
    straight = run(cfg(*sets, "train.steps=6"), comm, out=whole)
    run(cfg(*sets, "train.steps=3"), comm, out=out)
    resumed = run(cfg(*sets, "train.steps=6"), comm, out=out, resume="auto")
    for a, b in zip(straight.strategy.model.parameters(), resumed.strategy.model.parameters()):
        assert np.array_equal(a.data, b.data)
    if comm.Get_rank() == 0:
        with h5py.File(whole) as f, h5py.File(out) as g:
            assert np.array_equal(f["metrics/loss"][...], g["metrics/loss"][...])
