"""jobs/experiments/reproduce.py: the table built from the experiments' summaries (none is run here)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("reproduce", ROOT / "jobs" / "experiments" / "reproduce.py")
assert _spec is not None and _spec.loader is not None
reproduce = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(reproduce)


def _summary(work: Path, name: str, rows: list[dict[str, Any]]) -> None:
    (work / name).mkdir(parents=True)
    reproduce.write_summary(work / name, name, "small", rows)


def test_row_gives_the_verdict() -> None:
    assert reproduce.row("f.png", "q", 1.0, 2.0, True, "r")["verdict"] == "holds"
    assert reproduce.row("f.png", "q", 1.0, 2.0, False, "r")["verdict"] == "does not hold"
    assert reproduce.row("f.png", "q", 1.0, 2.0, None, "r")["verdict"] == "not comparable"


def test_collects_every_experiment_into_one_table(tmp_path: Path) -> None:
    row = reproduce.row
    alpha = [
        row("a.png", "speed-up", 1.74, "≥ 1.5", True, "≥ 1.5×"),
        row("a.png", "vs torch", "-", "> 1", None, "ahead"),
    ]
    _summary(tmp_path, "alpha", alpha)
    _summary(tmp_path, "beta", [row("table 2", "error | gap", -0.088, "±5 %", False, "|err| ≤ 5 %")])
    (tmp_path / "gamma").mkdir()
    (tmp_path / "gamma" / "failed").write_text("exit 1; see run.log\n")
    rows = reproduce.collect(tmp_path, ["alpha", "beta", "gamma", "delta"])
    assert [(r["experiment"], r["verdict"]) for r in rows] == [
        ("alpha", "holds"),
        ("alpha", "not comparable"),
        ("beta", "does not hold"),
        ("gamma", "not comparable"),
        ("delta", "not comparable"),
    ]
    assert rows[3]["measured"] == "exit 1; see run.log" and rows[4]["measured"] == "no summary.json"

    table = reproduce.markdown(rows, "small", {"alpha": 100.0, "beta": 20.0})
    lines = table.splitlines()
    assert lines[0] == "| experiment | figure | quantity | measured | target | verdict | rule |"
    assert lines[2] == "| alpha | a.png | speed-up | 1.74 | ≥ 1.5 | holds | ≥ 1.5× |"
    assert lines[4] == "| beta | table 2 | error \\| gap | -0.088 | ±5 % | does not hold | \\|err\\| ≤ 5 % |"
    assert "5 rows at the small size: 1 holds, 1 does not hold, 3 not comparable" in table
    assert "alpha 100 s, beta 20 s, 120 s in all" in table


def test_main_collect_writes_markdown_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    names = list(reproduce.experiments())
    assert {"pipeline", "staleness", "sim-fidelity"} <= set(names)
    for name in names:
        _summary(tmp_path, name, [reproduce.row("f.png", "q", 1, 1, True, "equal")])
    assert reproduce.main(["--collect", "--work", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert (tmp_path / "summary.md").read_text() in printed
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["size"] == "small"
    assert [r["experiment"] for r in summary["rows"]] == names


@pytest.mark.parametrize("bad", ["verdict", "rule"])
def test_rejects_a_malformed_row(tmp_path: Path, bad: str) -> None:
    r = reproduce.row("f.png", "q", 1, 1, True, "equal")
    if bad == "verdict":
        r["verdict"] = "maybe"
    else:
        del r[bad]
    _summary(tmp_path, "alpha", [r])
    with pytest.raises(ValueError, match="alpha"):
        reproduce.collect(tmp_path, ["alpha"])
