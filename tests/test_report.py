"""Tests of ``python -m hpcdl.report`` on small run files written with ``RunFile``."""

from __future__ import annotations

import math
import struct
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from report_figures import written_plots

from hpcdl.errors import ConfigError, HpcdlError
from hpcdl.report import load, main, summarize
from hpcdl.store.runfile import RunFile, RunFileError

NAN = math.nan
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _rows(steps: int, acc_at: dict[int, float], train: bool) -> list[dict[str, float]]:
    rows = []
    for step in range(1, steps + 1):
        row = {
            "step": step,
            "epoch": 0,
            "time": 0.5 * step,
            "samples": 10 * step,
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


def _expected_accuracy(rows: list[dict], final: bool) -> str:
    evaluated = [r["test_accuracy"] for r in rows if not math.isnan(r.get("test_accuracy", NAN))]
    return f"{100 * evaluated[-1]:.2f}{'' if final else '*'}" if evaluated else "-"


def _table_rows(out: str) -> dict[str, list[str]]:
    lines = [ln for ln in out.splitlines() if ln and not ln.startswith(("/", "*"))]
    return {line.split()[0]: line.split() for line in lines}


def test_report_table_and_plots(runs, tmp_path, capsys):
    plots = tmp_path / "plots"
    assert main([str(p) for p, _ in runs.values()] + ["--out", f"{plots}/"]) == 0
    out = capsys.readouterr().out
    table = _table_rows(out)
    assert table["run"][:3] == ["run", "config", "world"]
    for stem, ranks, name in (("alpha", 2, "mlp-a"), ("beta", 3, "mlp-b"), ("empty", 4, "crashed")):
        _, rows = runs[stem]
        run, config, _world, n_ranks, steps, acc, *_ = table[stem]
        assert config == name
        assert int(n_ranks) == ranks
        assert int(steps) == (rows[-1]["step"] if rows else 0)
        assert acc == _expected_accuracy(rows, final=stem == "alpha")  # beta stopped: marked
    assert table["alpha"][-1] == "finished" and table["empty"][-1] == "failed"
    assert table["alpha"][6] == "3.5"  # wall_s attribute
    assert table["beta"][6] == "2.0"  # no wall_s attribute: last metrics/time
    assert table["beta"][7] == "250"  # samples_per_s attribute
    assert table["alpha"][7] == "20"  # no samples_per_s attribute: the last row's samples / time (60 / 3.0)
    # columns are aligned: every table line has its fields at the same offsets
    lines = [ln for ln in out.splitlines() if ln and not ln.startswith(("/", "-", "*"))]
    assert len({ln.index(ln.split()[1]) for ln in lines}) == 1
    assert "* not a final result" in out and "beta at step 4" in out
    written = [Path(ln) for ln in out.splitlines() if ln.startswith("/")]
    prefix = "alpha+beta+empty"
    assert sorted(p.name for p in written) == [f"{prefix}-{f}.png" for f in ("accuracy", "loss", "ranks")]
    for path in written:
        assert path.parent == plots and path.read_bytes()[:8] == PNG_MAGIC


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
    assert (tmp_path / "beta-loss.png").read_bytes()[:8] == PNG_MAGIC


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


def _chunks(path: Path) -> list[tuple[int, str, int]]:
    """Every chunk of ``path`` as (byte offset, series, its first row), in file order."""
    chunks: list[tuple[int, str, int]] = []

    def add(name: str, d: object) -> None:
        if isinstance(d, h5py.Dataset) and d.chunks:
            info = (d.id.get_chunk_info(i) for i in range(d.id.get_num_chunks()))
            chunks.extend((c.byte_offset, name, c.chunk_offset[0]) for c in info)

    with h5py.File(path) as f:
        f.visititems(add)
    return sorted(chunks)


def _cut_at(path: Path, end: int) -> None:
    """Cut ``path`` at ``end`` and write that end into the superblock, as a writer killed while
    it flushed can leave it: the superblock agrees, what it names past ``end`` is gone."""
    raw = bytearray(path.read_bytes()[:end])
    assert raw[8] == 0  # superblock version 0: its end-of-file address is at byte 40
    raw[40:48] = struct.pack("<Q", end)
    path.write_bytes(bytes(raw))


def test_a_run_file_whose_writer_died_mid_flush_reports_the_rows_that_survived(tmp_path, capsys):
    path = _write(tmp_path / "killed.h5", "mlp", "mpi", 2, _rows(1100, {}, True), status="running")
    offset, name, rows = _chunks(path)[-1]  # the last chunk is cut: the series before it survive
    _cut_at(path, offset + 8)
    with h5py.File(path) as f, pytest.raises(OSError, match="addr overflow"):
        f[name][...]  # what h5py makes of it
    run = load(path)
    assert run.cut == (name,) and 0 < rows < 1100
    group = run.metrics if name.startswith("metrics/") else run.ranks
    assert {len(v) for v in group.values()} == {rows}  # the group cut to its shortest series
    assert main([str(path), "--out", f"{tmp_path}/plots/"]) == 0
    err = capsys.readouterr().err
    assert f"{path}: read up to the rows its writer flushed before it died ({name} end past" in err


def test_a_run_file_whose_metadata_lies_past_its_end_is_one_line(tmp_path):
    path = _write(tmp_path / "killed.h5", "mlp", "mpi", 2, _rows(30, {}, True), status="running")
    with h5py.File(path) as f:
        metrics = h5py.h5o.get_info(f["metrics"].id).addr
    _cut_at(path, metrics + 8)  # metrics/'s own header is cut
    with pytest.raises(RunFileError, match=r"killed.h5: it is damaged .*or not an hpcdl run file$"):
        load(path)


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


# -- the plots: names, axes, legends, per-rank accounting at 2, 64 and 1,024 ranks -------------


@pytest.fixture
def figures(monkeypatch: pytest.MonkeyPatch) -> list:
    """The matplotlib figures the report saves, in order (loss, accuracy, ranks)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    saved: list = []
    original = Figure.savefig

    def savefig(self, fname, *args, **kwargs):  # noqa: ANN001, ANN202
        saved.append(self)
        return original(self, fname, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return saved


def _synchronous(ranks: int, steps: int, period_ms: float, outside_ms: np.ndarray, compute_ms: np.ndarray):
    """Per-rank series of ranks that meet every step: each spends ``period_ms`` per step.

    Rank r computes ``compute_ms[r]``, moves data for 0.1 ms and spends ``outside_ms[r]``
    outside the step; the rest of its period it waits in the exchange (as RunLog
    records it: communication above the fastest rank's is waiting).
    """
    moving = 0.1
    comm = period_ms - compute_ms - outside_ms  # moving + waiting
    assert (comm >= moving).all()
    wait = comm - comm.min()
    tile = lambda v: np.tile(1e-3 * v, (steps, 1))  # noqa: E731
    series = {"compute_time": tile(compute_ms), "comm_time": tile(comm), "wait_time": tile(wait),
              "exposed_comm_time": tile(comm)}  # fmt: skip
    return series, tile(outside_ms)


def _write_synchronous(path: Path, ranks: int, *, record_other: bool, steps: int = 12) -> tuple[Path, dict]:
    """A run file where rank 0 spends 0.3 ms more outside the step and one rank computes 3x longer."""
    rng = np.random.default_rng(ranks)
    compute = rng.uniform(0.4, 0.5, ranks)
    straggler = ranks * 2 // 3
    compute[straggler] = 1.5
    outside = np.full(ranks, 0.05)
    outside[0] = 0.35  # rank 0 writes the run file, shows progress
    period = float((compute + outside).max() + 0.1 + 0.2)
    series, other = _synchronous(ranks, steps, period, outside, compute)
    rows = [{"step": k + 1, "time": 1e-3 * period * (k + 1), "loss": 1.0 / (k + 1),
             "test_accuracy": 0.5 if k == steps - 1 else NAN} for k in range(steps)]  # fmt: skip
    if record_other:
        series["other_time"] = other
    with RunFile.create(path, {"name": "sync", "world": "sim", "ranks": ranks}, ranks=ranks) as run:
        run.append_metrics(rows)
        group = run.h5["ranks"]
        for name in list(group):  # whatever series this hpcdl creates: exactly these
            del group[name]
        for name, data in series.items():
            group.create_dataset(name, data=data)
        run.set_attrs(status="finished")
    return path, {"period": period, "outside": outside, "compute": compute, "straggler": straggler}


@pytest.mark.parametrize("record_other", [True, False], ids=["other_time recorded", "old file"])
def test_ranks_bars_add_up_to_the_step_period(tmp_path: Path, record_other: bool) -> None:
    from hpcdl.report import load
    from hpcdl.report.plots import rank_times

    path, truth = _write_synchronous(tmp_path / "sync.h5", 4, record_other=record_other)
    times = rank_times(load(path))
    assert times is not None and times.ranks == 4
    assert times.other_estimated is not record_other
    assert list(times.mean) == ["compute", "communication", "waiting", "other"]
    total = sum(times.mean.values())
    np.testing.assert_allclose(total, truth["period"], rtol=1e-9)  # every rank's bar is the period
    np.testing.assert_allclose(times.mean["other"], truth["outside"], atol=1e-9)  # rank 0's extra counted
    np.testing.assert_allclose(times.mean["compute"], truth["compute"], rtol=1e-9)
    assert ("other" in times.per_row) is record_other


def test_plots_are_named_after_the_run_and_a_second_report_keeps_the_first(tmp_path: Path, capsys) -> None:
    a = _write(tmp_path / "a.h5", "mlp", "mpi", 2, _rows(4, {4: 0.5}, train=True), status="finished")
    b = _write(tmp_path / "b.h5", "mlp", "mpi", 2, _rows(5, {5: 0.6}, train=True), status="finished")
    assert main([str(a)]) == 0
    first = {f: (tmp_path / f"a-{f}.png").read_bytes() for f in ("loss", "accuracy", "ranks")}
    assert main([str(b)]) == 0
    for f, data in first.items():
        assert (tmp_path / f"a-{f}.png").read_bytes() == data
        assert (tmp_path / f"b-{f}.png").read_bytes()[:8] == PNG_MAGIC
    assert main([str(a), str(b), "--out", str(tmp_path / "cmp" / "ab")]) == 0  # a prefix
    assert sorted(p.name for p in (tmp_path / "cmp").iterdir()) == [
        "ab-accuracy.png", "ab-loss.png", "ab-ranks.png"]  # fmt: skip
    assert main([str(a), str(b), "--out", str(tmp_path)]) == 0  # an existing directory
    assert (tmp_path / "a+b-loss.png").read_bytes()[:8] == PNG_MAGIC
    assert not list(tmp_path.glob(".*tmp*"))  # no temporary file left behind


def test_loss_on_a_log_axis_and_a_legend_on_every_panel(runs, tmp_path, figures, capsys) -> None:
    assert main([str(runs["alpha"][0]), str(runs["beta"][0]), "--out", f"{tmp_path}/p/"]) == 0
    loss, accuracy, ranks = figures
    assert [ax.get_yscale() for ax in loss.axes] == ["log", "log", "log"]
    assert [ax.get_xlabel() for ax in loss.axes] == ["step", "samples processed", "time (s)"]
    assert len(ranks.axes) == 4  # per run: by rank, and per step
    for fig in figures:
        for ax in fig.axes:
            assert ax.get_legend() is not None, f"{ax.get_title() or ax.get_ylabel()}: no legend"
            assert len(ax.get_legend().get_texts()) >= 1


@pytest.mark.parametrize("ranks", [2, 64, 1024])
def test_ranks_png_is_readable_at_scale(tmp_path: Path, figures, capsys, ranks: int) -> None:
    path, truth = _write_synchronous(tmp_path / f"r{ranks}.h5", ranks, record_other=True)
    assert main([str(path)]) == 0
    (fig,) = [f for f in figures if len(f.axes) == 2 and f.axes[0].get_xlabel() == "rank"]
    by_rank, per_step = fig.axes
    fig.canvas.draw()
    ticks = [t for t in by_rank.get_xticklabels() if t.get_text()]
    assert 2 <= len(ticks) <= 13, [t.get_text() for t in ticks]  # not one label per rank
    assert by_rank.get_xlim()[1] >= ranks - 1
    assert by_rank.get_ylim()[1] >= truth["period"]  # the stacked total is on the axis
    legend = [t.get_text() for t in by_rank.get_legend().get_texts()]
    assert legend == ["compute", "communication", "waiting for slower ranks", "outside the step"]
    if ranks > 4:  # the straggler is named: at 1,024 ranks its bar is thinner than a pixel
        texts = " ".join(t.get_text() for t in by_rank.texts)
        assert f"rank {truth['straggler']} (1.50)" in texts
    assert per_step.get_yscale() == "log" and per_step.get_xlabel() == "step"
    assert (tmp_path / f"r{ranks}-ranks.png").read_bytes()[:8] == PNG_MAGIC


# -- what a new user types first --------------------------------------------------------------


@pytest.fixture
def demo(tmp_path: Path) -> Path:
    """A run trained in this process, its two checkpoints beside it (and a partial one a killed run left)."""
    from hpcdl.config import load_config
    from hpcdl.driver import train

    out = tmp_path / "demo-1.h5"
    train(load_config("digits-mlp", ["train.steps=4", "checkpoint.every=2"]), out=out)
    (tmp_path / "demo-1.ckpt-00000006.h5.4242.tmp").write_bytes(b"half")
    return out


def test_a_glob_that_matches_checkpoints_reports_the_runs(runs, demo: Path, tmp_path: Path, capsys) -> None:
    """The README's report runs/cnn.h5 runs/demo-*.h5: the checkpoints the glob matched are skipped."""
    glob = sorted(str(p) for p in tmp_path.glob("demo-*.h5"))
    assert [Path(p).name for p in glob] == ["demo-1.ckpt-00000002.h5", "demo-1.ckpt-00000004.h5", "demo-1.h5"]
    assert main([str(runs["alpha"][0]), *glob, "--out", f"{tmp_path}/p/"]) == 0
    out, err = capsys.readouterr()
    assert set(_table_rows(out)) >= {"alpha", "demo-1"} and "ckpt" not in out.replace(str(tmp_path), "")
    skipped = f"hpcdl.report: skipped 2 checkpoint files ({glob[0]}, {glob[1]}): report their run file"
    assert err.splitlines() == [skipped]
    assert written_plots(out) == [f"alpha+demo-1-{f}.png" for f in ("accuracy", "loss", "ranks")]
    assert main(sorted(str(p) for p in tmp_path.glob("demo-*"))) == 0  # *.tmp too; not the run file's PNGs
    assert "skipped 3 checkpoint files" in capsys.readouterr().err


def _error(argv: list[str]) -> str:
    with pytest.raises(RunFileError) as err:
        main(argv)
    return str(err.value)


def test_checkpoints_alone_are_one_error_naming_the_run_file(demo: Path, tmp_path: Path) -> None:
    ckpts = [str(p) for p in sorted(tmp_path.glob("demo-1.ckpt-*.h5"))]
    assert _error(ckpts[:1]) == f"{ckpts[0]} is a checkpoint, not a run file: report its run file {demo}"
    assert _error(ckpts).endswith(f": checkpoints, not run files: report their run file ({demo})")
    renamed = tmp_path / "renamed.h5"  # a checkpoint under another name: told by its attributes
    renamed.write_bytes(Path(ckpts[0]).read_bytes())
    assert _error([str(renamed)]) == f"{renamed} is a checkpoint, not a run file: report its run file {demo}"


#: commands whose output is piped to a reader that goes away (RUN: a run file); the fix is the
#: entry point's, so every python -m hpcdl.X has it
PIPED = ["hpcdl.report RUN", "hpcdl.config", "hpcdl.train --config digits-mlp --plan"]


@pytest.mark.parametrize("buffered", [True, False], ids=["buffered", "PYTHONUNBUFFERED"])
@pytest.mark.parametrize("command", PIPED)
def test_a_reader_that_went_away_ends_the_command_quietly(runs, tmp_path: Path, command, buffered) -> None:
    """``python -m hpcdl.report ... | head``: no BrokenPipeError traceback, status 141 as for a Unix tool.

    The pipe's reading end is closed before the command starts (a ``head`` that has read
    all it wanted), so that its first write fails whatever the timing: buffered, when the
    entry point flushes; unbuffered, in the command's first print.
    """
    import os
    import subprocess

    argv = command.replace("RUN", str(runs["alpha"][0])).split()
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "MPLCONFIGDIR": str(tmp_path), "PYTHONUNBUFFERED": "1"}
    if buffered:
        del env["PYTHONUNBUFFERED"]
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run([sys.executable, "-m", *argv], stdout=write, stderr=subprocess.PIPE, text=True,
                              cwd=tmp_path, timeout=120, env=env, check=False)  # fmt: skip
    finally:
        os.close(write)
    assert done.stderr == ""
    assert done.returncode == 141
