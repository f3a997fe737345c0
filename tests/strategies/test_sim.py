"""The conformance suite on the simulator's virtual ranks (serial): stop and ``--resume auto``
repeat a deterministic run bit for bit, a resume that does not fit is refused in one line with
nothing changed, an undeclared row key fails, and each case agrees with its reference."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from simulated import sim  # tests/ is on sys.path (pytest prepend mode)

from hpcdl.comm import world as world_comm
from hpcdl.components import declared
from hpcdl.config import load_config
from hpcdl.driver.checkpoints import fit_keys
from hpcdl.driver.run import train
from hpcdl.errors import HpcdlError
from hpcdl.parallel import RankPlace, strategy_class
from hpcdl.parallel.conformance import Case
from hpcdl.parallel.strategy import check_keys, ignored_keys
from hpcdl.simulate import main as simulate
from hpcdl.store.checkpoint import list_checkpoints

from .suite import (
    SIZES,
    assert_agrees,
    assert_same_checkpoints,
    assert_same_rows,
    cases,
    compute,
    config,
    conformance,
    final_checkpoint,
    main_cases,
    meeting_method,
    parameter_names,
    parameters,
    reference_or_skip,
    sets,
    setting,
    skip_below,
    stop_step,
)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize(("name", "case_name", "case"), cases("sim"))
def test_a_stop_and_resume_auto_repeat_the_run_bit_for_bit(
    name: str, case_name: str, case: Case, n: int, tmp_path: Path
) -> None:
    skip_below(name, n)
    cfg = config(name, case)
    stop = stop_step(cfg)
    how = compute(case, tmp_path, cfg)
    whole, part = tmp_path / "whole.h5", tmp_path / "part.h5"
    sim(n, cfg, out=whole, compute=how)
    stopped = sim(n, config(name, case, f"train.stop_at={stop}"), out=part, compute=how)
    assert stopped[0].stopped_by and stopped[0].steps == stop
    assert [p.name for p in list_checkpoints(part)] == [f"part.ckpt-{stop:08d}.h5"]
    sim(n, cfg, out=part, compute=how, resume="auto")
    assert final_checkpoint(part).step == cfg["train.steps"]
    assert_same_checkpoints(final_checkpoint(part), final_checkpoint(whole))
    assert_same_rows(name, part, whole, resumed_at=stop)


def _other_fit_key(name: str, case: Case, n: int) -> str:
    """``key=value``: a key that fixes the trajectory (:func:`~hpcdl.driver.checkpoints.fit_keys`)
    and one of the strategy's or its components' own, at another value that the strategy reads and
    that still plans on ``n`` ranks; else another seed."""
    cfg = config(name, case)
    keys = declared(cfg["parallel.strategy"]).keys
    own = strategy_class(name).declares.fit_keys
    for key in [*own, *(k for k in fit_keys(cfg) if k not in own)]:
        spec = keys.get(key)
        if spec is None:  # the driver's
            continue
        value = cfg[key]
        others = [c for c in spec.choices if c != value] if spec.choices else []
        if not spec.choices and spec.type is int:
            others = [value + 1]
        for other in others:
            try:
                changed = config(name, case, setting(key, other))
                check_keys(changed)
                strategy_class(name).plan(changed, n)
            except HpcdlError:
                continue
            if not ignored_keys(changed):
                return setting(key, other)
    return setting("seed", cfg["seed"] + 1)


def _refused(argv: list[str], run_dir: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """``python -m hpcdl.simulate ... --resume auto``: exit 2, one line of error (after the notes
    a run prints first), and every file as it was."""
    before = {p.name: p.read_bytes() for p in sorted(run_dir.iterdir())}
    capsys.readouterr()
    assert simulate(argv) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    err = [line for line in lines if not line.startswith("hpcdl.train: ! ")]  # the run's notes go before
    assert len(err) == 1 and err[0].startswith("hpcdl.train: error: "), lines
    assert {p.name: p.read_bytes() for p in sorted(run_dir.iterdir())} == before, "the refusal changed a file"
    return err[0]


@pytest.mark.parametrize(("name", "case_name", "case"), main_cases())
def test_a_resume_under_another_rank_count_fit_key_or_placement_is_refused_in_one_line(
    name: str, case_name: str, case: Case, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    n = max(3, conformance(name).min_ranks)  # room for another server count, cut or schedule
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    out = run_dir / "r.h5"
    cfg = config(name, case)
    how = compute(case, tmp_path, cfg)
    sim(n, config(name, case, f"train.stop_at={stop_step(cfg)}"), out=out, compute=how)

    def argv(ranks: int, *extra: str) -> list[str]:
        given = [a for s in [*sets(name, case), *extra] for a in ("--set", s)]
        return ["-n", str(ranks), "--network", "eth10g", "--compute", how, "-m", "hpcdl.train",
                "--config", "digits-mlp", *given, "--out", str(out), "--resume", "auto",
                "--progress", "none"]  # fmt: skip

    said = _refused(argv(n + 1), run_dir, capsys)
    assert f"{n} ranks" in said and f"{n + 1}" in said, said
    other = _other_fit_key(name, case, n)
    said = _refused(argv(n, other), run_dir, capsys)
    assert f"written with {other.split('=')[0]} = " in said, said
    cls = strategy_class(name)
    planned = cls.plan

    def another_placement(cfg: Any, world: int) -> Any:  # rank 0 holds a piece under another name
        placement = planned(cfg, world)
        first = placement.ranks[0]
        moved = RankPlace(first.role, f"{first.holds} (moved)", first.member)
        return dataclasses.replace(placement, ranks=(moved, *placement.ranks[1:]))

    monkeypatch.setattr(cls, "plan", another_placement)
    said = _refused(argv(n), run_dir, capsys)
    assert "another placement" in said, said


@pytest.mark.parametrize(("name", "case_name", "case"), main_cases())
def test_a_row_key_nobody_declared_fails_the_run(
    name: str, case_name: str, case: Case, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The strategy's meeting adds a key to its rows that it does not declare: the run file refuses it."""
    cls = strategy_class(name)
    method = meeting_method(cls)
    meeting = getattr(cls, method)

    def with_an_undeclared_key(self: Any, *args: Any, **kwargs: Any) -> Any:
        agreed = meeting(self, *args, **kwargs)
        for row in agreed.rows:
            row["undeclared_by_anyone"] = 1.0
        return agreed

    monkeypatch.setattr(cls, method, with_an_undeclared_key)
    n = max(2, conformance(name).min_ranks)
    cfg = config(name, case)
    with pytest.raises(Exception, match="undeclared_by_anyone") as raised:
        sim(n, cfg, out=tmp_path / "r.h5", compute=compute(case, tmp_path, cfg))
    assert "no component declares" in str(raised.value)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize(("name", "case_name", "case"), cases(reference=True))
def test_the_strategy_agrees_with_its_reference(
    name: str, case_name: str, case: Case, n: int, tmp_path: Path
) -> None:
    ref_sets, ranks = reference_or_skip(name, case, n)
    cfg = config(name, case)
    sim(n, cfg, out=tmp_path / "run.h5", compute=compute(case, tmp_path, cfg))
    ref_cfg = load_config("digits-mlp", ref_sets)
    if ranks == 1:
        train(ref_cfg, world_comm(), out=tmp_path / "ref.h5")
    else:
        sim(ranks, ref_cfg, out=tmp_path / "ref.h5")
    names_ = parameter_names(cfg)
    got = parameters(name, final_checkpoint(tmp_path / "run.h5"), names_)
    want = parameters(ref_cfg["parallel.strategy"], final_checkpoint(tmp_path / "ref.h5"), names_)
    assert_agrees(name, case, got, want)
