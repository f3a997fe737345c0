"""The pipeline strategy (``parallel.strategy = "pipeline"``) in the simulator, against simpler equivalents.

* GPipe and 1F1B at 1-8 stages end with the parameters of one process with
  ``exchange.accumulate = m`` on the same microbatches (float64, relative 1e-10), with the
  same losses and test accuracy; with BatchNorm and residual blocks too;
* with equal stage costs (a cost table) each stage's measured bubble is
  ``(p - 1) / (m + p - 1)`` within 5% for p in {2, 4, 8}, m in {1, 4, 16}; with unequal
  stages it is the analytic timeline's (:func:`~hpcdl.parallel.pipe_plan.simulate`);
* 1F1B holds at most ``p - s`` microbatches on stage s, measured as activation bytes,
  GPipe all m;
* ``balance = "time"`` partitions by a cost table's times; resume repeats the run bit
  for bit; ``--plan`` prints the partition and the schedule; a description that does not
  fit is one line, exit 2; the trace has every forward and backward.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
from simulated import sim

from hpcdl.config import load_config
from hpcdl.driver.run import train
from hpcdl.errors import ConfigError
from hpcdl.parallel.pipe_plan import balance_by_cost, bubble_fraction, schedule, simulate
from hpcdl.report.trace import chrome_trace
from hpcdl.sim.network import load_network
from hpcdl.sim.ticks import TICKS_PER_SECOND
from hpcdl.train import main as train_main

COMMON = [
    "dtype=float64", "model.depth=8", "model.width=32", "data.batch_size=8", "optimizer.lr=0.05",
    "optimizer.momentum=0.9", "schedule.name=constant", "schedule.warmup_epochs=0", "checkpoint.every=0",
]  # fmt: skip
#: the MLP's top-level layers: Flatten, then 8 Linear with a ReLU between each
LAYERS = 16


def cfg(*sets: str) -> Any:
    return load_config("digits-mlp", [*COMMON, *sets])


def pipe(*sets: str) -> Any:
    return cfg("parallel.strategy=pipeline", *sets)


def stage_params(results: list) -> np.ndarray:
    """The model's parameters, the stages' slices in order."""
    return np.concatenate([p.data.ravel() for r in results for p in r.strategy.model.parameters()])


def params(result: Any) -> np.ndarray:
    return np.concatenate([p.data.ravel() for p in result.strategy.model.parameters()])


def costs(tmp_path: Path, per_layer: list[tuple[float, float]]) -> Path:
    """A cost table: layer i costs ``per_layer[i]`` (forward, backward) seconds at the run's batch."""
    table = tmp_path / "costs.toml"
    rows = "".join(
        f'[[layers]]\nlayer = "{i}"\nforward_s = {f!r}\nbackward_s = {b!r}\n'
        for i, (f, b) in enumerate(per_layer)
    )
    table.write_text(rows)
    return table


def rank_series(path: Path, name: str) -> np.ndarray:
    with h5py.File(path) as f:
        return f["ranks"][name][...]


@pytest.mark.parametrize(
    ("stages", "kind", "m"),
    [(1, "1f1b", 3), (2, "gpipe", 4), (3, "gpipe", 3), (3, "1f1b", 5), (5, "1f1b", 8),
     (8, "gpipe", 2), (8, "1f1b", 8)],
)  # fmt: skip
def test_pipeline_ends_where_one_process_accumulating_m_microbatches_does(
    stages: int, kind: str, m: int
) -> None:
    sets = ["train.steps=5", "train.eval_every=5"]
    alone = train(cfg(*sets, f"exchange.accumulate={m}"))
    got = sim(stages, pipe(*sets, f"pipeline.microbatches={m}", f"pipeline.schedule={kind}"))
    ref = params(alone)
    np.testing.assert_allclose(stage_params(got), ref, rtol=0, atol=1e-10 * np.abs(ref).max())
    for r in got:  # every rank has the agreed rows
        losses = [h["loss"] for h in r.history]
        np.testing.assert_allclose(losses, [h["loss"] for h in alone.history], rtol=1e-10)
        assert r.test_accuracy == alone.test_accuracy
        assert r.steps == 5


@pytest.mark.parametrize(("stages", "chunks", "m"), [(2, 2, 2), (2, 2, 4), (3, 2, 6), (4, 3, 8), (2, 4, 6)])
def test_interleaved_ends_where_one_process_accumulating_m_microbatches_does(
    stages: int, chunks: int, m: int
) -> None:
    """Each rank holds ``chunks`` model chunks; gathered by name they are the one process's model."""
    sets = ["train.steps=4", "train.eval_every=2"]
    alone = train(cfg(*sets, f"exchange.accumulate={m}"))
    got = sim(stages, pipe(*sets, f"pipeline.microbatches={m}", "pipeline.schedule=interleaved",
                          f"pipeline.virtual_stages={chunks}"))  # fmt: skip
    held = {name: p.data for r in got for name, p in r.strategy.model.named_parameters()}
    ref = dict(alone.strategy.model.named_parameters())
    assert set(held) == set(ref)
    scale = max(np.abs(p.data).max() for p in ref.values())
    for name, p in ref.items():
        np.testing.assert_allclose(held[name], p.data, rtol=0, atol=1e-10 * scale, err_msg=name)
    losses = [h["loss"] for h in got[0].history]
    np.testing.assert_allclose(losses, [h["loss"] for h in alone.history], rtol=1e-10)
    assert got[0].test_accuracy == alone.test_accuracy
    assert len(got[0].strategy.partition.balance) == stages * chunks


@pytest.mark.parametrize(("stages", "chunks", "m"), [(2, 2, 4), (4, 2, 8), (4, 4, 4)])
def test_interleaved_stages_idle_for_their_smaller_bubble(
    tmp_path: Path, stages: int, chunks: int, m: int
) -> None:
    """Equal virtual stages (16 equal layers): (p - 1) / (v m + p - 1), within 5%, and the
    microbatches held are the schedule's."""
    table = costs(tmp_path, [(1e-3, 2e-3)] * LAYERS)
    out = tmp_path / "run.h5"
    sim(stages, pipe("train.steps=3", f"pipeline.microbatches={m}", "pipeline.schedule=interleaved",
                     f"pipeline.virtual_stages={chunks}"), out=out, compute=f"table:{table}")  # fmt: skip
    bubble, held = rank_series(out, "bubble"), rank_series(out, "in_flight")
    want = bubble_fraction(stages, m, chunks)
    for s in range(stages):
        assert abs(statistics.median(bubble[:, s]) - want) <= 0.05 * want, (s, bubble[:, s], want)
    assert held[-1].tolist() == schedule("interleaved", stages, m, chunks).in_flight()


def test_batchnorm_and_residual_blocks_follow_accumulation_with_per_microbatch_statistics() -> None:
    sets = ["model.name=resnet18", "model.width_mult=0.125", "data.name=synthetic", "data.shape=[3,8,8]",
            "data.train_size=256", "data.test_size=64", "data.batch_size=4", "train.steps=3"]  # fmt: skip
    alone = train(cfg(*sets, "exchange.accumulate=4"))
    got = sim(3, pipe(*sets, "pipeline.microbatches=4"))
    ref = params(alone)
    np.testing.assert_allclose(stage_params(got), ref, rtol=0, atol=1e-10 * np.abs(ref).max())
    stats = np.concatenate([np.ravel(b) for r in got for _, b in r.strategy.model.named_buffers()])
    want = np.concatenate([np.ravel(b) for _, b in alone.strategy.model.named_buffers()])
    np.testing.assert_allclose(stats, want, rtol=1e-10, atol=1e-12)
    assert [len(r.strategy.model) for r in got] == list(got[0].strategy.partition.balance)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages", [2, 4, 8])
@pytest.mark.parametrize("m", [1, 4, 16])
def test_equal_stages_idle_for_the_bubble_formula(tmp_path: Path, kind: str, stages: int, m: int) -> None:
    table = costs(tmp_path, [(1e-3, 2e-3)] * LAYERS)
    out = tmp_path / "run.h5"
    sim(stages, pipe("train.steps=3", f"pipeline.microbatches={m}", f"pipeline.schedule={kind}"),
        out=out, compute=f"table:{table}")  # fmt: skip
    bubble = rank_series(out, "bubble")  # steps, stages
    want = bubble_fraction(stages, m)
    for s in range(stages):
        got = statistics.median(bubble[:, s])
        assert abs(got - want) <= 0.05 * want + 1e-12, (s, got, want)


def test_unequal_stages_idle_as_the_analytic_timeline_says(tmp_path: Path) -> None:
    """Stages of 2, 4 and 10 equal layers: each stage's bubble is the timeline's, transfers included."""
    per_layer = (1e-3, 2e-3)
    table = costs(tmp_path, [per_layer] * LAYERS)
    out = tmp_path / "run.h5"
    balance, m = [2, 4, 10], 6
    sim(3, pipe("train.steps=3", f"pipeline.microbatches={m}", "pipeline.schedule=1f1b",
                f"pipeline.balance={balance}"), out=out, compute=f"table:{table}")  # fmt: skip
    link = load_network("eth10g", 3).inter
    activation = 8 * 32 * 8  # a microbatch of 8 rows of 32 float64 between stages
    transfer = (link.alpha + link.transfer(activation)) / TICKS_PER_SECOND
    timeline = simulate(schedule("1f1b", 3, m), [n * per_layer[0] for n in balance],
                        [n * per_layer[1] for n in balance], transfer)  # fmt: skip
    bubble = rank_series(out, "bubble")
    for s in range(3):
        assert statistics.median(bubble[:, s]) == pytest.approx(timeline.bubble(s), rel=2e-3, abs=1e-4)
    busy = rank_series(out, "busy_time")
    np.testing.assert_allclose(busy[-1], [timeline.busy(s) for s in range(3)], rtol=1e-6)


def test_1f1b_holds_at_most_p_minus_s_microbatches_and_gpipe_all_of_them(tmp_path: Path) -> None:
    stages, m = 4, 8
    held = {}
    for kind in ("gpipe", "1f1b"):
        out = tmp_path / f"{kind}.h5"
        sim(stages, pipe("train.steps=2", f"pipeline.microbatches={m}", f"pipeline.schedule={kind}"), out=out)
        held[kind] = (rank_series(out, "in_flight")[-1], rank_series(out, "activation_bytes")[-1])
    assert held["1f1b"][0].tolist() == schedule("1f1b", stages, m).in_flight() == [4, 3, 2, 1]
    assert held["gpipe"][0].tolist() == [m] * stages
    per_microbatch = held["gpipe"][1] / m  # each stage's bytes for one microbatch
    assert (per_microbatch > 0).all()
    np.testing.assert_allclose(held["1f1b"][1], per_microbatch * held["1f1b"][0])


def test_time_balance_cuts_where_the_cost_table_says(tmp_path: Path) -> None:
    per_layer = [(1e-4 * (i + 1), 2e-4 * (i + 1)) for i in range(LAYERS)]  # later layers cost more
    table = costs(tmp_path, per_layer)
    got = sim(3, pipe("train.steps=1", "pipeline.balance=time", f"pipeline.profile={table}"))
    want = balance_by_cost([f + b for f, b in per_layer], 3)
    assert [list(r.strategy.partition.balance) for r in got] == [want] * 3
    assert want != [6, 5, 5] and want[0] > want[-1]


def test_time_balance_without_a_profile_profiles_on_rank_0_and_every_stage_agrees() -> None:
    got = sim(3, pipe("train.steps=2", "pipeline.balance=time"), compute="measured")
    balances = {tuple(r.strategy.partition.balance) for r in got}
    assert len(balances) == 1 and sum(next(iter(balances))) == LAYERS
    assert all(x.forward_s > 0 for x in got[0].strategy.partition.layers)


def test_the_trace_has_every_forward_and_backward_of_every_microbatch(tmp_path: Path) -> None:
    out = tmp_path / "run.h5"
    stages, m, steps = 3, 4, 2
    sim(stages, pipe(f"train.steps={steps}", f"pipeline.microbatches={m}", "log.trace=true"), out=out)
    with h5py.File(out) as f:
        rank, micro = f["trace/rank"][...], f["trace/microbatch"][...]
        kind = np.array([k.decode() for k in f["trace/kind"][...]])
        start, end = f["trace/start"][...], f["trace/end"][...]
    assert (end >= start).all()
    for s in range(stages):
        for op in ("forward", "backward"):
            mine = micro[(rank == s) & (kind == op)]
            assert sorted(mine.tolist()) == sorted(list(range(m)) * steps), (s, op)
    sends = (kind == "send") & (rank < stages - 1)  # activations forward (and gradients back)
    assert sends.sum() >= m * steps
    assert ((kind == "recv") & (rank == 0)).sum() == m * steps  # stage 0 receives only gradients
    # as Chrome trace events: a complete event per trace row, on the track of its rank
    spans = [e for e in chrome_trace([out])["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == len(kind)
    for e in spans:
        assert set(e) >= {"name", "cat", "ph", "pid", "tid", "ts", "dur"}
        assert e["tid"] in range(stages) and isinstance(e["ts"], float) and e["dur"] >= 0


def test_plan_prints_the_partition_and_the_schedule(capsys: pytest.CaptureFixture[str]) -> None:
    code = train_main(["--config", "digits-mlp", "--plan", "-n", "3", "--set", "parallel.strategy=pipeline",
                       "--set", "model.depth=8", "--set", "pipeline.microbatches=4", "--set",
                       "pipeline.schedule=gpipe", "--set", "pipeline.balance=[4,6,6]"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    assert "partition (balance): balance = [4, 6, 6]" in out
    assert "stage 0: F0 F1 F2 F3 B3 B2 B1 B0" in out
    assert "stage 2" in out and "most microbatches held per stage: [4, 4, 4]" in out


@pytest.mark.parametrize(
    ("sets", "says"),
    [
        (["pipeline.balance=[4,4,4]"], "sums to 12; the model has 16"),
        (["pipeline.balance=[8,8]"], "describes 2 stages; the run has 3"),
        (["pipeline.balance=[0,8,8]"], "positive ints"),
        (["pipeline.split=['3', 'nope']"], "names 'nope'"),
        (["pipeline.split=['3', '9']", "pipeline.balance=params"], "both describe the partition"),
        (["model.depth=1"], "3 pipeline stages for a model of 2 top-level layers"),
        (["exchange.accumulate=2"], "set pipeline.microbatches instead"),
        (
            ["pipeline.schedule=interleaved", "pipeline.virtual_stages=2", "pipeline.microbatches=4"],
            "a multiple of the 3 stages",
        ),
        (["pipeline.virtual_stages=2"], "needs pipeline.schedule = 'interleaved'"),
        (["pipeline.replicas=[2,2]"], "puts 4 ranks to work; this run has 3"),
        (["pipeline.replicas=[2,0,1]"], "list of positive ints (got [2, 0, 1])"),
        (["pipeline.stages=2"], "use pipeline.stages = 1, or pipeline.replicas"),
        (["pipeline.replicas=[2,1]", "pipeline.stages=3"], "has 2 stages"),
        (["pipeline.replicas=[2,1]", "pipeline.microbatches=5"], "not a multiple of every stage's replicas"),
        (
            ["pipeline.replicas=[2,1]", "pipeline.schedule=interleaved", "pipeline.virtual_stages=2"],
            "cannot run replicated stages",
        ),
    ],
)
def test_a_partition_that_does_not_fit_is_one_line_naming_it(sets: list[str], says: str) -> None:
    """``--plan`` and a run alike: a ConfigError (the entry point prints it as one line, exit 2)."""
    argv = ["--config", "digits-mlp", "--plan", "-n", "3", "--set", "parallel.strategy=pipeline", "--set",
            "model.depth=8"]  # fmt: skip
    for s in sets:
        argv += ["--set", s]
    with pytest.raises(ConfigError) as err:
        train_main(argv)
    assert says in str(err.value) and "\n" not in str(err.value)
    if "accumulate" not in says and "positive" not in says:  # a run says it too, on every rank
        with pytest.raises(Exception, match="ConfigError") as raised:
            sim(3, pipe(*sets, "train.steps=1"))
        assert says in str(raised.value)


def test_a_plan_that_does_not_fit_prints_nothing_before_its_error(capsys: pytest.CaptureFixture[str]) -> None:
    """``--plan -n 100`` for 6 layers printed the 100-stage table and schedule before its error."""
    argv = ["--config", "digits-mlp", "--plan", "-n", "100", "--set", "parallel.strategy=pipeline"]
    with pytest.raises(ConfigError, match="100 pipeline stages for a model of 6 top-level layers"):
        train_main(argv)
    assert capsys.readouterr().out == ""


def test_the_command_line_exits_2_with_one_line(tmp_path: Path) -> None:
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "hpcdl.train", "--config", "digits-mlp", "--plan", "-n", "2", "--set",
         "parallel.strategy=pipeline", "--set", "pipeline.split=['nope']"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "pipeline.split names 'nope'" in proc.stderr


def test_a_profiled_pipeline_run_profiles_every_stage_and_feeds_the_time_balance(tmp_path: Path) -> None:
    """``profile.layers``: each stage profiles its own layers; the run file holds them all, in order."""
    out = tmp_path / "profiled.h5"
    sim(3, pipe("train.steps=2", "profile.layers=true"), out=out, compute="measured")
    with h5py.File(out) as f:
        names = [n.decode() for n in f["profile/layer"][...]]
    assert names == [str(i) for i in range(LAYERS)]
    got = sim(3, pipe("train.steps=1", "pipeline.balance=time", f"pipeline.profile={out}"))
    assert sum(got[0].strategy.partition.balance) == LAYERS
    assert all(x.forward_s > 0 for x in got[0].strategy.partition.layers)


@pytest.mark.parametrize(
    ("before", "after", "says"),
    [
        (
            ["pipeline.balance=[4,6,6]"],
            ["pipeline.balance=[4,5,7]"],
            "resume with pipeline.balance = [4, 6, 6",
        ),
        (["pipeline.schedule=gpipe"], ["pipeline.schedule=1f1b"], "pipeline.schedule = 'gpipe'"),
        (["pipeline.replicas=[2,1]"], ["pipeline.replicas=[1,2]"], "pipeline.replicas = [2, 1]"),
    ],
)
def test_a_resume_cut_or_scheduled_otherwise_is_refused_before_anything_is_written(
    tmp_path: Path, before: list[str], after: list[str], says: str
) -> None:
    """Stage 0 holds the same layers in both cuts: rank 0 checks every stage's piece, not its own."""
    out = tmp_path / "run.h5"
    sim(3, pipe("train.steps=4", "checkpoint.every=2", "train.stop_at=2", *before), out=out)
    with h5py.File(out) as f:
        rows, attrs = len(f["metrics/step"]), dict(f.attrs)
    with pytest.raises(Exception, match="none of them|does not fit|was written|cut as") as raised:
        sim(3, pipe("train.steps=4", "checkpoint.every=2", *after), out=out, resume="auto")
    assert says in str(raised.value)
    with h5py.File(out) as f:
        assert len(f["metrics/step"]) == rows
        assert {k: str(v) for k, v in f.attrs.items()} == {k: str(v) for k, v in attrs.items()}  # untouched


def test_profiling_for_the_time_balance_leaves_the_runs_dropout_draws_alone() -> None:
    """One stage holds the dropout layer: profiling on a model of its own must not draw its masks."""
    sets = ["train.steps=3", "model.dropout=0.3"]
    profiled = sim(1, pipe(*sets, "pipeline.balance=time"))
    given = sim(1, pipe(*sets, f"pipeline.balance=[{LAYERS + 1}]"))
    assert profiled[0].strategy.partition.balance == (LAYERS + 1,)
    np.testing.assert_array_equal(stage_params(profiled), stage_params(given))
