"""Keys a strategy cannot honour are refused; keys of a strategy that is not running are named once.

``exchange.compression`` under ``ps`` or ``pipeline`` used to be ignored while
``exchange.accumulate`` was refused, and ``pipeline.*`` under ``sync`` did nothing without a
word (issue 20, item 8).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hpcdl.components import STRATEGIES
from hpcdl.config import SCHEMA, load_config
from hpcdl.driver.run import plan
from hpcdl.errors import ConfigError
from hpcdl.parallel import strategy_class
from hpcdl.parallel.strategy import ignored_keys


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_every_declared_key_is_a_config_key(name: str) -> None:
    cls = strategy_class(name)
    for own in (*cls.keys, *cls.cannot_honour):
        matches = [k for k in SCHEMA if k == own or (own.endswith(".") and k.startswith(own))]
        assert matches, f"{name} declares {own!r}, which names no config key"


@pytest.mark.parametrize(
    ("strategy", "ranks", "key", "value", "why"),
    [
        ("ps", 3, "exchange.compression", "float16", "pushes and replies carry the parameters' dtype"),
        ("ps", 3, "exchange.compression", "int32", "uncompressed"),
        ("ps", 3, "exchange.accumulate", "2", "a push is one batch"),
        ("pipeline", 3, "exchange.compression", "bfloat16", "between stages in the model's dtype"),
        ("pipeline", 3, "exchange.accumulate", "2", "set pipeline.microbatches instead"),
    ],
)
def test_a_key_the_strategy_cannot_honour_is_refused(
    strategy: str, ranks: int, key: str, value: str, why: str
) -> None:
    cfg = load_config("digits-mlp", [f"parallel.strategy={strategy}", f"{key}={value}"])
    with pytest.raises(ConfigError) as err:
        plan(cfg, ranks)
    text = str(err.value)
    assert text.startswith(f"{key} = ") and f"parallel.strategy = {strategy!r}" in text and why in text, text
    assert "\n" not in text


def test_sync_honours_the_exchange_keys() -> None:
    cfg = load_config("digits-mlp", ["exchange.compression=float16", "exchange.accumulate=2"])
    assert plan(cfg, 3).world == 3
    assert ignored_keys(cfg) == []


def test_keys_of_another_strategy_are_named() -> None:
    cfg = load_config(
        "digits-mlp",
        ["pipeline.microbatches=8", "ps.mode=ssp", "ps.staleness=2", "exchange.bucket_mb=1"],
    )
    lines = ignored_keys(cfg)
    assert lines == [
        "ps.mode = 'ssp' is a key of parallel.strategy = 'ps': this 'sync' run ignores it",
        "ps.staleness = 2 is a key of parallel.strategy = 'ps': this 'sync' run ignores it",
        "pipeline.microbatches = 8 is a key of parallel.strategy = 'pipeline': this 'sync' run ignores it",
    ]
    under_ps = ignored_keys(cfg.with_updates({"parallel.strategy": "ps"}))
    assert [line.split(" = ")[0] for line in under_ps] == ["pipeline.microbatches", "exchange.bucket_mb"]
    assert "parallel.strategy = 'sync' or 'pipeline' or 'local': this 'ps' run ignores it" in under_ps[1]


def test_a_key_at_its_default_is_not_named() -> None:
    default = SCHEMA["pipeline.microbatches"].default
    assert ignored_keys(load_config("digits-mlp", [f"pipeline.microbatches={default}"])) == []


def test_the_train_command_names_each_ignored_key_once(tmp_path: Path) -> None:
    """Three virtual ranks, one line each on rank 0's stderr; the run goes on."""
    proc = subprocess.run(
        [sys.executable, "-m", "hpcdl.simulate", "-n", "3", "-m", "hpcdl.train", "--config", "digits-mlp",
         "--set", "train.steps=2", "--set", "pipeline.schedule=gpipe", "--set", "ps.servers=2",
         "--progress", "none", "--out", str(tmp_path / "r.h5")],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    for key in ("pipeline.schedule = 'gpipe'", "ps.servers = 2"):
        assert proc.stderr.count(f"hpcdl.train: ! {key} is a key of parallel.strategy") == 1, proc.stderr
