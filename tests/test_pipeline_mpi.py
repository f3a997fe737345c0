"""The pipeline strategy under mpiexec (-n 2, -n 3; -n 4 in the slow suite), against one process.

* GPipe and interleaved 1F1B end with the parameters of one process with ``exchange.accumulate = m``
  on the same microbatches (float64, relative 1e-10), with the same losses and accuracy;
* the run file holds each stage's bubble, activation bytes and microbatches in flight,
  and with ``log.trace`` every forward and backward, exported as Chrome trace events.

1F1B against one process, and a stop and ``--resume auto``, are the conformance suite's
(``tests/strategies/``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

from hpcdl.comm import world
from hpcdl.config import load_config
from hpcdl.parallel.pipe_plan import schedule
from hpcdl.report.trace import chrome_trace
from hpcdl.train import run

COMMON = [
    "dtype=float64", "model.depth=6", "model.width=32", "data.batch_size=8", "optimizer.lr=0.05",
    "schedule.name=constant", "schedule.warmup_epochs=0", "checkpoint.every=0",
]  # fmt: skip


def cfg(*sets: str) -> Any:
    return load_config("digits-mlp", [*COMMON, *sets])


def gathered(result: Any, comm: Any) -> dict[str, np.ndarray] | None:
    """Every rank's parameters by name, on rank 0 (None elsewhere)."""
    mine = {name: p.data.copy() for name, p in result.strategy.model.named_parameters()}
    parts = comm.gather(mine, root=0)
    return {name: a for part in parts for name, a in part.items()} if parts is not None else None


def shared_path(comm: Any, tmp_path: Path, name: str) -> Path:
    return Path(comm.bcast(str(tmp_path / name), root=0))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", ["gpipe", "interleaved"])  # 1f1b: tests/strategies (conformance)
def test_the_pipeline_ends_where_one_process_accumulating_m_microbatches_does(kind: str) -> None:
    comm = world()
    p = comm.Get_size()
    m, chunks = (2 * p, 2) if kind == "interleaved" else (5, 1)
    sets = ["train.steps=6", "train.eval_every=3"]
    piped = run(cfg(*sets, "parallel.strategy=pipeline", f"pipeline.microbatches={m}",
                    f"pipeline.schedule={kind}", f"pipeline.virtual_stages={chunks}"), comm)  # fmt: skip
    got = gathered(piped, comm)
    alone_comm = comm.Split(comm.Get_rank(), 0)
    try:
        alone = run(cfg(*sets, f"exchange.accumulate={m}"), alone_comm)
    finally:
        alone_comm.Free()
    np.testing.assert_allclose(
        [r["loss"] for r in piped.history], [r["loss"] for r in alone.history], rtol=1e-10
    )
    assert piped.test_accuracy == alone.test_accuracy
    if comm.Get_rank() == 0:
        want = dict(alone.strategy.model.named_parameters())
        assert got is not None and set(got) == set(want)
        scale = max(np.abs(p.data).max() for p in want.values())
        for name, param in want.items():
            np.testing.assert_allclose(got[name], param.data, rtol=0, atol=1e-10 * scale, err_msg=name)


@pytest.mark.mpi(min_size=2)
def test_the_run_file_has_each_stages_bubble_memory_and_timeline(tmp_path: Path) -> None:
    comm = world()
    p, m, steps = comm.Get_size(), 4, 3
    out = shared_path(comm, tmp_path, "trace.h5")
    run(cfg("parallel.strategy=pipeline", f"pipeline.microbatches={m}", f"train.steps={steps}",
            "log.trace=true"), comm, out=out)  # fmt: skip
    if comm.Get_rank() != 0:
        return
    with h5py.File(out) as f:
        bubble, in_flight = f["ranks/bubble"][...], f["ranks/in_flight"][...]
        held, busy = f["ranks/activation_bytes"][...], f["ranks/busy_time"][...]
        rank, micro = f["trace/rank"][...], f["trace/microbatch"][...]
        kind = np.array([k.decode() for k in f["trace/kind"][...]])
    assert bubble.shape == (steps, p) and ((bubble >= 0) & (bubble < 1)).all()
    assert (in_flight == schedule("1f1b", p, m).in_flight()).all()
    assert (held > 0).all() and (busy > 0).all()
    for s in range(p):
        for op in ("forward", "backward"):
            assert sorted(micro[(rank == s) & (kind == op)].tolist()) == sorted(list(range(m)) * steps)
    events = [e for e in chrome_trace([out])["traceEvents"] if e["ph"] == "X"]
    assert len(events) == len(kind)
    assert all(e["dur"] >= 0 and isinstance(e["ts"], float) and e["tid"] in range(p) for e in events)
