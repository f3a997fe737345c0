"""The driver and its seam, in one process and in the simulator: plans, placements, a meeting
where the driver needs every rank, spending time on purpose, slowdowns, format-1 checkpoints.
(Every strategy's resume and refusals, the toy's too, are the conformance suite's:
``tests/strategies/``.)"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import h5py
import numpy as np
import pytest

from hpcdl.config import load_config
from hpcdl.driver import train
from hpcdl.driver.context import Slowdown, slowdown_factor
from hpcdl.errors import ConfigError
from hpcdl.parallel import Placement, RankPlace
from hpcdl.simulate import main as simulate
from hpcdl.store.checkpoint import checkpoint_path, list_checkpoints, load_checkpoint
from hpcdl.train import main as train_command

#: the toy strategy (tests/toy_strategy.py), named as an outside strategy is
TOY = "toy_strategy:KeeperAveraging"
#: the simulator's command line for the toy on 3 virtual ranks
TOY_SIM = ["-n", "3", "--network", "ib-hdr", "--compute", "none", "-m", "hpcdl.train",
           "--config", "digits-mlp", "--progress", "none",
           "--set", f"parallel.strategy={TOY!r}", "--set", "model.width=32"]  # fmt: skip

# -- --plan: the placement, for any rank count, without starting ranks -------------------------


@pytest.mark.parametrize(
    ("n", "table_line", "arithmetic"),
    [
        (1, "rank 0        worker        model                   0",
         "learning rate 0.05 (optimizer.lr 0.05, schedule.scale = 'linear' for 1 batch per update); 44 "),
        (2, "ranks 0-1     worker        model                   0-1",
         "learning rate 0.1 (optimizer.lr 0.05, schedule.scale = 'linear' for 2 batches per update); 22 "),
        (3, "ranks 0-2     worker        model                   0-2",
         "learning rate 0.15 (optimizer.lr 0.05, schedule.scale = 'linear' for 3 batches per update); 14 "),
        (1024, "ranks 0-1023  worker        model                   0-1023",
         "learning rate 51.2 (optimizer.lr 0.05, schedule.scale = 'linear' for 1024 batches per update); 1 "),
    ],
)  # fmt: skip
def test_plan_of_sync(n: int, table_line: str, arithmetic: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert train_command(["--config", "digits-mlp", "--plan", "-n", str(n)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (f"strategy sync on {n} rank{'s' * (n > 1)}: data-parallel width {n}, global batch "
                      f"{32 * n} = {n} x 1 micro-step x 32")  # fmt: skip
    assert out[2] == "ranks         role          holds                   data-parallel member"
    assert out[3] == table_line and out[5].startswith(arithmetic)
    exceeds = any(line.startswith("! the global batch of 32768 exceeds") for line in out)
    assert exceeds == (n == 1024)


def test_plan_of_a_strategy_with_two_roles(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--config", "digits-mlp", "--set", f"parallel.strategy={TOY!r}", "--plan", "-n", "4"]
    assert train_command(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("strategy toy on 4 ranks: data-parallel width 3, global batch 96")
    assert out[3].split() == ["rank", "0", "keeper", "average", "-"]
    assert out[4].split() == ["rank", "1", "worker", "replica", "0", "0"]
    assert "the ranks meet every 4 steps" in out


@pytest.mark.parametrize("n", ["0", "-2", "two"])
def test_plan_refuses_a_rank_count_below_1_in_one_line(n: str) -> None:
    """``--plan -n 0`` was a ZeroDivisionError traceback: the option's type refuses it."""
    with pytest.raises(ConfigError, match=rf"argument -n: expected a whole number above 0 \(got '{n}'\)"):
        train_command(["--config", "digits-mlp", "--plan", "-n", n])


def test_plan_with_no_ranks_exits_2_with_one_line() -> None:
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "hpcdl.train", "--config", "digits-mlp", "--plan", "-n", "0"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    said = "hpcdl.train: error: argument -n: expected a whole number above 0 (got '0')"
    assert proc.stderr.startswith(said)


def test_train_refuses_n_without_plan() -> None:
    with pytest.raises(ConfigError, match="-n RANKS goes with --plan"):
        train_command(["--config", "digits-mlp", "-n", "2"])


def test_placement_is_data() -> None:
    places = (RankPlace("keeper", "average"), *(RankPlace("worker", f"replica {w}", w) for w in range(3)))
    p = Placement("toy", places, batch_size=16, micro_steps=2)
    assert (p.world, p.width, p.global_batch) == (4, 3, 96)
    assert p.holders("replica 1") == [2] and p.pieces() == ["average", "replica 0", "replica 1", "replica 2"]
    assert Placement.from_json(p.to_json()) == p
    assert p.summary().startswith("toy on 4 ranks: rank 0 keeper holding average, rank 1 worker")


# -- the toy strategy on virtual ranks -----------------------------------------------------------


def test_a_strategy_meeting_every_k_steps_also_meets_where_the_driver_needs_all(tmp_path: Path) -> None:
    """The toy meets every 4 steps of its own accord; checkpoints every 6 and a stop at 9 make it meet
    there too: a checkpoint is never late (before, they waited for the toy's meetings at 8 and 12)."""
    sim = [*TOY_SIM, "--set", "train.steps=12", "--set", "checkpoint.every=6", "--set", "checkpoint.keep=5"]
    run = tmp_path / "toy.h5"
    assert simulate([*sim, "--set", "train.stop_at=9", "--out", str(run)]) == 0
    assert sorted(list_checkpoints(run)) == [checkpoint_path(run, 6), checkpoint_path(run, 9)]
    with h5py.File(run, "r") as f:
        assert f.attrs["status"] == "stopped" and list(f["metrics/step"][...]) == list(range(1, 10))


# -- spending time on purpose --------------------------------------------------------------------


def test_sleep_is_a_real_sleep_in_one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside the simulator hpcdl.comm.sleep is time.sleep (no world hook); nothing for 0 s."""
    from hpcdl.comm import context, sleep

    slept: list[float] = []
    monkeypatch.setattr(context.time, "sleep", slept.append)
    sleep(0.05)
    sleep(0.0)
    assert slept == [0.05]


def _sleeping_program() -> int:
    """On a virtual rank: a wait loop on the clock ends, and a slowed layer takes FACTOR x."""
    from hpcdl.comm import sleep, world, wtime
    from hpcdl.nn import Sequential, observe
    from hpcdl.nn.layer import Layer

    class Busy(Layer):
        """Computes for 1 ms of virtual time (the simulator's compute model charges nothing here)."""

        def forward(self, x: np.ndarray) -> np.ndarray:
            sleep(1e-3)
            return x

        def backward(self, gy: np.ndarray) -> np.ndarray:
            return gy

    t0 = wtime()
    while wtime() < t0 + 0.25:  # never ends without sleep under --compute none
        sleep(0.1)
    waited = wtime() - t0
    net = Sequential([Busy(), Busy()])
    t1 = wtime()
    with observe(Slowdown(3.0)) if world().Get_rank() == 1 else observe(Slowdown(1.0)):
        net.forward(np.zeros(2))
    slowed = wtime() - t1
    return round(waited * 1e6) * 1000 + round(slowed * 1e6)


def test_sleep_moves_the_virtual_clock_and_a_slowdown_scales_compute() -> None:
    from hpcdl.sim.compute import make_compute
    from hpcdl.sim.engine import simulate as run_virtual

    result = run_virtual(2, _sleeping_program, compute=make_compute("none"))
    assert result.results == [300_000 * 1000 + 2_000, 300_000 * 1000 + 6_000]  # 0.3 s; 2 ms, 3 x 2 ms


def test_slowdown_factors_are_checked() -> None:
    cfg = load_config("digits-mlp", ['debug.slowdown=["1:2.5", "3:4"]'])
    assert [slowdown_factor(cfg, r, 4) for r in range(4)] == [1.0, 2.5, 1.0, 4.0]
    with pytest.raises(ConfigError, match="debug.slowdown names rank 3, outside the 2 ranks"):
        slowdown_factor(cfg, 0, 2)
    with pytest.raises(ConfigError, match="a factor must be >= 1"):
        slowdown_factor(load_config("digits-mlp", ['debug.slowdown=["0:0.5"]']), 0, 1)


def test_a_slowed_rank_computes_longer_in_the_run_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """debug.slowdown through the driver, in the simulator: the world scales rank 1's modelled
    compute by 4 (no sleeping observer), and its compute time in the run file shows it."""
    import hpcdl.driver.run as run_module

    made: list[float] = []
    monkeypatch.setattr(run_module, "Slowdown", made.append)
    out = tmp_path / "slow.h5"
    argv = ["-n", "2", "-m", "hpcdl.train", "--config", "digits-cnn", "--set", "train.steps=10",
            "--set", 'debug.slowdown=["1:4"]', "--progress", "none", "--out", str(out)]  # fmt: skip
    assert simulate(argv) == 0
    assert made == []  # the simulated world slowed the rank itself
    with h5py.File(out, "r") as f:
        compute = f["ranks/compute_time"][...].sum(axis=0)
        model = json.loads(f.attrs["compute"])
    assert compute[1] > 2.5 * compute[0], compute  # 4x its measured compute; rank 0 as measured
    assert model["mode"] == "measured"


def test_slowdown_sleeps_after_each_layer_where_the_world_does_not_model_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under MPI (no world hook) a Slowdown observer spends factor - 1 times each outermost
    layer's time (a clock and a sleep that record, not real time)."""
    import hpcdl.driver.context as context_module

    clock, slept = iter([10.0, 10.5, 20.0, 20.25]), []
    monkeypatch.setattr(context_module, "wtime", lambda: next(clock))
    monkeypatch.setattr(context_module, "sleep", slept.append)
    slow = Slowdown(3.0)
    slow.before("forward", None, None)
    slow.before("forward", None, None)  # an inner layer (a block's): inside the outer one's time
    slow.after("forward", None, None)
    slow.after("forward", None, None)  # 0.5 s of the outer layer: 2 x 0.5 more
    slow.before("backward", None, None)
    slow.after("backward", None, None)
    assert slept == [1.0, 0.5]


# -- format-1 checkpoints (before pieces) still resume -------------------------------------------


def _as_format_1(v2: Path, v1: Path) -> None:
    """Rewrite a sync checkpoint of this hpcdl in the layout hpcdl wrote before pieces (format 1)."""
    ckpt = load_checkpoint(v2)
    model, (arrays, meta) = ckpt.pieces["model"], ckpt.ranks[0]
    groups = {"params": model["params"], "optimizer": model["optimizer"], "buffers/0": arrays}
    h = hashlib.sha256()
    for gname in sorted(groups):
        for key in sorted(groups[gname]):
            a = np.ascontiguousarray(groups[gname][key])
            h.update(f"{gname}/{key}:{a.dtype.str}:{a.shape}".encode())
            h.update(a.tobytes())
    old_meta = {"counters": {**meta["driver"], "bytes_sent": 0}, "fit": ckpt.meta["fit"],
                "sampler": meta["sampler"], "optimizer": model["meta"]["optimizer"]}  # fmt: skip
    with h5py.File(v1, "w") as f:
        f.attrs.update({"format_version": 1, "step": ckpt.step, "epoch": ckpt.epoch, "ranks": 1,
                        "config": ckpt.config, "meta": json.dumps(old_meta),
                        "rng": json.dumps([meta["random"]]), "digest": h.hexdigest()})  # fmt: skip
        for gname, arrays_ in groups.items():
            for key, a in arrays_.items():
                f.create_dataset(f"{gname}/{key}", data=a)


def test_a_format_1_checkpoint_resumes_bitwise(tmp_path: Path) -> None:
    sets = ["model.channels=4", "model.dropout=0.3", "train.steps=30", "checkpoint.every=0"]
    cfg = load_config("digits-cnn", sets)
    whole = train(cfg, out=tmp_path / "whole.h5")
    train(load_config("digits-cnn", [*sets, "train.stop_at=12"]), out=tmp_path / "new.h5")
    _as_format_1(checkpoint_path(tmp_path / "new.h5", 12), tmp_path / "old.ckpt-00000012.h5")
    rest = train(cfg, out=tmp_path / "old.h5", resume=str(tmp_path / "old.ckpt-00000012.h5"))
    assert rest.steps == 30
    for (name, a), (_, b) in zip(rest.model.state_dict().items(), whole.model.state_dict().items()):
        assert np.array_equal(a, b), name


def test_the_toy_declares_its_key_fit_key_column_table_and_figure_in_its_own_module(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Everything the toy owns comes from its module (tests/toy_strategy.py): config, run file,
    resume check and report collect it, and a run of another strategy does not know its key."""
    from hpcdl.report import main as report

    with pytest.raises(ConfigError, match="unknown config key 'toy.every'"):
        load_config("digits-mlp", ["toy.every=3"])
    sim, sets = [*TOY_SIM, "--set", "train.steps=9", "--set", "checkpoint.every=6"], ["--set", "toy.every=3"]
    run = tmp_path / "toy.h5"
    assert simulate([*sim, *sets, "--set", "train.stop_at=6", "--out", str(run)]) == 0
    with h5py.File(run, "r") as f:
        assert list(f["metrics/meetings"][...]) == [1, 1, 1, 2, 2, 2]  # the rows of a meeting: its count
        assert list(f["spread/step"][...]) == [3, 6] and f["spread"].attrs["cut_by"] == "step"
        assert (f["spread/spread"][...] > 0).all()  # the workers drifted apart between meetings
    before = run.read_bytes()
    assert simulate([*sim, *sets, "--set", "toy.every=2", "--out", str(run), "--resume", "auto"]) == 2
    assert "was written with toy.every = 3; this run has 2" in capfd.readouterr().err
    assert run.read_bytes() == before  # refused before anything changed
    assert simulate([*sim, *sets, "--out", str(run), "--resume", "auto"]) == 0
    with h5py.File(run, "r") as f:
        assert list(f["spread/step"][...]) == [3, 6, 9]
    assert report([str(run), "--out", str(tmp_path / "figs") + "/"]) == 0
    assert (tmp_path / "figs" / "toy-spread.png").stat().st_size > 0
