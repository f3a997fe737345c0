"""The benchmark command's output format (figures are not asserted: benchmarks are not tests)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpcdl.bench import main
from hpcdl.bench.train import KFAC_PARTS
from hpcdl.comm import world
from hpcdl.comm.machine import describe
from hpcdl.errors import ConfigError

KEYS = {"impl", "model", "batch", "samples_per_s", "step_s"}


def test_step_writes_json_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "step.json"
    assert (
        main(["step", "--model", "mlp", "--batch", "8", "--repeat", "2", "--steps", "1", "--json", str(out)])
        == 0
    )
    rows = json.loads(out.read_text())
    assert [r["impl"] for r in rows] == ["hpcdl"]
    assert KEYS <= set(rows[0]) and rows[0]["batch"] == 8 and rows[0]["model"] == "mlp"
    assert rows[0]["samples_per_s"] == pytest.approx(8 / rows[0]["step_s"])
    captured = capsys.readouterr()
    assert "samples/s" in captured.out
    where = rows[0]["machine"]  # every row names where it ran, and the output says it once
    assert where == describe(world(), 1) and f"machine: {where['cpu']}" in captured.out


def test_step_with_kfac_splits_kfacs_time_beside_sgd(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "kfac.json"
    argv = ["step", "--model", "mlp", "--batch", "8", "--repeat", "2", "--steps", "3", "--optimizer", "kfac",
            "--inv-every", "3", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    rows = {r["impl"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"hpcdl", "hpcdl-kfac"}
    kfac = rows["hpcdl-kfac"]
    parts = [kfac[f"{p}_s"] for p in ("factors", "fold", "decompose", "precondition", "update")]
    assert all(p > 0 for p in parts) and sum(parts) < kfac["step_s_max"]  # parts of a step, each measured
    assert kfac["inv_every"] == 3
    assert "K-FAC per step" in capsys.readouterr().out


def test_step_vs_torch_same_network(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    out = tmp_path / "step.json"
    assert (
        main(
            [
                "step",
                "--model",
                "mlp",
                "--batch",
                "4",
                "--repeat",
                "1",
                "--steps",
                "1",
                "--vs",
                "torch",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    rows = json.loads(out.read_text())
    assert [r["impl"] for r in rows] == ["hpcdl", "torch"]


def test_step_bad_arguments() -> None:
    with pytest.raises(ConfigError, match="positive"):
        main(["step", "--batch", "0"])
    with pytest.raises(ConfigError, match="invalid choice"):
        main(["step", "--model", "alexnet"])
    for variant in (["x=1"], ["name"]):  # a row name first, then its settings
        with pytest.raises(ConfigError, match="--variant packed exchange.in_place=false"):
            main(["train", "--variant", *variant])


@pytest.mark.parametrize(
    "argv",
    [
        ["step", "--threads", "0"],
        ["pack", "--bucket-mb", "-1"],
        ["pack", "--bucket-mb", "nan"],
        ["allreduce", "--min-time", "nan"],
        ["allreduce", "--min-time", "inf"],
        ["allreduce", "--tolerance", "nan"],
        ["calibrate", "--out", "net.toml", "--min-time", "inf"],
    ],
    ids=" ".join,
)
def test_numbers_out_of_range_are_refused_in_one_line(argv: list[str]) -> None:
    """Accepted before (a negative bucket as one bucket, --min-time inf ran forever) or a traceback (nan)."""
    option = argv[-2]
    with pytest.raises(ConfigError, match=rf"argument {option}: expected .* \(got '{argv[-1]}'\)") as err:
        main(argv)
    assert "\n" not in str(err.value)


def test_train_rows_in_one_process(tmp_path: Path) -> None:
    out = tmp_path / "train.json"
    args = ["train", "--config", "digits-mlp", "--repeat", "2", "--steps", "2", "--json", str(out)]
    assert main(args) == 0
    (row,) = json.loads(out.read_text())
    assert row["impl"] == "hpcdl" and row["ranks"] == 1 and row["batch_per_rank"] == 32
    assert row["samples_per_s"] == pytest.approx(32 / row["step_s"])
    assert {"compute_s", "comm_s", "exposed_comm_s", "compression"} <= set(row)


def test_pipeline_in_one_process_says_to_run_under_mpiexec() -> None:
    with pytest.raises(ConfigError, match="mpiexec -n P"):
        main(["pipeline", "--reps", "1", "--steps", "1"])
    with pytest.raises(ConfigError, match="positive"):
        main(["pipeline", "--reps", "0"])


def test_planner_rows_and_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """ResNet-50 from the packaged table at a tiny size: a valid plan no slower than any baseline."""
    out = tmp_path / "planner.json"
    argv = ["planner", "--ranks", "4", "--networks", "eth10g", "--repeat", "1", "--json", str(out)]
    assert main(argv) == 0
    (row,) = json.loads(out.read_text())
    assert row["network"] == "eth10g" and row["ranks"] == 4 and row["global_batch"] == 4 * 32
    assert row["layers"] == 22 and sum(row["balance"]) == 22 and sum(row["replicas"]) == 4
    assert all(row["microbatches"] % r == 0 for r in row["replicas"])
    assert row["predicted_step_s"] <= row["baseline_step_s"] * (1 + 1e-9)
    assert {"plan_s", "plan_cpu_s", "baselines_s", "best_baseline", "plan"} <= set(row)
    assert "bench planner: ResNet-50" in capsys.readouterr().out


def test_planner_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"argument --ranks: expected a whole number above 0"):
        main(["planner", "--ranks", "0"])
    with pytest.raises(ConfigError, match="not found"):
        main(["planner", "--ranks", "2", "--networks", str(tmp_path / "none.toml")])
    table = tmp_path / "costs.toml"
    table.write_text('[[layers]]\nlayer = "0"\nforward_s = 1.0\nbackward_s = 1.0\n')
    with pytest.raises(ConfigError, match="no row for ResNet-50's layer '1'"):
        main(["planner", "--ranks", "2", "--costs", str(table)])


def test_ops_rows_and_their_toml_read_as_a_cost_tables_op_rows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """K-FAC's ops at two sizes; ``--toml`` appended to a table gives the simulator those rows."""
    from hpcdl.store.costs import load_op_costs  # noqa: PLC0415

    out, toml = tmp_path / "ops.json", tmp_path / "ops.toml"
    argv = [
        "ops",
        "--sizes",
        "4",
        "8",
        "--rows",
        "3",
        "--repeat",
        "1",
        "--json",
        str(out),
        "--toml",
        str(toml),
    ]
    assert main(argv) == 0
    rows = json.loads(out.read_text())
    assert [(r["op"], r["dims"]) for r in rows] == [
        ("eigh", [4]), ("precondition", [4, 4]), ("factor", [3, 4]),
        ("eigh", [8]), ("precondition", [8, 8]), ("factor", [3, 8]),
    ]  # fmt: skip
    assert [r["law_s"] is None for r in rows] == [True] * 3 + [False] * 3
    assert rows[3]["law_s"] == rows[0]["seconds"] * 8  # eigh: n³ from n = 4 to 8
    table = tmp_path / "t.toml"
    table.write_text("[[layers]]\nlayer = '0'\nforward_s = 1.0\nbackward_s = 1.0\n\n" + toml.read_text())
    costs = load_op_costs(table)
    assert [(c.op, list(c.dims), c.seconds) for c in costs.rows] == [
        (r["op"], r["dims"], r["seconds"]) for r in rows
    ]
    assert "bench ops: K-FAC's ops" in capsys.readouterr().out


def test_train_with_kfac_splits_its_share_beside_sgd_in_one_process(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "train.json"
    args = ["train", "--config", "digits-mlp", "--set", "optimizer.name=kfac", "--set", "kfac.inv_every=2",
            "--repeat", "2", "--steps", "2", "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    kfac, sgd = json.loads(out.read_text())
    assert (kfac["impl"], sgd["impl"]) == ("hpcdl-kfac", "hpcdl") and "kfac_s" not in sgd
    parts = [kfac[f"{p}_s"] for p in KFAC_PARTS]
    assert sum(parts) == pytest.approx(kfac["kfac_s"], rel=1e-9, abs=1e-12)
    assert kfac["kfac_s"] <= kfac["step_mean_s"] + 1e-9
    assert kfac["kfac_steps"] == 4 and kfac["inversions"] == 2  # t = 3 .. 6 measured: 4 and 6 decompose
    assert kfac["bytes_factors_per_step"] == kfac["bytes_eigen_per_step"] == kfac["bytes_grads_per_step"] == 0
    assert "K-FAC's share per step" in capsys.readouterr().out
