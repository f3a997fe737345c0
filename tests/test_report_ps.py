"""``python -m hpcdl.report`` on parameter-server runs: τ histograms, samples processed, τ columns.

The run files are written as the ``ps`` strategy will write them (the ``staleness/``
group, ``metrics/samples``, the ``placement`` and ``config`` attributes), with
``RunFile`` and plain h5py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import h5py
import numpy as np
import pytest

from hpcdl.parallel.ps_schema import tau_histogram
from hpcdl.report import format_table, load, main, samples_per_step, summarize
from hpcdl.report.plots import rank_times
from hpcdl.report.strategy import mode_label
from hpcdl.store.runfile import RunFile

NAN = math.nan
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _placement(
    strategy: str,
    members: int,
    *,
    servers: int = 0,
    switch: bool = False,
    batch: int = 8,
    micro_steps: int = 1,
) -> str:
    """The ``placement`` attribute: ``servers`` servers then ``members`` workers (ps), or members
    and a switch rank set aside (sync)."""
    ranks = [{"role": "server", "holds": f"shard {k}", "member": -1} for k in range(servers)]
    role = "worker" if strategy == "ps" else "member"
    ranks += [{"role": role, "holds": "model", "member": m} for m in range(members)]
    if switch:
        ranks.append({"role": "switch", "holds": "", "member": -1})
    return json.dumps({"strategy": strategy, "ranks": ranks, "batch_size": batch, "micro_steps": micro_steps})


def _config(name: str, strategy: str, **parallel: object) -> str:
    body = "".join(f"{k} = {json.dumps(v)}\n" for k, v in parallel.items())
    return f'name = "{name}"\n\n[data]\nbatch_size = 8\n\n[parallel]\nstrategy = "{strategy}"\n{body}'


def _write(
    path: Path,
    *,
    strategy: str,
    placement: str | None,
    steps: int = 10,
    samples: bool = False,
    tau: np.ndarray | None = None,
    workers: int = 1,
    servers: int = 1,
    **parallel: object,
) -> Path:
    """A run file of ``steps`` rows, evaluated at every 5th step; ``tau``: its ``staleness/`` rows."""
    ranks = servers + workers if strategy == "ps" else workers
    attrs: dict[str, object] = {"name": path.stem, "world": "sim", "ranks": ranks, "strategy": strategy,
                                "config": _config(path.stem, strategy, **parallel)}  # fmt: skip
    if placement is not None:
        attrs["placement"] = placement
    rows = [{"step": k, "time": 0.25 * k, "loss": 2.0 / k, "test_accuracy": 0.1 * k if k % 5 == 0 else NAN}
            for k in range(1, steps + 1)]  # fmt: skip
    with RunFile.create(path, attrs, ranks=ranks) as run:
        run.append_metrics(rows)
        rank_rows = {s: np.full((steps, ranks), 1e-3) for s in run.h5["ranks"]}
        if strategy == "ps":  # servers record no compute; no other_time either (an older writer)
            rank_rows["compute_time"][:, :servers] = NAN
        run.append_ranks(rank_rows)
        if strategy == "ps":
            del run.h5["ranks/other_time"]
        run.set_attrs(status="finished")
    with h5py.File(path, "r+") as h5:
        del h5["metrics/samples"]  # an older writer had none
        if samples:  # a newer writer: what each row processed, here 3 samples per step
            h5["metrics"].create_dataset("samples", data=3 * np.arange(1, steps + 1, dtype=np.int64))
        if tau is not None:
            n = len(tau)
            columns = {
                "update": np.arange(1, n + 1, dtype=np.int64),
                "worker": (np.arange(n) % workers).astype(np.int32),
                "server": (np.arange(n) % servers).astype(np.int32),
                "tau": np.asarray(tau, dtype=np.int64),
                "time": np.linspace(0.0, 0.25 * steps, n),
            }
            group = h5.create_group("staleness")
            for name, data in columns.items():  # appended as pushes are applied: resizable
                group.create_dataset(name, data=data, maxshape=(None,), chunks=(64,))
    return path


def _ps(path: Path, tau: np.ndarray, mode: str = "async", workers: int = 3, **parallel: object) -> Path:
    return _write(path, strategy="ps", placement=_placement("ps", workers, servers=1), tau=tau,
                  workers=workers, mode=mode, servers=1, **parallel)  # fmt: skip


def _sync(path: Path, **kw: object) -> Path:
    return _write(path, strategy="sync", placement=_placement("sync", 2, micro_steps=2), workers=2, **kw)


#: a known distribution of τ: value -> count (3 never occurs)
KNOWN = {0: 50, 1: 30, 2: 15, 4: 5}


def _known_tau(seed: int = 0) -> np.ndarray:
    tau = np.repeat(list(KNOWN), list(KNOWN.values()))
    return np.random.default_rng(seed).permutation(tau)


# -- loading ----------------------------------------------------------------------------------


def test_load_carries_the_staleness_columns_cut_to_the_shortest(tmp_path: Path) -> None:
    path = _ps(tmp_path / "a.h5", _known_tau())
    with h5py.File(path, "r+") as h5:  # a writer died between two appends: one column is longer
        h5["staleness/time"].resize((len(_known_tau()) + 3,))
    run = load(path)
    assert sorted(run.staleness) == ["server", "tau", "time", "update", "worker"]
    assert {len(v) for v in run.staleness.values()} == {sum(KNOWN.values())}
    np.testing.assert_array_equal(run.staleness["tau"], _known_tau())
    assert load(_sync(tmp_path / "s.h5")).staleness == {}


# -- samples processed --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("strategy", "per_step"),
    [("ps", 8), ("sync", 2 * 2 * 8)],  # ps: one push of batch 8; sync: 2 members x 2 micro-steps x 8
)
def test_samples_of_an_older_file_come_from_steps_and_placement(tmp_path: Path, strategy, per_step) -> None:
    path = _ps(tmp_path / "ps.h5", _known_tau()) if strategy == "ps" else _sync(tmp_path / "sync.h5")
    run = load(path)
    assert "samples" not in run.metrics  # an older file
    assert samples_per_step(run.attrs) == per_step
    np.testing.assert_array_equal(run.samples, per_step * np.arange(1, 11))


def test_a_switch_rank_set_aside_is_not_a_member() -> None:
    attrs = {"placement": _placement("sync", 3, switch=True, batch=16)}
    assert samples_per_step(attrs) == 3 * 16
    assert samples_per_step({}) is None and samples_per_step({"placement": "{not json"}) is None


def test_recorded_samples_are_used_as_recorded(tmp_path: Path) -> None:
    path = _sync(tmp_path / "new.h5", samples=True)
    np.testing.assert_array_equal(load(path).samples, 3 * np.arange(1, 11))  # not 32 per step
    with h5py.File(path, "r+") as h5:  # rows a writer left at 0 (the series' fill): not recorded
        h5["metrics/samples"][:4] = 0
    np.testing.assert_array_equal(load(path).samples, [32, 64, 96, 128, *(3 * np.arange(5, 11))])


def test_accuracy_by_samples_puts_strategies_on_one_axis(tmp_path: Path, figures, capsys) -> None:
    a = _ps(tmp_path / "a.h5", _known_tau())
    b = _sync(tmp_path / "b.h5")
    assert main([str(a), str(b), "--out", f"{tmp_path}/p/"]) == 0
    fig = figures["a+b-accuracy"]
    assert [ax.get_xlabel() for ax in fig.axes] == ["step", "samples processed", "time (s)"]
    by_samples = fig.axes[1]
    tests = {ln.get_label(): ln.get_xdata() for ln in by_samples.get_lines()}
    np.testing.assert_array_equal(tests["a test"], [8 * 5, 8 * 10])  # evaluated at steps 5 and 10
    np.testing.assert_array_equal(tests["b test"], [32 * 5, 32 * 10])
    loss = figures["a+b-loss"]
    assert [ax.get_xlabel() for ax in loss.axes] == ["step", "samples processed", "time (s)"]


def test_a_run_without_placement_is_named_as_not_shown(tmp_path: Path, figures, capsys) -> None:
    a = _sync(tmp_path / "a.h5")
    old = _write(tmp_path / "old.h5", strategy="sync", placement=None, workers=2)
    assert load(old).samples is None
    assert main([str(a), str(old), "--out", f"{tmp_path}/p/"]) == 0
    by_samples = figures["a+old-accuracy"].axes[1]
    assert [ln.get_label() for ln in by_samples.get_lines()] == ["a test"]
    assert "not shown (unknown): old" in [t.get_text() for t in by_samples.texts]
    assert main([str(old), "--out", f"{tmp_path}/q/"]) == 0  # nothing to show by samples: no such panel
    assert [ax.get_xlabel() for ax in figures["old-accuracy"].axes] == ["step", "time (s)"]


# -- the staleness histogram -----------------------------------------------------------------


def test_tau_histogram_against_numpy() -> None:
    tau = _known_tau()
    values, frequency = tau_histogram(tau)
    np.testing.assert_array_equal(values, np.arange(0, 5))  # integer bins, 3 included though empty
    counts, _ = np.histogram(tau, bins=np.arange(-0.5, 5.5))
    np.testing.assert_allclose(frequency, counts / tau.size)
    np.testing.assert_allclose(frequency, [0.5, 0.3, 0.15, 0.0, 0.05])
    assert frequency.sum() == pytest.approx(1.0)
    values, frequency = tau_histogram(np.zeros(7, dtype=np.int64))  # sync: all at 0
    assert values.tolist() == [0] and frequency.tolist() == [1.0]
    assert [len(x) for x in tau_histogram(np.zeros(0))] == [0, 0]


def test_runs_of_different_lengths_compare(tmp_path: Path, figures, capsys) -> None:
    """The same distribution, twice as many pushes: the same frequencies are drawn."""
    a = _ps(tmp_path / "a.h5", _known_tau(1))
    b = _ps(tmp_path / "b.h5", np.concatenate([_known_tau(2), _known_tau(3)]), mode="ssp", staleness=1)
    assert main([str(a), str(b), "--out", f"{tmp_path}/p/"]) == 0
    (ax,) = figures["a+b-staleness"].axes
    assert ax.get_yscale() == "log"
    drawn = {ln.get_label(): ln for ln in ax.get_lines() if not ln.get_label().startswith("_")}
    assert list(drawn) == ["a: async", "b: ssp s=1 (SSP allows τ <= 6)"]  # 3 workers: (3 - 1)(2 + 1)
    for line in drawn.values():
        np.testing.assert_array_equal(line.get_xdata(), np.arange(0, 5))
        expected = np.array([0.5, 0.3, 0.15, np.nan, 0.05])  # an empty bin is a gap on the log axis
        np.testing.assert_allclose(line.get_ydata(), expected)
    bounds = [ln.get_xdata()[0] for ln in ax.get_lines() if ln.get_linestyle() == "--"]
    assert bounds == [6]


def test_a_ps_run_beside_a_sync_run_has_one_histogram(tmp_path: Path, figures, capsys) -> None:
    a = _ps(tmp_path / "a.h5", _known_tau())
    b = _sync(tmp_path / "b.h5")
    assert main([str(a), str(b), "--out", f"{tmp_path}/p/"]) == 0
    out = capsys.readouterr().out
    written = sorted(Path(ln).name for ln in out.splitlines() if ln.startswith("/"))
    assert written == [f"a+b-{f}.png" for f in ("accuracy", "loss", "ranks", "staleness")]
    assert (tmp_path / "p" / "a+b-staleness.png").read_bytes()[:8] == PNG_MAGIC
    (ax,) = figures["a+b-staleness"].axes
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["a: async"]


def test_no_staleness_rows_no_staleness_png(tmp_path: Path, capsys) -> None:
    a = _ps(tmp_path / "a.h5", np.zeros(0, dtype=np.int64))  # a ps run that applied nothing yet
    b = _sync(tmp_path / "b.h5")
    assert main([str(a), str(b), "--out", f"{tmp_path}/p/"]) == 0
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == [
        "a+b-accuracy.png", "a+b-loss.png", "a+b-ranks.png"]  # fmt: skip


def test_mode_labels(tmp_path: Path) -> None:
    def attrs(**parallel: object) -> dict:
        return {"strategy": "ps", "config": _config("x", "ps", **parallel)}

    assert mode_label(attrs(mode="async", compensation="none")) == "async"
    assert mode_label(attrs(mode="ssp", staleness=2)) == "ssp s=2"
    assert mode_label(attrs(mode="sync")) == "sync"
    assert mode_label(attrs(mode="async", compensation="dc")) == "async, dc"
    assert mode_label({"strategy": "pipeline", "config": ""}) == "pipeline"


# -- the table --------------------------------------------------------------------------------


def test_tau_columns_only_when_a_run_has_staleness(tmp_path: Path) -> None:
    a = summarize(_ps(tmp_path / "a.h5", _known_tau()))
    b = summarize(_sync(tmp_path / "b.h5"))
    assert (a["tau_median"], a["tau_max"]) == (np.median(_known_tau()), 4)
    assert (b["tau_median"], b["tau_max"]) == (None, None)
    assert "τ" not in format_table([b])
    lines = format_table([a, b]).splitlines()
    header = lines[0].split()
    assert header[-5:] == ["τ", "median", "τ", "max", "status"]
    ps_row, sync_row = lines[2].split(), lines[3].split()
    assert ps_row[-3:] == ["0.5", "4", "finished"]  # median of 50 zeros and 50 ones and more: 0.5
    assert sync_row[-3:] == ["-", "-", "finished"]
    end = lines[0].index("τ max") + len("τ max")  # numbers are right-aligned under their header
    assert lines[2][:end].endswith(" 4") and lines[3][:end].endswith(" -")


def test_ps_ranks_outside_the_step_is_not_estimated(tmp_path: Path) -> None:
    """A ps run's ranks do not meet each step: the step clock says nothing of their time outside it."""
    times = rank_times(load(_ps(tmp_path / "a.h5", _known_tau())))
    assert times is not None and "other" not in times.mean and not times.other_estimated
    assert np.isnan(times.per_row["compute"][:, 0]).all()  # the server computes nothing


# -- ranks.png of a run whose ranks/ rows are meetings ---------------------------------------


def test_a_meeting_row_is_divided_by_the_pushes_each_rank_made_or_served() -> None:
    """Workers share a meeting's pushes by their pushes_per_s; a server serves every one of them."""
    from hpcdl.report import Run

    nan = np.nan
    ranks = {
        "step": np.array([30, 60]),  # meetings of 30 pushes each
        "compute_time": np.array([[0.6, 2.0, 2.0], [0.3, 2.0, 2.0]]),
        "comm_time": np.array([[2.4, 1.0, 1.0], [2.7, 1.0, 1.0]]),
        "wait_time": np.zeros((2, 3)),
        "other_time": np.zeros((2, 3)),
        # worker 2 four times as fast as worker 1, then as fast
        "pushes_per_s": np.array([[nan, 2.0, 8.0], [nan, 5.0, 5.0]]),
        "busy_fraction": np.array([[0.2, nan, nan], [0.1, nan, nan]]),
    }
    times = rank_times(Run(Path("ps.h5"), {"strategy": "ps"}, {"step": np.arange(1, 61)}, ranks))
    assert times is not None and times.meetings and times.unit == "push"
    np.testing.assert_allclose(times.counts, [[30, 6, 24], [30, 15, 15]])
    per_push = [[0.6 / 30, 2 / 6, 2 / 24], [0.3 / 30, 2 / 15, 2 / 15]]
    np.testing.assert_allclose(times.per_row["compute"], 1e3 * np.array(per_push))
    np.testing.assert_allclose(times.mean["compute"], 1e3 * np.array([0.9 / 60, 4 / 21, 4 / 39]))  # overall
    assert set(times.series) == {"pushes_per_s", "busy_fraction"}


def test_a_ps_runs_ranks_plot_is_per_push_against_pushes(tmp_path: Path, figures, capsys) -> None:
    """A simulated ps run (1 server, 2 workers) meeting every 10 pushes: the bars are each rank's
    time per push (a worker's about 1 / its pushes_per_s), not the meeting's total; below, per
    meeting against the pushes applied, the workers' pushes per second and the server's busy
    fraction as the file holds them."""
    from ps_config import cfg
    from simulated import sim

    out = tmp_path / "ps.h5"
    sim(3, cfg("train.steps=40", "checkpoint.every=10", "ps.mode=async"), out=out)
    capsys.readouterr()
    run = load(out)
    r = run.ranks
    np.testing.assert_array_equal(r["step"], [10, 20, 30, 40])  # a row per meeting
    times = rank_times(run)
    assert times is not None and times.meetings and times.unit == "push"
    np.testing.assert_allclose(times.counts[:, 1:].sum(axis=1), 10)  # the workers made the 10 pushes
    np.testing.assert_allclose(times.counts[:, 0], 10)  # the server served each
    per_push = sum(times.per_row[k] for k in ("compute", "communication", "waiting", "other"))
    meeting_ms = 1e3 * (r["compute_time"] + r["comm_time"] + r["other_time"])
    np.testing.assert_allclose(per_push * times.counts, meeting_ms)  # the file's times, divided
    in_phase = per_push - times.per_row["other"]
    np.testing.assert_allclose(in_phase[:, 1:], 1e3 / r["pushes_per_s"][:, 1:], rtol=0.1)  # a push's time

    assert main([str(out), "--out", f"{tmp_path}/p/"]) == 0
    fig = figures["ranks"]
    by_rank, per_meeting, fraction = fig.axes
    assert by_rank.get_ylabel() == "mean time per push made or served (ms)"
    assert [t.get_text() for t in by_rank.get_xticklabels()] == ["0\nserver", "1\nworker", "2\nworker"]
    bars = sum(np.array([b.get_height() for b in c]) for c in by_rank.containers)
    np.testing.assert_allclose(bars, sum(times.mean.values()))
    assert (bars[1:] < meeting_ms[:, 1:].min() / 4).all()  # per push, not per meeting (5 pushes each)
    assert per_meeting.get_xlabel().startswith("pushes applied") and "step" not in per_meeting.get_xlabel()
    assert per_meeting.get_ylabel() == "pushes per second"
    assert fraction.get_ylabel() == "fraction of the phase"
    lines = {
        p.get_label(): p for ax in (per_meeting, fraction) for p in ax.patches if "median" in p.get_label()
    }
    assert sorted(lines) == ["busy fraction (1 server): median, min-max",
                             "pushes per second (2 workers): median, min-max"]  # fmt: skip
    rate, edges, _ = lines["pushes per second (2 workers): median, min-max"].get_data()
    np.testing.assert_array_equal(edges, [0, 10, 20, 30, 40])
    np.testing.assert_allclose(rate, np.median(r["pushes_per_s"][:, 1:], axis=1))
    busy, _, _ = lines["busy fraction (1 server): median, min-max"].get_data()
    np.testing.assert_allclose(busy, r["busy_fraction"][:, 0])
