"""What a strategy works out from the model before it is placed (:meth:`Strategy.settle`), settled once.

Rank 0 builds the inputs (:class:`PlanInputs`: a model, the data set, a network file's α-β,
and on a resume the config the run file stores), asks the strategy, and hands every rank the
updated config — or every rank the same error. The pipeline's planner (``pipeline.balance =
"plan"``) settles this way, and so, after the memory check, does ``model.winograd = "measure"``
for every strategy (:func:`settle_convolutions`); a run with nothing to settle costs a broadcast.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from hpcdl.backend import array_module
from hpcdl.comm import Communicator, on_root
from hpcdl.config import Config, legacy_values, stored_values
from hpcdl.data import Dataset, gather_batch
from hpcdl.driver.convplan import settle_winograd
from hpcdl.driver.factory import build, load_data
from hpcdl.errors import HpcdlError
from hpcdl.nn import Sequential
from hpcdl.parallel import strategy_class
from hpcdl.rng import generator
from hpcdl.sim.network import load_network
from hpcdl.store.checkpoint import checkpoint_config
from hpcdl.store.runfile import read_attrs

__all__ = ["PlanInputs", "continue_legacy", "settle", "settle_convolutions", "stored_config"]


class PlanInputs:
    """The driver's :class:`hpcdl.parallel.strategy.PlanInputs`: built lazily, the data set loaded once.

    Args:
        cfg: the config as given.
        data: the loaded data set, if the caller has it.
        stored: the config of the run being resumed (:func:`stored_config`), or None.
    """

    def __init__(self, cfg: Config, data: Dataset | None = None, stored: Mapping[str, Any] | None = None):
        self.cfg, self._data, self.stored = cfg, data, stored

    def data(self) -> Dataset:
        if self._data is None:
            self._data = load_data(self.cfg)
        return self._data

    def model(self) -> Sequential:
        cfg = self.cfg
        xp = array_module(cfg["device"])
        return build(cfg, self.data(), 0, np.dtype(cfg["dtype"]), xp, generator(cfg["seed"], "plan"))

    def network(self, spec: str, ranks: int) -> tuple[float, float]:
        """α (s) and β (s/byte) between two of ``ranks`` ranks (:meth:`Network.alpha_beta`)."""
        return load_network(spec).alpha_beta(ranks)

    def batch(self, indices: Any) -> tuple[Any, Any]:
        """Training samples (in the config's dtype) and labels at ``indices``, gathered as a step's."""
        data = self.data()
        x, y = gather_batch(data.x_train, data.y_train, indices, np)
        return x.astype(self.cfg["dtype"], copy=False), y


def stored_config(out: str | os.PathLike[str] | None, resume: str | None) -> dict[str, Any] | None:
    """The config a run file stores, when the run resumes from it — or, resumed from a checkpoint
    without a run file (none given, or a new one), the checkpoint's (None for a fresh run, or a
    file that cannot be read: opening the run reports that, in its own words)."""
    if resume is None:
        return None
    try:
        if out is not None and Path(out).is_file():
            text = read_attrs(out).get("config")
        elif resume != "auto":
            text = checkpoint_config(resume)
        else:
            return None
        return stored_values(text) if text else None
    except HpcdlError:
        return None


def continue_legacy(cfg: Config, stored: Mapping[str, Any] | None) -> tuple[Config, list[str]]:
    """``cfg`` for continuing a run whose stored config predates some keys: each such key that
    declares a legacy value (:attr:`Key.legacy <hpcdl.components.Key>`) and that ``cfg`` leaves
    at its default takes that value, so the run goes on as it began (an int32 run of before
    ``exchange.int32_scale`` keeps the ``max`` rule); and one line per key saying so.

    Args:
        cfg: the config as given.
        stored: the config of the run being resumed (:func:`stored_config`), or None: a fresh run.
    """
    if stored is None:
        return cfg, []
    updates = {k: v for k, v in legacy_values(stored).items() if k in cfg.values and not cfg.is_set(k)}
    lines = [
        f"{k} = {v!r}: the run predates this key and continues as it began (a new run: {cfg[k]!r})"
        for k, v in updates.items()
        if v != cfg[k]
    ]
    return (cfg.with_updates(updates) if updates else cfg), lines


def settle(
    cfg: Config, world: int, comm: Communicator | None = None, inputs: PlanInputs | None = None
) -> Config:
    """``cfg`` with what ``parallel.strategy`` settles for ``world`` ranks (:meth:`Strategy.settle`),
    worked out on rank 0 of ``comm`` (None: this process alone) and the same on every rank.

    Raises:
        HpcdlError: the strategy's refusal, on every rank alike.
    """
    cls = strategy_class(cfg["parallel.strategy"])
    here = inputs or PlanInputs(cfg)

    if comm is None:
        updates = cls.settle(cfg, world, here)
    else:
        updates = on_root(comm, lambda: cls.settle(cfg, world, here))
    return cfg.with_updates(updates) if updates else cfg


def settle_convolutions(cfg: Config, comm: Communicator, inputs: PlanInputs) -> Config:
    """``cfg`` with the 3x3 convolutions that multiply by Winograd (``model.winograd``:
    :func:`~hpcdl.driver.convplan.settle_winograd`), worked out on rank 0 of ``comm`` and the same
    on every rank. The driver asks after the memory check, so that a run that cannot fit is told
    so before anything is timed; the check, and the pipeline's planner when it profiles, see the
    layers by ``Conv2d``'s rule.

    Raises:
        HpcdlError: ``model.winograd_layers`` set beside another mode than ``layers``, or naming
            what is not an eligible layer, on every rank alike.
    """
    updates = on_root(comm, lambda: settle_winograd(cfg, inputs))
    return cfg.with_updates(updates) if updates else cfg
