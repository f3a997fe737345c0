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


@pytest.mark.mpi(min_size=2)
def test_the_sgd_row_says_its_fraction_of_perfect_scaling_and_where_the_rest_goes(tmp_path: Path) -> None:
    """The one-rank row (every rank alone, at once) is the step perfect scaling keeps; the exchange's
    kinds are disjoint intervals inside its time (one repetition: no medians to mix)."""
    comm = world()
    n = comm.Get_size()
    out = Path(comm.bcast(str(tmp_path / "train.json"), root=0))
    args = ["train", "--config", "digits-mlp", "--set", "exchange.bucket_mb=0.05", "--repeat", "1",
            "--steps", "3", "--variant", "packed", "exchange.in_place=false", "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    if comm.Get_rank() != 0:
        return
    rows = {r["impl"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"hpcdl", "hpcdl-packed", "hpcdl-1rank"}  # the variant: one more row, interleaved
    assert "scaling" in rows["hpcdl-packed"] and rows["hpcdl-packed"]["pack_s"] > 0
    one, many = rows["hpcdl-1rank"], rows["hpcdl"]
    assert one["ranks"] == 1 and one["samples_per_s"] == pytest.approx(one["batch_per_rank"] / one["step_s"])
    assert one["comm_s"] == 0 and all(one[f"{k}_s"] == 0 for k in ("pack", "progress", "wait"))
    assert many["width"] == n
    assert many["scaling"] == pytest.approx(many["samples_per_s"] / (n * one["samples_per_s"]))
    kinds = [many[f"{k}_s"] for k in ("pack", "progress", "wait")]
    assert all(k > 0 for k in kinds) and sum(kinds) <= many["comm_s"] * (1 + 1e-9)
    assert many["wait_s"] <= many["exposed_comm_s"] * (1 + 1e-9)  # the wait is after backward
    assert many["gap_s"] == pytest.approx(many["step_s"] - one["step_s"])
