"""Replicated pipeline stages on the simulator's virtual ranks, against one process.

The layouts mpiexec cannot reach here — ``[3, 1, 2]`` on 6 ranks and ``[4, 2, 2]`` on 8 — and
``[2, 1]``, ``[1, 2]``: GPipe and 1F1B end with the parameters of one process accumulating
the same m microbatches (float64, relative 1e-10), every replica of a stage bitwise its
first replica; the trace holds each replica's forwards and backwards of its own microbatches
(k mod r_s) and the stage's gradient allreduce.
"""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest
from simulated import sim  # tests/ is on sys.path (pytest prepend mode)

from hpcdl.comm import world
from hpcdl.config import load_config
from hpcdl.driver.run import train

COMMON = [
    "dtype=float64", "model.depth=6", "model.width=32", "data.batch_size=8", "optimizer.lr=0.05",
    "schedule.name=constant", "schedule.warmup_epochs=0", "checkpoint.every=0", "train.steps=3",
    "train.eval_every=3",
]  # fmt: skip


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("reps", "m"), [([2, 1], 4), ([1, 2], 4), ([3, 1, 2], 6), ([4, 2, 2], 8)])
def test_replicated_stages_end_where_one_process_does_in_the_simulator(
    kind: str, reps: list[int], m: int, tmp_path: Path
) -> None:
    n = sum(reps)
    cfg = load_config("digits-mlp", [*COMMON, "parallel.strategy=pipeline", f"pipeline.schedule={kind}",
                                     f"pipeline.replicas={reps}", f"pipeline.microbatches={m}",
                                     "log.trace=true"])  # fmt: skip
    results = sim(n, cfg, out=tmp_path / "run.h5", compute="none")
    alone = train(load_config("digits-mlp", [*COMMON, f"exchange.accumulate={m}"]), world())
    np.testing.assert_allclose(
        [r["loss"] for r in results[0].history], [r["loss"] for r in alone.history], rtol=1e-10
    )
    assert all(r.test_accuracy == alone.test_accuracy for r in results)
    want = {name: p.data for name, p in alone.strategy.model.named_parameters()}
    scale = max(np.abs(a).max() for a in want.values())
    got: dict[str, np.ndarray] = {}
    first = 0
    for r in reps:
        copies = [dict(results[first + j].strategy.model.named_parameters()) for j in range(r)]
        for other in copies[1:]:
            assert all(np.array_equal(other[k].data, copies[0][k].data) for k in copies[0])
        got.update({k: p.data for k, p in copies[0].items()})
        first += r
    assert set(got) == set(want)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=0, atol=1e-10 * scale, err_msg=name)
    with h5py.File(tmp_path / "run.h5") as f:
        rank, micro = f["trace/rank"][...], f["trace/microbatch"][...]
        kinds = np.array([k.decode() for k in f["trace/kind"][...]])
    first = 0
    for r in reps:
        for j in range(r):
            mine = rank == first + j
            for op in ("forward", "backward"):
                assert sorted(micro[mine & (kinds == op)].tolist()) == sorted(list(range(j, m, r)) * 3)
            assert (mine & (kinds == "allreduce")).sum() == (3 if r > 1 else 0)
        first += r
