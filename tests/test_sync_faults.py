"""``sync`` under the instability model (hpcdl/parallel/fault.py's wait model) on virtual ranks.

A rank offline at a step holds back its gradients for one step's time and the others wait:
the simulated time is the fault-free run's plus the hold at each step at which some rank is
offline (concurrent outages overlap, an outage of d steps costs d holds), while the
trajectory is the fault-free run's bit for bit. ``--compute none``: the steps' times are the
network model's alone, the same in both runs, so the comparison is the wait model's.
"""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest
from simulated import schedule_setting as _schedule
from simulated import sim

from hpcdl.config import load_config
from hpcdl.parallel.fault import fault_model, sync_wait_s
from hpcdl.store.checkpoint import list_checkpoints, load_checkpoint

BASE = ["dtype=float64", "model.width=32", "train.steps=24", "checkpoint.every=0", "train.eval_every=24"]
HOLD = 0.01  # s: 20-odd times a step's exchange on eth10g, so that the model's terms are visible


def cfg(*sets: str) -> object:
    return load_config("digits-mlp", [*BASE, *sets])


def _params(out: Path) -> np.ndarray:
    pieces = load_checkpoint(list_checkpoints(out)[0]).pieces["model"]["params"]
    return np.concatenate([np.asarray(pieces[k]).ravel() for k in sorted(pieces)])


def _end(out: Path) -> float:
    with h5py.File(out) as f:
        return float(f["metrics/time"][-1])


# ranks 1 and 2 offline together at steps 3-6 (one wait per step, not two), rank 0 alone at 10-10,
# rank 2 again at 15-19: 4 + 1 + 5 = 10 steps with a rank offline
SCHEDULE = "rank,start,end\n1,3,6\n2,3,6\n0,10,10\n2,15,19\n"


@pytest.mark.parametrize("source", ["schedule", "drawn"])
def test_sync_under_faults_takes_the_wait_models_time_and_the_fault_free_trajectory(
    source: str, tmp_path: Path
) -> None:
    faults = (
        [_schedule(tmp_path, SCHEDULE)]
        if source == "schedule"
        else ["fault.p=0.1", "fault.max_duration=4", "fault.max_concurrent=2"]
    )
    sim(3, cfg(), out=tmp_path / "free.h5")
    sim(3, cfg(*faults, f"fault.step_s={HOLD}"), out=tmp_path / "faults.h5")
    outages = fault_model(cfg(*faults), 3, 24)
    assert outages is not None
    offline_steps = int(outages.offline.any(axis=1).sum())
    assert offline_steps >= 5 and (source == "drawn" or offline_steps == 10)
    predicted = _end(tmp_path / "free.h5") + sync_wait_s(outages.offline, HOLD)
    assert _end(tmp_path / "faults.h5") == pytest.approx(predicted, rel=0.02)
    # an outage costs time, not samples: the same updates, bit for bit
    np.testing.assert_array_equal(_params(tmp_path / "faults.h5"), _params(tmp_path / "free.h5"))
    with h5py.File(tmp_path / "faults.h5") as f:
        np.testing.assert_array_equal(f["ranks/online"][...], ~outages.offline)
        np.testing.assert_array_equal(f["ranks/held_s"][...], np.where(outages.offline, HOLD, 0.0))
        np.testing.assert_array_equal(f["metrics/samples"][...], np.arange(1, 25) * 3 * 32)


def test_the_hold_measured_on_the_fly_is_the_previous_step_outside_communication(tmp_path: Path) -> None:
    """Compute charged by a cost table (each layer's forward and backward a fixed, distinct time; all
    else free), so that a step's time outside communication is exact: the hold at an offline step is
    the rank's previous step's, to the simulator's tick. (Measured compute made this a bound on wall
    times, which the driver's bookkeeping around a 0.2 ms step broke now and then.)"""
    table = tmp_path / "costs.toml"
    table.write_text("".join(f'[[layers]]\nlayer = "{i}"\nforward_s = {1e-4 * (i + 1)!r}\n'
                             f"backward_s = {2e-4 * (i + 1)!r}\n" for i in range(8)))  # fmt: skip
    sim(3, cfg(_schedule(tmp_path, SCHEDULE)), out=tmp_path / "r.h5", compute=f"table:{table}")
    with h5py.File(tmp_path / "r.h5") as f:
        held = f["ranks/held_s"][...]
        # a rank's step less its communication, its hold included (the driver's compute_time)
        own = f["ranks/compute_time"][...] - held
    assert own.min() > 0
    offline = [(3, 1), (3, 2), (4, 1), (10, 0), (15, 2), (19, 2)]
    for step, rank in offline:
        assert held[step, rank] == pytest.approx(own[step - 1, rank], rel=1e-9, abs=1e-9), (step, rank)
    outages = fault_model(cfg(_schedule(tmp_path, SCHEDULE)), 3, 24)
    np.testing.assert_array_equal(held > 0, outages.offline)  # held at every offline step, and only there


def test_the_report_draws_each_faulted_runs_schedule_above_the_accuracy_by_samples(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    from hpcdl.parallel.fault import faults_figure  # noqa: PLC0415
    from hpcdl.report import load  # noqa: PLC0415
    from hpcdl.report import main as report  # noqa: PLC0415

    sets = ["train.eval_every=4"]
    sim(3, cfg(*sets), out=tmp_path / "free.h5")
    sim(3, cfg(*sets, _schedule(tmp_path, SCHEDULE), f"fault.step_s={HOLD}"), out=tmp_path / "faults.h5")
    runs = [(load(tmp_path / "faults.h5"), "faults"), (load(tmp_path / "free.h5"), "free")]
    fig = faults_figure(runs)
    try:
        raster, accuracy = fig.axes[0], fig.axes[1]
        (image,) = raster.get_images()
        outages = fault_model(cfg(_schedule(tmp_path, SCHEDULE)), 3, 24)
        np.testing.assert_array_equal(image.get_array(), outages.offline.T)
        assert image.get_extent()[1] == 24 * 3 * 32  # the raster on the samples axis
        lines = accuracy.get_lines()
        assert outages.offline.sum() == 14  # rank-steps of 72
        assert [ln.get_label() for ln in lines] == ["faults (offline 19.4%)", "free (offline 0.0%)"]
        np.testing.assert_array_equal(lines[0].get_xdata(), np.arange(4, 25, 4) * 96)
    finally:
        plt.close(fig)
    assert faults_figure(runs[1:]) is None  # no schedule, no figure
    assert report([str(tmp_path / "faults.h5"), str(tmp_path / "free.h5"), "--out", f"{tmp_path}/"]) == 0
    assert (tmp_path / "faults+free-faults.png").stat().st_size > 0
