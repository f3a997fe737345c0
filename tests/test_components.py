"""The registry of components (hpcdl.components) and the symmetric checkpoint description
(hpcdl.parallel.state): what a broken outside strategy, a checkpoint lacking a rank's piece
and an old key name in ``with_updates`` do."""

from __future__ import annotations

import numpy as np
import pytest

from hpcdl import components
from hpcdl.config import Config, schema
from hpcdl.errors import ConfigError
from hpcdl.parallel.state import Checker, Loader, Saver
from hpcdl.parallel.strategy import RankState


def test_a_broken_installed_strategy_is_named_and_the_others_work(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(components, "_entry_points", lambda: {"gossip": "no_such_module_here:Gossip"})
    components._all_declared.cache_clear()
    schema.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="'gossip' an installed package registers cannot be loaded"):
            cfg = Config({"parallel.strategy": "ps", "ps.mode": "ssp"})
        assert cfg["ps.mode"] == "ssp"
        with pytest.raises(ConfigError, match="cannot import 'no_such_module_here'"):
            components.declared("gossip")  # chosen, it is an error
    finally:
        components._all_declared.cache_clear()
        schema.cache_clear()


def test_with_updates_reads_old_names_and_drops_an_outside_strategys_keys() -> None:
    cfg = Config({"parallel.strategy": "ps"}).with_updates({"parallel.servers": 2})
    assert cfg["ps.servers"] == 2
    toy = Config({"parallel.strategy": "toy_strategy:KeeperAveraging", "toy.every": 3})
    assert toy["toy.every"] == 3
    synced = toy.with_updates({"parallel.strategy": "sync"})
    assert "toy.every" not in synced.values and synced["parallel.strategy"] == "sync"


class _Holder:
    """A rank holding one piece: raw arrays (as a parameter server's shard) and its own arrays."""

    def __init__(self, n: int) -> None:
        self.shard = np.arange(n, dtype=np.float64)
        self.own = np.full(3, 7.0)
        self.count = 5

    def serialize(self, s) -> None:
        s.piece("shard 0", arrays={"shard": self.shard})
        s.own_arrays({"bn0": self.own})
        self.count = int(s.value("count", self.count))


def test_save_load_and_check_walk_the_same_description() -> None:
    a = _Holder(4)
    saver = Saver(pieces=True)
    a.serialize(saver)
    b = _Holder(4)
    b.shard[:] = 0
    b.own[:] = 0
    b.count = 0
    b.serialize(Checker(saver.state.pieces, held=("shard 0",)))
    b.serialize(Loader(saver.state))
    assert (b.shard == a.shard).all() and (b.own == a.own).all() and b.count == 5
    with pytest.raises(ConfigError, match="shard 0 has 4 elements, this model's 6"):
        _Holder(6).serialize(Checker(saver.state.pieces))
    with pytest.raises(ConfigError, match="it holds no 'shard 0'"):
        _Holder(4).serialize(Checker(RankState().pieces, held=("shard 0",)))
    _Holder(4).serialize(Checker({}))  # rank 0's check of a checkpoint: only what is present
