"""The instability model (hpcdl/parallel/fault.py): drawn schedules are prefix-stable, capped and
bounded; schedule files are read and refused in one line; bad ``[fault]`` input exits 2 with
nothing written; ``--plan`` prints the schedule's summary."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hpcdl.config import load_config
from hpcdl.parallel.fault import FaultModel, draw, fault_model, read_schedule
from hpcdl.simulate import main as simulate
from hpcdl.train import main as train_main


def test_a_drawn_schedule_is_a_pure_function_of_the_seed_and_its_first_rows_of_the_length() -> None:
    long = draw(7, 8, 300, 0.1, 5, 4)
    assert np.array_equal(draw(7, 8, 300, 0.1, 5, 4), long)
    assert np.array_equal(draw(7, 8, 40, 0.1, 5, 4), long[:40])
    assert not np.array_equal(draw(8, 8, 300, 0.1, 5, 4), long)
    assert long.any()


@pytest.mark.parametrize(("p", "duration", "most"), [(0.1, 5, 4), (0.3, 5, 2), (0.5, 1, 1), (0.05, 20, 7)])
def test_outages_last_1_to_max_duration_steps_and_never_exceed_the_cap(
    p: float, duration: int, most: int
) -> None:
    offline = draw(3, 8, 500, p, duration, most)
    model = FaultModel(offline)
    lengths = [e - s + 1 for _, s, e in model.outages() if e < 499]  # the last may be cut by the run's end
    assert lengths and min(lengths) >= 1 and max(lengths) <= duration
    assert offline.sum(axis=1).max() <= most
    if p >= 0.3:
        assert offline.sum(axis=1).max() == most  # the cap binds


def test_the_offline_fraction_grows_with_p() -> None:
    fractions = [draw(1, 16, 400, p, 5, 15).mean() for p in (0.0, 0.02, 0.1, 0.4)]
    assert fractions[0] == 0 and fractions == sorted(fractions) and fractions[-1] > 0.5


def test_no_faults_by_default() -> None:
    assert fault_model(load_config("digits-mlp", ["parallel.strategy=local"]), 4, 100) is None


def test_a_schedule_file_gives_its_outages_inclusive(tmp_path: Path) -> None:
    f = tmp_path / "s.csv"
    f.write_text("rank,start,end\n1,2,4\n0,0,0\n1,6,6\n")
    assert read_schedule(f, 2) == [(0, 0, 0), (1, 2, 4), (1, 6, 6)]
    cfg = load_config("digits-mlp", ["parallel.strategy=local", f'fault.schedule="{f}"'])
    model = fault_model(cfg, 2, 8)
    assert model is not None
    assert [model.online(t) for t in range(8)] == [(1,), (0, 1), (0,), (0,), (0,), (0, 1), (0,), (0, 1)]
    assert model.online(100) == (0, 1)  # past the run: everyone
    assert model.outages() == [(0, 0, 0), (1, 2, 4), (1, 6, 6)]


def _refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], n: int, *sets: str) -> str:
    """A simulated run of ``sets`` on ``n`` ranks: exit 2, one line of error, nothing written."""
    out = tmp_path / "run"
    out.mkdir(exist_ok=True)
    given = [a for s in ["train.steps=4", *sets] for a in ("--set", s)]
    capsys.readouterr()
    code = simulate(["-n", str(n), "-m", "hpcdl.train", "--config", "digits-mlp", *given,
                     "--out", str(out / "r.h5"), "--progress", "none"])  # fmt: skip
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1, err
    assert list(out.iterdir()) == [], "a refused run wrote something"
    return err[0]


def _schedule(tmp_path: Path, text: str) -> str:
    f = tmp_path / "bad.csv"
    f.write_text(text)
    return f'fault.schedule="{f}"'


@pytest.mark.parametrize(
    ("sets", "said"),
    [
        (["fault.p=1.0"], "fault.p"),
        (["fault.p=-0.1"], "fault.p"),
        (["fault.max_concurrent=3"], "fault.max_concurrent = 3 on 3 ranks"),
        (["fault.max_concurrent=5"], "at most 2"),
        (["schedule:0,0,1\n3,2,4\n"], "rank 3 on 3 ranks"),
        (["schedule:1,5,4\n"], "start 5 > end 4"),
        (["schedule:1,2,5\n1,5,7\n"], "overlap"),
        (["schedule:1,2\n"], "is not 'rank,start,end'"),
        (["fault.p=0.1", "schedule:1,2,5\n"], "set one of them"),
    ],
)
def test_bad_fault_input_is_refused_in_one_line_with_nothing_written(
    sets: list[str], said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    given = [_schedule(tmp_path, s.split(":", 1)[1]) if s.startswith("schedule:") else s for s in sets]
    line = _refused(tmp_path, capsys, 3, "parallel.strategy=local", *given)
    assert said in line, line


@pytest.mark.parametrize("strategy", ["ps", "pipeline"])
def test_fault_keys_with_a_strategy_that_does_not_model_faults_are_refused(
    strategy: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line = _refused(tmp_path, capsys, 2, f"parallel.strategy={strategy!r}".replace("'", '"'), "fault.p=0.1")
    assert f"fault.p = 0.1 with parallel.strategy = {strategy!r}" in line and "'local'" in line, line


def test_plan_prints_the_schedule_summary(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--config", "digits-mlp", "--set", 'parallel.strategy="local"', "--set", "fault.p=0.1",
            "--set", "fault.max_concurrent=2", "--set", "train.steps=200", "--plan", "-n", "4"]  # fmt: skip
    assert train_main(argv) == 0
    out = capsys.readouterr().out
    cfg = load_config("digits-mlp", ["parallel.strategy=local", "fault.p=0.1", "fault.max_concurrent=2"])
    model = fault_model(cfg, 4, 200)
    assert model is not None
    for line in model.summary():
        assert line in out
    assert "longest outage" in out and "most ranks offline at once 2" in out
