"""``bench train --set optimizer.name=kfac`` under mpiexec (-n 2, -n 3): K-FAC's split beside SGD.

Figures are not asserted (benchmarks are not tests); what the code guarantees is: every part is
a sum of disjoint intervals on one monotonic clock inside the measured steps, so the parts are
non-negative, add up to K-FAC's share, and the share lies within the rank's own step time; the
decomposing steps are those with ``t mod inv_every = 0`` among the measured ones; what each
``grad_workers`` layout sends.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpcdl.bench import main
from hpcdl.bench.train import KFAC_PARTS
from hpcdl.comm import world

WARMUP, REPEAT, STEPS, INV_EVERY = 3, 2, 3, 2  # the measured steps are t = 3 .. 8


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("workers", ["one", "all"])
def test_kfac_row_splits_its_share_beside_its_sgd_twin(tmp_path: Path, workers: str) -> None:
    comm = world()
    n = comm.Get_size()
    k = 1 if workers == "one" else n
    out = Path(comm.bcast(str(tmp_path / "train.json"), root=0))
    sets = ["optimizer.name=kfac", f"kfac.inv_every={INV_EVERY}", f"kfac.grad_workers={k}"]
    args = ["train", "--config", "digits-mlp", *[a for s in sets for a in ("--set", s)],
            "--repeat", str(REPEAT), "--steps", str(STEPS), "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    if comm.Get_rank() != 0:
        return
    rows = {r["impl"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"hpcdl-kfac", "hpcdl"}  # K-FAC and its SGD twin, interleaved
    kfac, sgd = rows["hpcdl-kfac"], rows["hpcdl"]
    assert "kfac_s" not in sgd
    assert kfac["sgd_step_s"] == sgd["step_s"] and kfac["vs_sgd"] == pytest.approx(
        kfac["step_s"] / sgd["step_s"]
    )
    measured = range(WARMUP, WARMUP + REPEAT * STEPS)
    assert kfac["kfac_steps"] == len(measured)
    assert kfac["inversions"] == sum(t % INV_EVERY == 0 for t in measured)
    assert kfac["inv_every"] == INV_EVERY and kfac["grad_workers"] == k
    assert len(kfac["kfac_by_rank"]) == n and kfac["kfac_by_rank"][0]["kfac_s"] == kfac["kfac_s"]
    for split in kfac["kfac_by_rank"]:
        parts = [split[f"{p}_s"] for p in KFAC_PARTS]
        assert all(p >= 0 for p in parts[:-1]) and parts[-1] >= -1e-9  # other: the slot less its parts
        assert sum(parts) == pytest.approx(split["kfac_s"], rel=1e-9, abs=1e-12)
        assert split["kfac_s"] <= split["step_mean_s"] + 1e-9  # inside the measured steps
        assert split["factors_s"] > 0 and split["update_s"] > 0
    # what the layouts send: factors always; eigenbases to the other workers (k > 1); gradients
    # from each layer's worker to the rest of its block (k < N)
    assert kfac["bytes_factors_per_step"] > 0
    assert (kfac["bytes_eigen_per_step"] > 0) == (k > 1)
    assert (kfac["bytes_grads_per_step"] > 0) == (k < n)
