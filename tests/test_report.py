"""Tests of ``python -m hpcdl.report`` on small run files written with ``RunFile``."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from hpcdl.errors import ConfigError, HpcdlError
from hpcdl.report import main, summarize
from hpcdl.store.runfile import RunFile

NAN = math.nan
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _rows(steps: int, acc_at: dict[int, float], train: bool) -> list[dict[str, float]]:
    rows = []
    for step in range(1, steps + 1):
        row = {
            "step": step,
            "epoch": 0,
            "time": 0.5 * step,
            "loss": 2.0 / step,
            "lr": 0.1,
            "step_time": 0.5,
            "samples_per_s": 100.0 + step,
        }
        if train:
            row["train_accuracy"] = 0.5 + 0.05 * step
        if step in acc_at:
            row["test_accuracy"] = acc_at[step]  # other rows: NaN (not evaluated)
        rows.append(row)
    return rows


def _write(path: Path, name: str, world: str, ranks: int, rows: list[dict], **attrs: object) -> Path:
    with RunFile.create(path, {"name": name, "world": world, "ranks": ranks}, ranks=ranks) as run:
        run.append_metrics(rows)
        n = len(rows)
        rng = np.random.default_rng(ranks)
        run.append_ranks({s: rng.uniform(0.001, 0.01, size=(n, ranks)) for s in run.h5["ranks"]})
        run.set_attrs(**attrs)
    return path


@pytest.fixture
def runs(tmp_path: Path) -> dict[str, tuple[Path, list[dict]]]:
    rows_a = _rows(6, {3: 0.61, 5: 0.72}, train=True)  # last row not evaluated
    rows_b = _rows(4, {2: 0.40, 4: 0.55}, train=False)
    a = _write(tmp_path / "alpha.h5", "mlp-a", "mpi", 2, rows_a, status="finished", wall_s=3.5)
    b = _write(tmp_path / "beta.h5", "mlp-b", "sim", 3, rows_b, status="stopped", samples_per_s=250.0)
    empty = _write(tmp_path / "empty.h5", "crashed", "mpi", 4, [], status="failed")
    return {"alpha": (a, rows_a), "beta": (b, rows_b), "empty": (empty, [])}


def _expected_accuracy(rows: list[dict]) -> str:
    evaluated = [r["test_accuracy"] for r in rows if not math.isnan(r.get("test_accuracy", NAN))]
    return f"{100 * evaluated[-1]:.2f}" if evaluated else "-"


def _table_rows(out: str) -> dict[str, list[str]]:
    return {line.split()[0]: line.split() for line in out.splitlines() if line and not line.startswith("/")}


def test_report_table_and_plots(runs, tmp_path, capsys):
    plots = tmp_path / "plots"
    assert main([str(p) for p, _ in runs.values()] + ["--out", str(plots)]) == 0
    out = capsys.readouterr().out
    table = _table_rows(out)
    assert table["run"][:3] == ["run", "config", "world"]
    for stem, ranks, name in (("alpha", 2, "mlp-a"), ("beta", 3, "mlp-b"), ("empty", 4, "crashed")):
        _, rows = runs[stem]
        run, config, _world, n_ranks, steps, acc, *_ = table[stem]
        assert config == name
        assert int(n_ranks) == ranks
        assert int(steps) == (rows[-1]["step"] if rows else 0)
        assert acc == _expected_accuracy(rows)
    assert table["alpha"][-1] == "finished" and table["empty"][-1] == "failed"
    assert table["alpha"][6] == "3.5"  # wall_s attribute
    assert table["beta"][6] == "2.0"  # no wall_s attribute: last metrics/time
    assert table["beta"][7] == "250"  # samples_per_s attribute
    assert table["alpha"][7] == f"{np.median([101, 102, 103, 104, 105, 106]):.0f}"  # median of the series
    # columns are aligned: every table line has its fields at the same offsets
    lines = [ln for ln in out.splitlines() if ln and not ln.startswith("/") and not ln.startswith("-")]
    assert len({ln.index(ln.split()[1]) for ln in lines}) == 1
    written = [Path(ln) for ln in out.splitlines() if ln.startswith("/")]
    assert sorted(p.name for p in written) == ["accuracy.png", "loss.png", "ranks.png"]
    for name in ("loss.png", "accuracy.png", "ranks.png"):
        assert (plots / name).read_bytes()[:8] == PNG_MAGIC


def test_summarize(runs):
    row = summarize(runs["alpha"][0])
    assert row["run"] == "alpha" and row["world"] == "mpi" and row["status"] == "finished"
    assert row["steps"] == 6 and row["ranks"] == 2
    assert row["test_accuracy"] == pytest.approx(72.0)
    assert row["wall_s"] == 3.5
    empty = summarize(runs["empty"][0])
    assert empty["steps"] == 0 and empty["test_accuracy"] is None and empty["wall_s"] is None


def test_default_out_is_first_run_directory(runs, tmp_path, capsys):
    assert main([str(runs["beta"][0])]) == 0
    assert (tmp_path / "loss.png").read_bytes()[:8] == PNG_MAGIC


def test_only_empty_run_writes_no_plots(runs, tmp_path, capsys):
    assert main([str(runs["empty"][0]), "--out", str(tmp_path / "none")]) == 0
    assert "empty" in capsys.readouterr().out
    assert not list((tmp_path / "none").glob("*.png"))


def test_same_stems_get_unique_labels(tmp_path, capsys):
    a = _write(tmp_path / "a" / "run.h5", "mlp", "mpi", 2, _rows(2, {}, train=False))
    b = _write(tmp_path / "b" / "run.h5", "mlp", "mpi", 3, _rows(2, {}, train=False))
    assert main([str(a), str(b), "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "mlp (2 ranks)" in out and "mlp (3 ranks)" in out


def test_without_matplotlib_prints_table(runs, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert main([str(runs["alpha"][0]), "--out", str(tmp_path / "p")]) == 0
    out = capsys.readouterr().out
    assert "alpha" in out and "pip install hpcdl[plot]" in out
    assert not (tmp_path / "p").exists()


def test_missing_file(tmp_path):
    missing = tmp_path / "nope.h5"
    with pytest.raises(HpcdlError, match="nope.h5"):
        main([str(missing)])


@pytest.mark.parametrize("kind", ["text", "hdf5", "no-metrics"])
def test_not_a_run_file(tmp_path, kind):
    path = tmp_path / f"{kind}.h5"
    if kind == "text":
        path.write_text("step,loss\n1,2.0\n")
    else:
        with h5py.File(path, "w") as f:
            f.create_dataset("x", data=np.arange(3))
            if kind == "no-metrics":
                f.attrs["format_version"] = 1
    with pytest.raises(HpcdlError, match=f"{kind}.h5") as err:
        main([str(path)])
    assert "\n" not in str(err.value)


def test_usage_error():
    with pytest.raises(ConfigError):
        main([])


def test_run_file_reads_into_pandas(runs):
    pd = pytest.importorskip("pandas")
    path, rows = runs["alpha"]
    with h5py.File(path, "r") as f:  # plain h5py + pandas: nothing from hpcdl
        df = pd.DataFrame({k: f["metrics"][k][...] for k in f["metrics"]})
    assert len(df) == len(rows)
    assert df["step"].tolist() == [r["step"] for r in rows]
    assert df["test_accuracy"].notna().sum() == 2
