"""``pipeline.balance = "plan"``: the planner on the config's model, its plan run, stored and reused.

* ``--plan`` prints the plan the planner function finds for the same costs, network and
  global batch, beside the baselines, each with its predicted step;
* a planned run trains under the plan (on the simulator's ranks), the run file stores it,
  and a resume reuses it even when a fresh cost table would plan otherwise;
* the learning rate of an update stays the configured global batch's when the plan recuts m;
* what cannot be planned is one line (exit 2 from the command), nothing written.
"""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import pytest
from simulated import sim  # tests/ is on sys.path (pytest prepend mode)

from hpcdl.config import load_config, stored_values
from hpcdl.driver.factory import load_data
from hpcdl.driver.settle import PlanInputs
from hpcdl.errors import ConfigError
from hpcdl.parallel.pipe_planner import CostModel, Network, baselines, plan
from hpcdl.parallel.pipe_profile import layer_infos
from hpcdl.store.costs import load_cost_table
from hpcdl.train import main as train_main

LAYERS = 16  # digits-mlp with model.depth = 8: flatten, then 7 x (linear, relu), linear
COMMON = ["model.depth=8", "model.width=1024", "parallel.strategy=pipeline", "pipeline.balance=plan",
          "pipeline.microbatches=8", "data.batch_size=16", "pipeline.network=eth10g"]  # fmt: skip


def table(tmp_path: Path, heavy: int, name: str = "costs.toml") -> Path:
    """Layer ``heavy`` costs 40x the others (0.4 ms forward, 0.8 ms backward at 16 samples; the others
    10 and 20 us): on eth10g's 4 ranks, with 1,024-wide layers (4 MiB of parameters each) whose
    allreduce makes data parallelism slow, the plan is a pipeline with the heavy layer's stage
    replicated."""
    path = tmp_path / name
    rows = []
    for i in range(LAYERS):
        f = 4e-4 if i == heavy else 1e-5
        rows.append(f'[[layers]]\nlayer = "{i}"\nforward_s = {f}\nbackward_s = {2 * f}\nbatch = 16\n')
    path.write_text("".join(rows))
    return path


def expected(cfg_sets: list[str], costs: Path, ranks: int) -> tuple[object, float, dict]:
    cfg = load_config("digits-mlp", cfg_sets)
    data = load_data(cfg)
    model = PlanInputs(cfg, data).model()
    infos = layer_infos(model, data.input_shape, 16, load_cost_table(costs))
    alpha, beta = PlanInputs(cfg, data).network("eth10g", ranks)
    cost = CostModel(infos, 16, Network(alpha, beta), "1f1b", 0, 4)
    chosen, t = plan(cost, ranks, 128)
    return chosen, t, baselines(cost, ranks, 128)


def test_plan_prints_the_planners_plan_beside_the_baselines(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    costs = table(tmp_path, heavy=5)
    sets = [*COMMON, f"pipeline.profile={costs}"]
    argv = ["--config", "digits-mlp", "--plan", "-n", "4"]
    for s in sets:
        argv += ["--set", s]
    assert train_main(argv) == 0
    out = capsys.readouterr().out
    chosen, t, others = expected(sets, costs, 4)
    assert "planner's plan  " in out and str(chosen) in out
    assert f"{t * 1e3:10.3f} ms" in out
    for found in others.values():
        if found is not None:
            assert str(found[0]) in out and f"{found[1] * 1e3:10.3f} ms" in out
    assert f"partition (balance): balance = {list(chosen.balance)}" in out
    assert len(chosen.balance) > 1 and max(chosen.replicas) > 1  # a hybrid: the point of the plan


def test_a_planned_run_trains_under_its_plan_and_a_resume_reuses_it(tmp_path: Path) -> None:
    out = tmp_path / "planned.h5"
    first, second = table(tmp_path, heavy=5), table(tmp_path, heavy=13, name="later.toml")
    sets = [*COMMON, "train.steps=4", "checkpoint.every=2", "schedule.name=constant",
            "schedule.warmup_epochs=0"]  # fmt: skip
    chosen, _, _ = expected(sets, first, 4)
    ran = sim(4, load_config("digits-mlp", [*sets, f"pipeline.profile={first}", "train.stop_at=2"]), out=out)
    assert ran[0].strategy.partition.balance == chosen.balance
    assert ran[0].strategy.reps == chosen.replicas
    with h5py.File(out) as f:
        stored = stored_values(f.attrs["config"])
    record = json.loads(stored["pipeline.planned"])
    assert record["plan"] == str(chosen) and stored["pipeline.replicas"] == list(chosen.replicas)
    other, _, _ = expected(sets, second, 4)
    assert other.balance != chosen.balance  # a fresh table would cut otherwise ...
    again = sim(4, load_config("digits-mlp", [*sets, f"pipeline.profile={second}"]), out=out, resume="auto")
    assert again[0].strategy.partition.balance == chosen.balance  # ... the resume keeps the plan
    assert again[0].steps == 4


def test_a_recut_keeps_the_learning_rate_of_the_global_batch(tmp_path: Path) -> None:
    costs = table(tmp_path, heavy=5)
    # 16 microbatches of 8: the table's costs are at 16 samples, so the plan cuts fewer, larger ones
    sets = [
        *COMMON,
        f"pipeline.profile={costs}",
        "schedule.scale=sqrt",
        "data.batch_size=8",
        "pipeline.microbatches=16",
    ]
    cfg = load_config("digits-mlp", sets)
    ran = sim(4, cfg.with_updates({"train.steps": 1}))
    settled = ran[0].strategy.ctx.cfg
    m = settled["pipeline.microbatches"]
    assert settled["data.batch_size"] * m == 128 and m != 16
    assert settled["optimizer.lr"] * m**0.5 == pytest.approx(cfg["optimizer.lr"] * 16**0.5, rel=1e-12)


@pytest.mark.parametrize(
    ("sets", "says"),
    [
        (["pipeline.memory_mb=0.0001"], "fits the activation limit"),
        (["data.batch_size=2000", "pipeline.microbatches=1"], "cannot make a microbatch of 2000 to profile"),
        (["pipeline.schedule=interleaved", "pipeline.virtual_stages=2"], "plans gpipe and 1f1b"),
        (["pipeline.replicas=[2,2]"], "leave pipeline.replicas"),
        (["pipeline.profile=nowhere.toml"], "nowhere.toml"),
    ],
)
def test_what_cannot_be_planned_is_one_line(sets: list[str], says: str, tmp_path: Path) -> None:
    argv = ["--config", "digits-mlp", "--plan", "-n", "4"]
    for s in [*COMMON, *sets]:
        argv += ["--set", s]
    with pytest.raises(ConfigError) as err:
        train_main(argv)
    assert says in str(err.value) and "\n" not in str(err.value)
    out = tmp_path / "refused.h5"
    with pytest.raises(Exception, match="Error") as raised:
        sim(4, load_config("digits-mlp", [*COMMON, *sets, "train.steps=1"]), out=out)
    assert says in str(raised.value)
    assert not out.exists()


def test_the_command_line_exits_2_with_one_line() -> None:
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    proc = subprocess.run(
        [sys.executable, "-m", "hpcdl.train", "--config", "digits-mlp", "--plan", "-n", "4",
         *(x for s in [*COMMON, "pipeline.memory_mb=0.0001"] for x in ("--set", s))],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "activation limit" in proc.stderr
