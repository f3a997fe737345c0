"""The ``local`` strategy on the simulator's virtual ranks: with τ = 1 and no faults it ends with
sync's parameters; a round leaves every member with the mean of exactly the online ranks'
weights (or, ``adopt``, of those that stayed); offline ranks keep their own; evaluating changes
no weights; K-FAC trains locally; the rounds follow the schedule across a resume.

(The bitwise stop and ``--resume auto`` with faults, and the agreement with sync at the
default momentum and weight decay, are the conformance suite's: ``tests/strategies/``.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import local_recording
import numpy as np
import pytest
from simulated import schedule_setting as _schedule
from simulated import sim

from hpcdl.config import load_config
from hpcdl.parallel import local
from hpcdl.parallel.fault import fault_model
from hpcdl.simulate import main as simulate
from hpcdl.store.checkpoint import list_checkpoints, load_checkpoint

BASE = ["dtype=float64", "model.width=32", "train.steps=8", "schedule.name=constant", "schedule.scale=none",
        "schedule.warmup_epochs=0", "checkpoint.every=0"]  # fmt: skip


def cfg(*sets: str) -> object:
    return load_config("digits-mlp", [*BASE, *sets])


def final_params(out: Path) -> dict[str, dict[str, np.ndarray]]:
    return load_checkpoint(list_checkpoints(out)[0]).pieces


def vector(params: dict[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([np.asarray(params[k]).ravel() for k in sorted(params)])


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_tau_1_without_faults_ends_with_syncs_parameters(n: int, momentum: float, tmp_path: Path) -> None:
    common = [f"optimizer.momentum={momentum}", "optimizer.weight_decay=0"]
    sim(n, cfg("parallel.strategy=local", "local.average_every=1", *common), out=tmp_path / "local.h5")
    sim(n, cfg("parallel.strategy=sync", *common), out=tmp_path / "sync.h5")
    want = vector(final_params(tmp_path / "sync.h5")["model"]["params"])
    local = final_params(tmp_path / "local.h5")
    assert sorted(local) == [f"replica {r}" for r in range(n)]
    for r in range(n):
        got = vector(local[f"replica {r}"]["params"])
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-10 * np.abs(want).max())


# rank 2 offline at steps 1-4 (misses the rounds after steps 1 and 3), rank 0 at step 5 (the round after 5)
SCHEDULE = "rank,start,end\n2,1,4\n0,5,5\n"


@pytest.mark.parametrize("rejoin", ["average", "adopt"])
def test_a_round_gives_its_members_the_mean_of_exactly_the_online_ranks_weights(
    rejoin: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[tuple[int, tuple[int, ...]]] = []
    original = local.subcomm

    def subcomm(comm: Any, ranks: Any) -> Any:
        made.append((comm.Get_rank(), tuple(ranks)))
        return original(comm, ranks)

    monkeypatch.setattr(local, "subcomm", subcomm)
    local_recording.ROUNDS.clear()
    sets = ["parallel.strategy=local_recording:RecordingLocal", "local.average_every=2",
            f"local.rejoin={rejoin}", _schedule(tmp_path, SCHEDULE)]  # fmt: skip
    results = sim(3, cfg(*sets), out=tmp_path / "r.h5")
    # one communicator per online set, made by its members at its first round (the set (0, 1)
    # meets twice), never by the others; all freed at the end
    assert sorted(made) == [(0, (0, 1)), (0, (0, 1, 2)), (1, (0, 1)), (1, (0, 1, 2)), (1, (1, 2)),
                            (2, (0, 1, 2)), (2, (1, 2))]  # fmt: skip
    assert all(not r.strategy.groups for r in results)
    by_step = local_recording.check_rounds(local_recording.ROUNDS, 2, 8)
    members = {s: next(iter(v.values()))[0] for s, v in by_step.items()}
    assert members == {1: (0, 1), 3: (0, 1), 5: (1, 2), 7: (0, 1, 2)}
    contributors = {s: next(iter(v.values()))[1] for s, v in by_step.items()}
    if rejoin == "adopt":  # rank 2 back at 5 (missed 3) takes rank 1's; rank 0 back at 7 (missed 5) adopts
        assert contributors == {1: (0, 1), 3: (0, 1), 5: (1,), 7: (1, 2)}
    else:
        assert contributors == {1: (0, 1), 3: (0, 1), 5: (1, 2), 7: (0, 1, 2)}
    assert 2 not in {r for s in (1, 3) for r in by_step[s]}  # offline: no round


def test_evaluation_changes_no_weights(tmp_path: Path) -> None:
    sets = ["parallel.strategy=local", "local.average_every=3", _schedule(tmp_path, SCHEDULE)]
    sim(3, cfg(*sets, "train.eval_every=1"), out=tmp_path / "a.h5")
    sim(3, cfg(*sets, "train.eval_every=8"), out=tmp_path / "b.h5")
    a, b = final_params(tmp_path / "a.h5"), final_params(tmp_path / "b.h5")
    for piece in a:
        for k, v in a[piece]["params"].items():
            assert v.tobytes() == b[piece]["params"][k].tobytes()
    # the replicas differ (8 is not a round of τ = 3): what was evaluated is their mean, not rank 0's
    assert vector(a["replica 0"]["params"]).tobytes() != vector(a["replica 1"]["params"]).tobytes()


def test_kfac_trains_locally_and_average_factors_averages_them(tmp_path: Path) -> None:
    kfac = ["optimizer.name=kfac", "optimizer.lr=0.02", "kfac.inv_every=2", "local.average_every=2"]
    for avg in (False, True):
        out = tmp_path / f"k{avg}.h5"
        sets = ["parallel.strategy=local", *kfac, f"kfac.average_factors={str(avg).lower()}"]
        results = sim(2, cfg(*sets), out=out)
        layers = [r.strategy.optimizer.layers for r in results]
        same = all(np.array_equal(a.A, b.A) and np.array_equal(a.G, b.G) for a, b in zip(*layers))
        assert same == avg  # after the last round (step 8): averaged, or each rank's own
        assert np.isfinite(results[0].strategy.optimizer.layers[0].A).all()


def test_the_schedule_and_the_rounds_are_the_same_across_a_resume(tmp_path: Path) -> None:
    sets = ["parallel.strategy=local_recording:RecordingLocal", "local.average_every=2", "fault.p=0.3",
            "checkpoint.every=4"]  # fmt: skip
    local_recording.ROUNDS.clear()
    sim(3, cfg(*sets), out=tmp_path / "whole.h5")
    whole = {r: [(s, m, c) for s, m, c, *_ in v] for r, v in local_recording.ROUNDS.items()}
    local_recording.ROUNDS.clear()
    sim(3, cfg(*sets, "train.stop_at=4"), out=tmp_path / "part.h5")
    sim(3, cfg(*sets), out=tmp_path / "part.h5", resume="auto")
    part = {r: [(s, m, c) for s, m, c, *_ in v] for r, v in local_recording.ROUNDS.items()}
    assert part == whole
    c = cfg(*sets)
    assert np.array_equal(fault_model(c, 3, 4).offline, fault_model(c, 3, 8).offline[:4])
    members = {m for v in whole.values() for _, m, _ in v}
    assert len(members) > 1, "the draw made no outage at a round: the test would check nothing"


def test_a_resume_under_a_schedule_file_changed_before_the_checkpoint_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    schedule = _schedule(tmp_path, SCHEDULE)
    sets = [*BASE, "parallel.strategy=local", "local.average_every=2", schedule, "checkpoint.every=4"]
    out = tmp_path / "r.h5"
    sim(3, load_config("digits-mlp", [*sets, "train.stop_at=4"]), out=out)
    (tmp_path / "faults.csv").write_text("rank,start,end\n1,1,4\n")  # rank 1, not 2, at steps 1-4
    before = {p.name: p.read_bytes() for p in sorted(tmp_path.iterdir()) if p.name.startswith("r.")}
    given = [a for s in sets for a in ("--set", s)]
    capsys.readouterr()
    code = simulate(["-n", "3", "-m", "hpcdl.train", "--config", "digits-mlp", *given, "--out", str(out),
                     "--resume", "auto", "--progress", "none"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "another fault schedule up to its step 4" in err, err
    assert {p.name: p.read_bytes() for p in sorted(tmp_path.iterdir()) if p.name.startswith("r.")} == before
    # only the steps before the checkpoint count: a file changed after them continues the run
    (tmp_path / "faults.csv").write_text("rank,start,end\n2,1,4\n1,6,7\n")
    done = sim(3, load_config("digits-mlp", sets), out=out, resume="auto")
    assert done[0].steps == 8


def test_a_round_averages_batchnorms_running_statistics_too(tmp_path: Path) -> None:
    local_recording.ROUNDS.clear()
    cnn = ["model.name=cnn", "model.channels=4", "optimizer.name=adam", "optimizer.lr=0.003"]
    sets = ["parallel.strategy=local_recording:RecordingLocal", "local.average_every=2", *cnn]
    results = sim(3, cfg(*sets, _schedule(tmp_path, SCHEDULE)), out=tmp_path / "r.h5")
    strategy = results[0].strategy
    buffers = [b for _, b in strategy.model.named_buffers() if b.dtype == np.float64]
    assert buffers and len(strategy.arrays) == len(strategy.model.parameters()) + len(buffers)
    local_recording.check_rounds(local_recording.ROUNDS, 2, 8)  # over parameters and statistics


@pytest.mark.parametrize("rejoin", ["average", "adopt"])
def test_the_run_file_has_the_online_mask_group_sizes_and_each_members_divergence(
    rejoin: str, tmp_path: Path
) -> None:
    import h5py  # noqa: PLC0415

    local_recording.ROUNDS.clear()
    sets = ["parallel.strategy=local_recording:RecordingLocal", "local.average_every=2",
            f"local.rejoin={rejoin}", _schedule(tmp_path, SCHEDULE)]  # fmt: skip
    sim(3, cfg(*sets), out=tmp_path / "r.h5")
    with h5py.File(tmp_path / "r.h5") as f:
        online, divergence = f["ranks/online"][...], f["ranks/divergence"][...]
        group_size = f["metrics/group_size"][...]
    outages = fault_model(cfg(*sets), 3, 8)
    assert outages is not None
    np.testing.assert_array_equal(online, ~outages.offline)
    np.testing.assert_array_equal(group_size, [np.nan, 2, np.nan, 2, np.nan, 2, np.nan, 3])
    # each member's distance from the mean of the contributors' weights before the round, relative
    want = np.full((8, 3), np.nan)
    for rank, mine in local_recording.ROUNDS.items():
        for step, _, contributors, before, _ in mine:
            mean = np.mean([b for r, m in local_recording.ROUNDS.items() for s, _, _, b, _ in m
                            if s == step and r in contributors], axis=0)  # fmt: skip
            want[step, rank] = np.linalg.norm(before - mean) / np.linalg.norm(mean)
    assert np.isnan(want).sum() == 24 - 9  # 2 + 2 + 2 + 3 members
    np.testing.assert_allclose(divergence, want, rtol=1e-10)
    if rejoin == "average":  # (adopt: a lone contributor is its own mean)
        assert (divergence[np.isfinite(divergence)] > 0).all()
