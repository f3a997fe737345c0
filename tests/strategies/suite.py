"""The conformance suite's parametrization and helpers (not shipped): every registered strategy
and the tests' toy, each run as its class's :class:`~hpcdl.parallel.conformance.Conformance` says.

The strategy list is read from the registry at collection time (:func:`hpcdl.components.strategy_names`
plus the toy, named as an outside strategy is), so a strategy that registers joins the suite.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

from hpcdl.components import strategy_names
from hpcdl.config import Config, load_config
from hpcdl.parallel import FreeRunningStrategy, Strategy, strategy_class
from hpcdl.parallel.conformance import Case, Conformance
from hpcdl.store.checkpoint import Checkpoint, list_checkpoints, load_checkpoint

#: the tests' toy strategy (tests/toy_strategy.py), named as an outside strategy is
TOY = "toy_strategy:KeeperAveraging"
#: the suite's base config on top of the digits-mlp preset: a small MLP in float64 (differences
#: from a reference are rounding only), 8 steps with a checkpoint every 4, a constant learning
#: rate that no rank count scales (a reference on another rank count takes the same steps)
BASE = [
    "dtype=float64", "model.width=32", "train.steps=8", "checkpoint.every=4", "schedule.name=constant",
    "schedule.scale=none", "schedule.warmup_epochs=0",
]  # fmt: skip
#: the rank counts each case runs at, in the simulator and (the sizes of make test) under mpiexec
SIZES = (2, 3)
#: the driver's metric columns that measure time: a resumed run need not repeat them
TIMING = ("time", "step_time", "samples_per_s")
#: the rank counts ``--plan -n N`` must print, or refuse in one line, for
PLAN_SIZES = (1, 2, 3, 8, 64, 1024)


def names() -> list[str]:
    """Every registered strategy's name, and the toy's."""
    return [*strategy_names(), TOY]


def conformance(name: str) -> Conformance | None:
    return strategy_class(name).conformance


def short(name: str) -> str:
    """The strategy's name as the test ids show it (``toy`` for the toy's ``module:Class``)."""
    return strategy_class(name).name


def cases(world: str | None = None, reference: bool = False) -> list[Any]:
    """``pytest.param(name, case_name, case)`` for every case of every strategy that declares its
    conformance; only those deterministic in ``world`` (when given), with a reference (when asked)."""
    params = []
    for name in names():
        conf = conformance(name)
        for case_name, case in (conf.cases if conf is not None else {}).items():
            if world is not None and world not in case.deterministic:
                continue
            if reference and case.reference is None:
                continue
            params.append(pytest.param(name, case_name, case, id=f"{short(name)}-{case_name}"))
    return params


def main_cases() -> list[Any]:
    """The first case of every strategy that declares its conformance."""
    return [
        pytest.param(name, *conf.main, id=short(name))
        for name in names()
        if (conf := conformance(name)) is not None
    ]


def setting(key: str, value: Any) -> str:
    """``key=value`` as ``--set`` takes it (JSON's literals are TOML's)."""
    return f"{key}={json.dumps(value)}"


def sets(name: str, case: Case, *extra: str) -> list[str]:
    """The ``key=value`` settings of a run of ``case`` on top of :data:`BASE`, then ``extra``."""
    own = [setting(key, value) for key, value in case.sets.items()]
    return [*BASE, setting("parallel.strategy", name), *own, *extra]


def config(name: str, case: Case, *extra: str) -> Config:
    return load_config("digits-mlp", sets(name, case, *extra))


def reference_sets(name: str, case: Case, world: int) -> tuple[list[str], int] | None:
    """The settings of the case's reference run at ``world`` ranks (a checkpoint at its end only:
    ``checkpoint.every = 0``) and its rank count; None where it has none."""
    assert case.reference is not None
    got = case.reference(config(name, case), world)
    if got is None:
        return None
    changes, ranks = got
    return sets(name, case, *(setting(k, v) for k, v in changes.items()), "checkpoint.every=0"), ranks


def reference_or_skip(name: str, case: Case, world: int) -> tuple[list[str], int]:
    """:func:`reference_sets` at ``world`` ranks, skipping the test below the strategy's smallest
    rank count or where the case has no reference there."""
    skip_below(name, world)
    ref = reference_sets(name, case, world)
    if ref is None:
        pytest.skip(f"no reference at {world} ranks")
    return ref


def stop_step(cfg: Config) -> int:
    """Where the suite stops a run: its first checkpoint."""
    return cfg["checkpoint.every"]


def skip_below(name: str, world: int) -> None:
    conf = conformance(name)
    if conf is not None and world < conf.min_ranks:
        pytest.skip(f"{short(name)} takes {conf.min_ranks} ranks or more")


def cost_table(tmp_path: Path, cfg: Config) -> str:
    """``table:FILE`` for ``--compute``: each top-level layer of the model 100 us forward, 200 us back."""
    table = tmp_path / "equal-costs.toml"
    layers = len(model(cfg).layers)
    table.write_text(
        "".join(f'[[layers]]\nlayer = "{i}"\nforward_s = 1e-4\nbackward_s = 2e-4\n' for i in range(layers))
    )
    return f"table:{table}"


def compute(case: Case, tmp_path: Path, cfg: Config) -> str:
    return cost_table(tmp_path, cfg) if case.compute == "table" else "none"


def model(cfg: Config) -> Any:
    """The config's model as rank 0 of a run builds it (its parameters' names and order)."""
    from hpcdl.driver.factory import build, load_data

    return build(cfg, load_data(cfg), 0, np.float64, np)


def parameter_names(cfg: Config) -> list[str]:
    return [name for name, _ in model(cfg).named_parameters()]


def final_checkpoint(run_file: Path) -> Checkpoint:
    """The newest checkpoint of ``run_file``: a finished run's, at its end."""
    return load_checkpoint(list_checkpoints(run_file)[0])


def parameters(name: str, ckpt: Checkpoint, names_: list[str]) -> np.ndarray:
    """The model's parameters in the model's order from ``ckpt``, as the strategy ``name`` holds them."""
    conf = conformance(name)
    if conf is not None and conf.parameters is not None:
        return conf.parameters(ckpt.pieces, names_)
    by_name: dict[str, np.ndarray] = {}
    for piece in ckpt.pieces.values():
        for key, value in piece["params"].items():
            by_name.setdefault(key, value)
    assert set(by_name) == set(names_), (sorted(by_name), names_)
    return np.concatenate([np.asarray(by_name[n]).ravel() for n in names_])


def _arrays(ckpt: Checkpoint) -> Iterator[tuple[str, np.ndarray]]:
    for piece, groups in sorted(ckpt.pieces.items()):
        for group, arrays in sorted(groups.items()):
            if isinstance(arrays, dict):
                for key, value in sorted(arrays.items()):
                    if isinstance(value, np.ndarray):
                        yield f"{piece}/{group}/{key}", value
    for rank, (arrays, _) in enumerate(ckpt.ranks):
        for key, value in sorted(arrays.items()):
            yield f"rank {rank}/{key}", np.asarray(value)


def assert_same_checkpoints(a: Checkpoint, b: Checkpoint) -> None:
    """Every piece's arrays (parameters, optimizer state) and every rank's own arrays, bit for bit."""
    assert a.step == b.step and sorted(a.pieces) == sorted(b.pieces)
    mine, theirs = dict(_arrays(a)), dict(_arrays(b))
    assert sorted(mine) == sorted(theirs)
    for key, value in mine.items():
        other = theirs[key]
        assert value.dtype == other.dtype and value.shape == other.shape, key
        assert value.tobytes() == other.tobytes(), f"{key} differs after the resume"


def assert_same_rows(name: str, a: Path, b: Path, resumed_at: int) -> None:
    """The run files' metrics and the strategy's row tables, but for the columns that measure time;
    ``a`` (of ``name``, in the world it ran in) was resumed at ``resumed_at``."""
    cls: type[Strategy] = strategy_class(name)
    conf = conformance(name)
    timing = {*TIMING, *(conf.timing if conf is not None else ())}
    groups = ["metrics", *cls.declares.tables]
    with h5py.File(a, "r") as f, h5py.File(b, "r") as g:
        assert f.attrs["status"] == g.attrs["status"] == "finished"
        assert list(f.attrs["resumed_at"]) == [resumed_at] and not len(g.attrs.get("resumed_at", []))
        assert f.attrs["world"] == g.attrs["world"] and f.attrs["strategy"] == short(name)
        for group in groups:
            assert sorted(f[group]) == sorted(g[group]), group
            for column in f[group]:
                if column in timing or f"{group}/{column}" in timing:
                    continue
                np.testing.assert_array_equal(f[group][column][...], g[group][column][...],
                                              err_msg=f"{group}/{column}")  # fmt: skip


def assert_agrees(name: str, case: Case, got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape
    scale = float(np.abs(want).max())
    np.testing.assert_allclose(got, want, rtol=0, atol=case.tolerance * scale,
                               err_msg=f"{short(name)} against its reference")  # fmt: skip


def meeting_method(cls: type[Strategy]) -> str:
    """Where a strategy's rows come from: ``meet`` (running free) or ``agree`` (in lockstep)."""
    return "meet" if issubclass(cls, FreeRunningStrategy) else "agree"
