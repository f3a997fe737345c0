"""Distributed K-FAC on the simulator's virtual ranks: against one process, and its refusals.

On N = 2, 3 and 8 virtual ranks, for every ``kfac.grad_workers`` k dividing N (k = N: eigenbases
to every rank; 1: one rank per layer preconditions; between: HYBRID), the parameters end where
one process with ``exchange.accumulate = N`` ends on the same samples (float64, relative
1e-10; no dropout, no BatchNorm); a stop and ``--resume auto`` repeat the run bit for bit; a
checkpoint of SGD is refused by a K-FAC resume in one line; the eigendecompositions go to
ranks by KAISA's greedy rule.
"""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest
from kfac_config import COMMON, flat  # tests/ is on sys.path (pytest prepend mode)
from simulated import sim  # tests/ is on sys.path (pytest prepend mode)

from hpcdl.comm import world
from hpcdl.config import load_config
from hpcdl.driver.run import train
from hpcdl.errors import ConfigError
from hpcdl.parallel.kfac import assign
from hpcdl.store.checkpoint import list_checkpoints, load_checkpoint
from hpcdl.train import main as train_main


@pytest.mark.parametrize(("n", "k"), [(2, 1), (2, 2), (3, 1), (3, 3), (8, 1), (8, 2), (8, 4), (8, 8)])
def test_distributed_kfac_ends_where_one_process_accumulating_ends(n: int, k: int) -> None:
    got = sim(n, load_config("digits-mlp", [*COMMON, f"kfac.grad_workers={k}"]))
    alone = train(load_config("digits-mlp", [*COMMON, f"exchange.accumulate={n}"]), world())
    want = flat(alone)
    for r in range(n):  # every rank holds the same model
        np.testing.assert_allclose(flat(got[r]), want, rtol=0, atol=1e-10 * np.abs(want).max())
    np.testing.assert_allclose([row["loss"] for row in got[0].history],
                               [row["loss"] for row in alone.history], rtol=1e-10)  # fmt: skip


def test_a_stop_and_resume_auto_repeat_a_kfac_run_bit_for_bit(tmp_path: Path) -> None:
    sets = [*COMMON, "kfac.grad_workers=1", "checkpoint.every=3", "train.steps=6", "kfac.inv_every=4"]
    whole, part = tmp_path / "whole.h5", tmp_path / "part.h5"
    sim(3, load_config("digits-mlp", sets), out=whole)
    sim(3, load_config("digits-mlp", [*sets, "train.stop_at=3"]), out=part)
    sim(3, load_config("digits-mlp", sets), out=part, resume="auto")
    a, b = load_checkpoint(list_checkpoints(whole)[0]), load_checkpoint(list_checkpoints(part)[0])
    assert a.step == b.step == 6
    for group in ("params", "optimizer", "kfac"):
        assert sorted(a.pieces["model"][group]) == sorted(b.pieces["model"][group])
        for key, value in a.pieces["model"][group].items():
            assert value.tobytes() == b.pieces["model"][group][key].tobytes(), (group, key)
    with h5py.File(list_checkpoints(whole)[0]) as f:  # the documented place of a layer's factors
        assert f["pieces/model/kfac/1/A"].shape == (65, 65) and f["pieces/model/kfac/1/G"].shape == (24, 24)


def test_a_checkpoint_without_kfac_state_is_refused_in_one_line(tmp_path: Path) -> None:
    out = tmp_path / "sgd.h5"
    sgd = [s for s in COMMON if not s.startswith("optimizer.name")]
    sim(2, load_config("digits-mlp", [*sgd, "checkpoint.every=2", "train.stop_at=2"]), out=out)
    before = out.read_bytes()
    with pytest.raises(Exception, match="no K-FAC state for layer") as raised:
        sim(2, load_config("digits-mlp", COMMON), out=out, resume="auto")
    assert "\n" not in str(raised.value).split(": ", 1)[-1]
    assert out.read_bytes() == before  # nothing written


@pytest.mark.parametrize(
    ("sets", "ranks", "says"),
    [
        (["kfac.grad_workers=2"], 3, "kfac.grad_workers = 2 does not divide the 3 ranks: use one of [1, 3]"),
        (["parallel.strategy=ps"], 3, "optimizer.name = 'kfac' updates whole layers"),
        (["parallel.strategy=pipeline"], 2, "optimizer.name = 'kfac' updates whole layers"),
        (["kfac.inv_every=1", "kfac.factor_every=2"], 2, "kfac.inv_every = 1 must be >= kfac.factor_every"),
        (["kfac.damping=0"], 2, "kfac.damping"),
    ],
)
def test_what_kfac_cannot_run_is_one_line(sets: list[str], ranks: int, says: str) -> None:
    with pytest.raises(Exception) as raised:
        sim(ranks, load_config("digits-mlp", [*COMMON, *sets]))
    assert says in str(raised.value)


def test_the_plan_prints_each_layers_owner_and_workers(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--config", "digits-mlp", "--plan", "-n", "4", "--set", "optimizer.name=kfac", "--set",
            "kfac.grad_workers=2"]  # fmt: skip
    assert train_main(argv) == 0
    out = capsys.readouterr().out
    assert "K-FAC: eigendecompositions by rank" in out and "grad workers" in out


def test_the_assignment_is_largest_first_to_the_least_loaded_rank() -> None:
    assert assign([1.0, 8.0, 2.0, 8.0, 3.0], 2) == [1, 0, 1, 1, 0]  # 8->0, 8->1, 3->0, 2->1, 1->1
    assert assign([5.0], 4) == [0]
    with pytest.raises(ConfigError):
        from hpcdl.parallel.kfac import grad_workers  # noqa: PLC0415

        grad_workers(3, 8)
