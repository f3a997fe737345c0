"""The switch exchange's config: the switch rank set aside in sync's placement; one-line refusals."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hpcdl.config import load_config
from hpcdl.errors import ConfigError
from hpcdl.parallel.pipeline import Pipeline
from hpcdl.parallel.sync import SyncDataParallel

SWITCH = ["exchange.name=switch"]
RANK = [*SWITCH, "exchange.switch=rank"]


def test_the_switch_rank_is_set_aside_from_the_workers() -> None:
    cfg = load_config("digits-mlp", [*RANK, "data.batch_size=16"])
    placement = SyncDataParallel.plan(cfg, 5)
    assert [p.role for p in placement.ranks] == ["worker"] * 4 + ["switch"]
    assert [p.member for p in placement.ranks] == [0, 1, 2, 3, -1]
    assert placement.ranks[-1].holds == ""
    assert (placement.world, placement.width, placement.global_batch) == (5, 4, 64)
    assert any("rank 4: the aggregation switch" in note for note in placement.notes)
    spawned = SyncDataParallel.plan(load_config("digits-mlp", [*SWITCH, "data.batch_size=16"]), 5)
    assert spawned.width == 5 and {p.role for p in spawned.ranks} == {"worker"}


@pytest.mark.parametrize(
    ("sets", "world", "says"),
    [
        (RANK, 1, "run on 2 ranks or more"),
        ([*RANK, "fault.p=0.1"], 3, "fault.* with exchange.switch = 'rank' is not built"),
    ],
)
def test_sync_refuses_in_one_line(sets: list[str], world: int, says: str) -> None:
    with pytest.raises(ConfigError, match=says) as e:
        SyncDataParallel.plan(load_config("digits-mlp", sets), world)
    assert "\n" not in str(e.value)


def test_a_pipeline_refuses_the_switch() -> None:
    cfg = load_config("digits-mlp", [*SWITCH, "parallel.strategy=pipeline"])
    with pytest.raises(ConfigError, match="a stage's replicas do not sum through a switch"):
        Pipeline.plan(cfg, 2)


def test_plan_prints_the_switch_rank_and_its_memory() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "hpcdl.train", "--config", "digits-mlp", "--set", 'exchange.name="switch"',
         "--set", 'exchange.switch="rank"', "--plan", "-n", "3"],
        capture_output=True, text=True, check=True, timeout=120,
    ).stdout  # fmt: skip
    assert "data-parallel width 2" in out
    assert "rank 2        switch" in out and "slots" in out
    assert "rank 2: the aggregation switch (exchange.switch = 'rank'): 64 slots of 1024 bytes" in out


def test_bad_switch_settings_exit_2_in_one_line() -> None:
    for sets, says in (
        (['exchange.switch="localhost"'], "exchange.switch: a switch address is HOST:PORT"),
        (["exchange.int32_scale=\"max\""], "quantizes with exchange.int32_scale = 'pow2'"),
        (['exchange.compression="float16"'], "sends int32"),
        (["switch.payload=512"], "switch.payload"),
    ):
        args = [sys.executable, "-m", "hpcdl.train", "--config", "digits-mlp", "--set", "train.steps=1"]
        for s in ['exchange.name="switch"', *sets]:
            args += ["--set", s]
        done = subprocess.run(args, check=False, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, (sets, done.stderr)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and says in lines[0], (sets, done.stderr)
