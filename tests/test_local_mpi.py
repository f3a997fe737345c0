"""The ``local`` strategy under mpiexec (-n 2 and -n 3): with τ = 1 and no faults it ends with
sync's parameters; with a fault schedule every round leaves its members with the mean of exactly
the online ranks' weights (computed here from each rank's weights before the round), offline
ranks out of it; the schedule is the same on every rank."""

from __future__ import annotations

from pathlib import Path

import local_recording
import numpy as np
import pytest

from hpcdl.comm import Communicator
from hpcdl.config import load_config
from hpcdl.train import run

BASE = ["dtype=float64", "model.width=32", "train.steps=8", "schedule.name=constant", "schedule.scale=none",
        "schedule.warmup_epochs=0", "checkpoint.every=0"]  # fmt: skip


def cfg(*sets: str) -> object:
    return load_config("digits-mlp", [*BASE, *sets])


def shared(comm: Communicator, tmp_path: Path) -> Path:
    """Rank 0's temporary directory on every rank (rank 0 writes the run files)."""
    return Path(comm.bcast(str(tmp_path), root=0))


def packed(result: object) -> np.ndarray:
    return np.concatenate([p.data.ravel() for p in result.model.parameters()])  # type: ignore[attr-defined]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_tau_1_without_faults_ends_with_syncs_parameters_on_every_rank(
    momentum: float, comm: Communicator, tmp_path: Path
) -> None:
    base = shared(comm, tmp_path)
    common = [f"optimizer.momentum={momentum}", "optimizer.weight_decay=0"]
    local = run(cfg("parallel.strategy=local", "local.average_every=1", *common), comm, out=base / "local.h5")
    sync = run(cfg("parallel.strategy=sync", *common), comm, out=base / "sync.h5")
    got, want = packed(local), packed(sync)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-10 * np.abs(want).max())


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("rejoin", ["average", "adopt"])
def test_a_round_gives_its_members_the_mean_of_exactly_the_online_ranks_weights_under_mpiexec(
    rejoin: str, comm: Communicator, tmp_path: Path
) -> None:
    base = shared(comm, tmp_path)
    n = comm.Get_size()
    last = n - 1  # offline at steps 1-4: out of the rounds after steps 1 and 3
    if comm.Get_rank() == 0:
        (base / "faults.csv").write_text(f"rank,start,end\n{last},1,4\n0,5,5\n")
    comm.Barrier()
    local_recording.ROUNDS.clear()
    schedule = f'fault.schedule="{base / "faults.csv"}"'
    strategy = "parallel.strategy=local_recording:RecordingLocal"
    sets = [strategy, "local.average_every=2", f"local.rejoin={rejoin}", schedule]
    result = run(cfg(*sets), comm, out=base / "r.h5")
    offline = result.strategy.outages.offline
    tables = comm.gather(offline, root=0)
    rounds = comm.gather(local_recording.ROUNDS.get(comm.Get_rank(), []), root=0)
    if comm.Get_rank() != 0:
        return
    assert all(np.array_equal(t, tables[0]) for t in tables), "the schedule differs between ranks"
    by_step = local_recording.check_rounds(dict(enumerate(rounds)), 2, 8)
    members = {s: next(iter(v.values()))[0] for s, v in by_step.items()}
    everyone = tuple(range(n))
    assert members == {1: everyone[:-1], 3: everyone[:-1], 5: everyone[1:], 7: everyone}
    if n == 2:
        assert by_step[1][0][3].tobytes() == by_step[1][0][2].tobytes()  # alone: its own weights
