"""Parameter servers (``parallel.strategy = "ps"``) in the simulator, against simpler equivalents.

* one worker in ``async`` mode is single-process training, bit for bit (tau = 0);
* ``sync`` mode with 3 workers is sync data parallel on the same batches, bit for bit (the
  sums of 3 gradients in the same order), with one server and with shards cut across tensors
  (2 workers, and a stop and resume in sync mode: the conformance suite, ``tests/strategies/``);
* homogeneous ``async`` with equal per-layer costs: tau = W - 1 for every push after the
  first round, exactly (and ``w`` for worker w's first push);
* ``ssp`` never lets tau exceed :func:`~hpcdl.parallel.ps_plan.max_staleness` with a 3x
  straggler, while ``async`` with the same straggler does;
* resume at a quiesce point of 2 servers repeats the uninterrupted run bit for bit (cost table,
  no jitter; one server: the conformance suite);
* the run file's ``staleness/`` rows, the plan's errors and ``--plan``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
from ps_config import cfg
from simulated import sim

from hpcdl.driver.run import train
from hpcdl.errors import ConfigError
from hpcdl.parallel.ps import compensated_lr, dc_gradient
from hpcdl.parallel.ps_plan import max_staleness


def equal_costs(tmp_path: Path) -> str:
    """A cost table charging every layer of the 2-layer MLP 100 us forward and 200 us backward."""
    table = tmp_path / "equal.toml"
    rows = "".join(f'[[layers]]\nlayer = "{i}"\nforward_s = 1e-4\nbackward_s = 2e-4\n' for i in range(6))
    table.write_text(rows)
    return f"table:{table}"


def flat(result: Any) -> np.ndarray:
    """The parameters a run ended with: the packed master copy of a ps run's server, a model's."""
    strategy = result.strategy
    if hasattr(strategy, "shard"):
        return strategy.shard.data.copy()
    return np.concatenate([p.data.ravel() for p in strategy.model.parameters()])


def staleness(path: Path) -> dict[str, np.ndarray]:
    with h5py.File(path) as f:
        return {k: f["staleness"][k][...] for k in f["staleness"]}


def test_one_worker_async_is_single_process_training_bit_for_bit(tmp_path: Path) -> None:
    alone = train(cfg("train.steps=30", "parallel.strategy=sync"))
    ps = sim(2, cfg("train.steps=30", "ps.mode=async"), out=tmp_path / "ps.h5")
    np.testing.assert_array_equal(flat(ps[0]), flat(alone))
    assert [r["loss"] for r in ps[0].history] == [r["loss"] for r in alone.history]
    rows = staleness(tmp_path / "ps.h5")
    assert rows["update"].tolist() == list(range(1, 31))
    assert not rows["tau"].any()


@pytest.mark.parametrize(("workers", "servers"), [(3, 1), (3, 2)])  # 2 workers: tests/strategies
def test_sync_mode_is_sync_data_parallel_on_the_same_batches(workers: int, servers: int) -> None:
    steps = 8
    # MPI's own allreduce (the simulator's: doubling, folded at 3), the order ps sync sums in; auto
    # would take the network model's choice
    dp = sim(workers, cfg(f"train.steps={steps}", "parallel.strategy=sync", 'exchange.algorithm="mpi"'))
    ps = sim(workers + servers, cfg(f"train.steps={steps * workers}", "ps.mode=sync",
                                    f"ps.servers={servers}"))  # fmt: skip
    expected = flat(dp[0])
    shards = [flat(r) for r in ps[:servers]]  # server k's shard: its range of the packed buffer
    np.testing.assert_array_equal(np.concatenate(shards), expected)
    assert ps[0].steps == steps * workers


def test_homogeneous_async_staleness_is_w_minus_1_after_the_first_round(tmp_path: Path) -> None:
    workers = 6
    out = tmp_path / "ps.h5"
    sim(workers + 1, cfg("train.steps=60", "ps.mode=async"), out=out, compute=equal_costs(tmp_path))
    rows = staleness(out)
    first = rows["worker"][:workers]
    assert sorted(first.tolist()) == list(range(workers))
    assert rows["tau"][:workers].tolist() == list(range(workers))  # pulled at 0, applied at w
    assert (rows["tau"][workers:] == workers - 1).all(), np.bincount(rows["tau"])
    # round robin: each worker's pushes are W apart
    assert (rows["worker"][workers:] == np.tile(first, 60 // workers)[: 60 - workers]).all()


@pytest.mark.parametrize("bound", [0, 1, 2])
def test_ssp_bounds_staleness_with_a_3x_straggler(tmp_path: Path, bound: int) -> None:
    workers, n = 3, 4
    limit = max_staleness(workers, bound)
    out = tmp_path / f"ssp{bound}.h5"
    straggler = [f"debug.slowdown=['{n - 1}:3']"]
    sim(n, cfg("train.steps=90", "ps.mode=ssp", f"ps.staleness={bound}", *straggler), out=out,
        compute=equal_costs(tmp_path))  # fmt: skip
    tau = staleness(out)["tau"]
    assert tau.max() <= limit, (tau.max(), limit)
    # without the bound the straggler's pushes are staler than any bound s = 0 allows
    out = tmp_path / "async.h5"
    sim(n, cfg("train.steps=90", "ps.mode=async", *straggler), out=out, compute=equal_costs(tmp_path))
    assert staleness(out)["tau"].max() > max_staleness(workers, 0)


def test_resume_at_a_quiesce_point_repeats_the_run_bit_for_bit(tmp_path: Path) -> None:
    sets = ["train.steps=40", "checkpoint.every=20", "ps.mode=async", "ps.servers=2"]
    compute = equal_costs(tmp_path)
    whole = sim(5, cfg(*sets), out=tmp_path / "whole.h5", compute=compute)
    stopped = sim(5, cfg(*sets, "train.stop_at=20"), out=tmp_path / "part.h5", compute=compute)
    assert stopped[0].stopped_by and stopped[0].steps == 20
    resumed = sim(5, cfg(*sets), out=tmp_path / "part.h5", compute=compute, resume="auto")
    for a, b in zip(whole[:2], resumed[:2]):
        np.testing.assert_array_equal(flat(a), flat(b))
    a, b = staleness(tmp_path / "whole.h5"), staleness(tmp_path / "part.h5")
    for column in ("update", "worker", "server", "tau"):
        np.testing.assert_array_equal(a[column], b[column], err_msg=column)
    with h5py.File(tmp_path / "whole.h5") as f, h5py.File(tmp_path / "part.h5") as g:
        np.testing.assert_array_equal(f["metrics/loss"][...], g["metrics/loss"][...])


def test_staleness_rows_past_the_checkpoint_are_cut_on_resume(tmp_path: Path) -> None:
    """A run killed after its checkpoint left rows past it: the resume cuts them as metrics rows."""
    out = tmp_path / "run.h5"
    sets = [
        "train.steps=30",
        "checkpoint.every=10",
        "checkpoint.keep=5",
        "ps.mode=async",
        "log.flush_every=1",
    ]
    sim(3, cfg(*sets), out=out)
    from hpcdl.store.checkpoint import list_checkpoints

    for ckpt in list_checkpoints(out):  # keep the checkpoint of step 10 only: "killed" at step 30
        if not ckpt.name.endswith("ckpt-00000010.h5"):
            ckpt.unlink()
    left = list_checkpoints(out)
    assert len(left) == 1
    with h5py.File(out, "r+") as f:
        f.attrs["status"] = "running"
    sim(3, cfg(*sets), out=out, resume="auto")
    rows = staleness(out)
    assert rows["update"].tolist() == sorted(rows["update"].tolist())
    assert np.bincount(rows["update"]).tolist() == [0] + [1] * 30  # each push once, none twice


def test_a_loss_gone_bad_ends_the_run_and_keeps_the_rows_before_it(tmp_path: Path) -> None:
    from hpcdl.errors import HpcdlError
    from hpcdl.sim.errors import RankFailure

    out = tmp_path / "bad.h5"
    with pytest.raises((HpcdlError, RankFailure)) as info:
        sim(3, cfg("train.steps=400", "optimizer.lr=1e6", "ps.mode=async"), out=out)
    assert "loss is not finite at step" in str(info.value)
    bad = int(str(info.value).split("at step ")[1].split(":")[0])
    assert 1 < bad < 400
    with h5py.File(out) as f:
        assert f.attrs["status"] == "failed"
        assert f["metrics/step"][...].tolist() == list(range(1, bad))
        assert np.isfinite(f["metrics/loss"][...]).all()
        assert f["staleness/update"][...].max() == bad - 1


def test_phases_shorter_than_w_pushes_grant_the_workers_in_turn(tmp_path: Path) -> None:
    """A checkpoint every 2 pushes with 4 workers: each phase grants the workers that pushed least."""
    out = tmp_path / "turns.h5"
    sim(5, cfg("train.steps=16", "checkpoint.every=2", "checkpoint.keep=1", "ps.mode=async"), out=out,
        compute=equal_costs(tmp_path))  # fmt: skip
    assert np.bincount(staleness(out)["worker"]).tolist() == [4, 4, 4, 4]


def test_sync_mode_counts_in_whole_rounds() -> None:
    from hpcdl.driver.context import arithmetic
    from hpcdl.driver.run import plan

    with pytest.raises(
        ConfigError, match="train.steps = 10 is not a whole number of sync rounds of 4 pushes: use 8 or 12"
    ):
        plan(cfg("train.steps=10", "ps.mode=sync"), 5)
    with pytest.raises(ConfigError, match="checkpoint.every = 6 .* use 4 or 8"):
        plan(cfg("train.steps=8", "checkpoint.every=6", "ps.mode=sync"), 5)
    placement = plan(cfg("train.steps=0", "train.epochs=2", "ps.mode=sync"), 4)  # W = 3
    _, per_epoch, total = arithmetic(cfg("train.steps=0", "train.epochs=2", "ps.mode=sync"), placement, 1437)
    assert (
        per_epoch == 3 * (1437 // (3 * 16)) and total == 2 * per_epoch
    )  # whole rounds, as the sampler's epoch


def test_rows_reach_the_file_during_a_phase_and_outlive_a_crash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One phase of 200 pushes (no checkpoint): server 0's rows go to the file every
    log.flush_every pushes, so a worker that dies at its 70th batch leaves them there
    (without the once-a-second limit: the run takes milliseconds of virtual time)."""
    from hpcdl.parallel import ps_server, ps_worker
    from hpcdl.sim.errors import RankFailure

    monkeypatch.setattr(ps_server, "EARLY_ROWS_S", 0.0)
    compute, batches = ps_worker.forward_backward, [0]

    def dies(*args: Any) -> Any:
        batches[0] += 1
        if batches[0] == 140:  # (both workers' batches: the 70th of one of them)
            raise RuntimeError("a worker dies")
        return compute(*args)

    monkeypatch.setattr(ps_worker, "forward_backward", dies)
    out = tmp_path / "crash.h5"
    with pytest.raises(RankFailure, match="a worker dies"):
        sim(3, cfg("train.steps=200", "log.flush_every=10", "ps.mode=async"), out=out)
    import gc

    gc.collect()  # the failed run's file handle
    with h5py.File(out, "r", locking=False) as f:
        steps = f["metrics/step"][...].tolist()
        updates = f["staleness/update"][...].tolist()
        assert f["metrics/samples"][-1] == 16 * len(steps)
    assert len(steps) >= 120, len(steps)  # of the 138 pushes applied at most
    assert steps == list(range(1, len(steps) + 1)) and updates == steps  # each push once, in order


def test_compensation_formulas() -> None:
    assert compensated_lr(0.1, 0, "lr") == 0.1
    assert compensated_lr(0.1, 4, "lr") == pytest.approx(0.025)
    assert compensated_lr(0.1, 4, "none") == 0.1
    rng = np.random.default_rng(0)
    g, now, used = (rng.standard_normal(50) for _ in range(3))
    out = np.empty(50)
    got = dc_gradient(g, now, used, 0.5, out)
    np.testing.assert_allclose(got, g + 0.5 * g * g * (now - used), rtol=1e-15)


@pytest.mark.parametrize(
    ("sets", "world", "fragment"),
    [
        (["ps.servers=2"], 2, "ps.servers = 2 on 2 ranks leaves no worker"),
        (["ps.servers=3"], 3, "run on at least 4 ranks"),
        (["exchange.accumulate=2"], 3, "a push is one batch"),
    ],
)
def test_layouts_that_do_not_fit_are_one_line(sets: list[str], world: int, fragment: str) -> None:
    from hpcdl.driver.run import plan

    with pytest.raises(ConfigError) as info:
        plan(cfg(*sets), world)
    assert fragment in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("sets", "said"),
    [
        (["checkpoint.every=10"], True),  # 2 workers: below 10 x 2 pushes
        (["checkpoint.every=10", "ps.mode=ssp"], True),
        (["checkpoint.every=10", "ps.mode=sync"], False),  # a round quiesces anyway
        (["checkpoint.every=0"], False),
        (["checkpoint.every=20"], False),  # not below 10 x 2,
    ],
)
def test_frequent_checkpoints_are_remarked_once_on_rank_0(
    sets: list[str], said: bool, capfd: pytest.CaptureFixture[str]
) -> None:
    from hpcdl.driver.run import plan
    from hpcdl.parallel.ps import ParameterServer

    config = cfg("train.steps=40", *sets)
    lines = ParameterServer.advice(config, plan(config, 3))
    assert lines == (
        ["checkpoint.every = 10 pushes with 2 workers: every checkpoint quiesces the job and drains the "
         "workers' pipeline, which shapes the staleness; for a staleness study make it well above 20 "
         "(0: the end only)"] if said else []
    )  # fmt: skip
    sim(3, config)
    err = capfd.readouterr().err
    assert err.count("hpcdl.train: ! checkpoint.every = ") == int(said)


def test_plan_shows_roles_and_shards(capsys: pytest.CaptureFixture[str]) -> None:
    from hpcdl.train import print_plan

    print_plan(cfg("ps.servers=2", "ps.mode=ssp", "ps.staleness=2"), 6)
    out = capsys.readouterr().out
    assert "rank 0        server        shard 0" in out and "rank 1        server        shard 1" in out
    assert "ranks 2-5" in out and "worker" in out
    assert "ssp: staleness bound s = 2" in out
    assert "server 0: elements 0.." in out and "server 1: elements" in out


@pytest.mark.parametrize("servers", [3, 0])
def test_a_layout_that_does_not_fit_exits_2_with_one_line(
    capsys: pytest.CaptureFixture[str], servers: int
) -> None:
    from hpcdl.simulate import main as simulate_main

    argv = ["-n", "3", "-m", "hpcdl.train", "--config", "digits-mlp", "--set", "parallel.strategy=ps",
            "--set", f"ps.servers={servers}", "--progress", "none"]  # fmt: skip
    assert simulate_main(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "ps.servers" in err[0], err


def test_bench_train_refuses_a_free_running_strategy() -> None:
    from hpcdl.bench import main as bench_main

    with pytest.raises(ConfigError, match="runs free: time it with python -m hpcdl.train"):
        bench_main(["train", "--config", "digits-mlp", "--set", "parallel.strategy=ps"])
