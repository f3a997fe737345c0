"""A rank's part of a checkpoint, written once as what it holds (Chainer's ``serialize``).

A strategy describes what its rank holds in one method, ``serialize(s)`` — a piece (its
model's parameters or raw arrays, its optimizer's state, small values), the rank's own
arrays (BatchNorm statistics), its stateful helpers (a sampler, the random streams) and
its counters — and the same calls save it (:class:`Saver`: into a
:class:`~hpcdl.parallel.strategy.RankState`), load it (:class:`Loader`) and check that a
checkpoint's pieces fit this rank before anything is changed (:class:`Checker`). Saving and
loading cannot drift apart, and a new strategy writes no save/load/check triple of its own
(:meth:`hpcdl.parallel.Strategy.state`, ``load_state``, ``check_state`` derive them).

The layout in the file is the one the hand-written triples had: a piece's ``params``,
``optimizer`` and ``meta`` groups, the rank's ``arrays``, and its ``meta`` values by key.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from hpcdl.backend import get_array_module, to_numpy
from hpcdl.errors import ConfigError
from hpcdl.parallel.strategy import RankState, differing_parameters

__all__ = ["REQUIRED", "Checker", "Loader", "Saver", "Serializer"]

#: :meth:`Serializer.value`'s ``missing`` when the checkpoint must hold the key
REQUIRED: Any = object()


def _optimizer_parts(optimizer: Any) -> tuple[dict[str, Any], dict[str, Any], dict[str, dict[str, Any]]]:
    """An optimizer's state as (arrays, small values, groups of its own): an array keyed
    ``<group>/<name>`` for a group the optimizer names in ``state_groups`` (K-FAC's ``kfac``)
    goes to the piece's group ``<group>`` as ``<name>``."""
    opt = optimizer.state_dict() if optimizer is not None else {}
    arrays = {k: v for k, v in opt.items() if isinstance(v, np.ndarray)}
    small = {k: v for k, v in opt.items() if k not in arrays}
    groups: dict[str, dict[str, Any]] = {}
    for group in getattr(optimizer, "state_groups", ()):
        mine = {k for k in arrays if k.startswith(group + "/")}
        groups[group] = {k[len(group) + 1 :]: arrays.pop(k) for k in sorted(mine)}
    return arrays, small, groups


def _optimizer_state(optimizer: Any, saved: Mapping[str, Any]) -> dict[str, Any]:
    """What ``optimizer.load_state_dict`` takes, from a piece :func:`_optimizer_parts` made."""
    state = {**saved["meta"].get("optimizer", {}), **saved.get("optimizer", {})}
    for group in getattr(optimizer, "state_groups", ()):
        state.update({f"{group}/{k}": v for k, v in saved.get(group, {}).items()})
    return state


def _put(target: Any, saved: Any) -> None:
    """Copy ``saved`` into ``target`` in place, in its dtype and on its device."""
    src = np.asarray(saved)
    if tuple(src.shape) != tuple(np.shape(target)):
        raise ValueError(f"shape {tuple(src.shape)} does not match {tuple(np.shape(target))}")
    target[...] = get_array_module(target).asarray(src, dtype=target.dtype)


class Serializer:
    """The calls a strategy's ``serialize`` makes; :class:`Saver`, :class:`Loader` and
    :class:`Checker` give them their meaning."""

    #: True while a checkpoint is being put back (a strategy restarts its batches then)
    loading: bool = False
    #: True while a rank's part is being saved (a strategy gathers what its first holder writes)
    saving: bool = False

    def piece(
        self,
        name: str,
        *,
        model: Any = None,
        arrays: Mapping[str, Any] | None = None,
        optimizer: Any = None,
        meta: Mapping[str, Any] | None = None,
        check: Callable[[Mapping[str, Mapping[str, Any]]], None] | None = None,
    ) -> None:
        """A piece of state several ranks may hold alike (written once, from its first holder).

        Args:
            name: the piece's name (``Placement``'s ``holds``: ``model``, ``stage 1``, ``shard 0``).
            model: a model whose parameters are the piece's ``params`` (by dotted name).
            arrays: or raw arrays as its ``params``, loaded in place.
            optimizer: an optimizer whose state goes with them.
            meta: small values saved with the piece (a pipeline's cut, which ``check`` compares).
            check: ``check(pieces)`` of a checkpoint raises :class:`ConfigError` when they do not fit
                (rank 0 sees every piece: a pipeline's cut, a server's shard sizes).
        """
        raise NotImplementedError

    def own_arrays(self, arrays: Mapping[str, Any]) -> None:
        """This rank's own arrays (BatchNorm statistics, local to each rank), loaded in place."""
        raise NotImplementedError

    def own_buffers(self, model: Any) -> None:
        """``model``'s buffers (BatchNorm's running statistics) as this rank's own arrays."""
        self.own_arrays(dict(model.named_buffers()))

    def stateful(self, key: str, obj: Any) -> None:
        """An object with ``state()`` and ``load_state(value)`` (a sampler), under ``key``."""
        raise NotImplementedError

    def random(self, ctx: Any) -> None:
        """The rank's random streams (``ctx.random_state()`` / ``ctx.load_random_state``)."""
        raise NotImplementedError

    def value(self, key: str, value: Any, *, missing: Any = REQUIRED) -> Any:
        """A small JSON-compatible value under ``key``: returns it (saving) or the saved one (loading;
        ``missing`` when a checkpoint from before the key holds none, else a KeyError)."""
        raise NotImplementedError


class Saver(Serializer):
    """Collects a rank's part into :attr:`state`; pieces only when asked (their first holder)."""

    saving = True

    def __init__(self, pieces: bool) -> None:
        self.pieces = pieces
        self.state = RankState()

    def piece(self, name: str, *, model: Any = None, arrays: Mapping[str, Any] | None = None,
              optimizer: Any = None, meta: Mapping[str, Any] | None = None,
              check: Callable[[Mapping[str, Mapping[str, Any]]], None] | None = None) -> None:  # fmt: skip
        if not self.pieces:
            return
        if model is not None:
            params = {n: to_numpy(p.data).copy() for n, p in model.named_parameters()}
        else:
            params = {n: to_numpy(a).copy() for n, a in (arrays or {}).items()}
        opt_arrays, opt_meta, groups = _optimizer_parts(optimizer)
        self.state.pieces[name] = {"params": params, "optimizer": opt_arrays, **groups,
                                   "meta": {"optimizer": opt_meta, **(meta or {})}}  # fmt: skip

    def own_arrays(self, arrays: Mapping[str, Any]) -> None:
        self.state.arrays.update({n: to_numpy(a).copy() for n, a in arrays.items()})

    def stateful(self, key: str, obj: Any) -> None:
        self.state.meta[key] = obj.state()

    def random(self, ctx: Any) -> None:
        self.state.meta["random"] = ctx.random_state()

    def value(self, key: str, value: Any, *, missing: Any = REQUIRED) -> Any:
        self.state.meta[key] = value
        return value


class Loader(Serializer):
    """Puts a rank's part back (checked first: a piece that does not fit changes nothing)."""

    loading = True

    def __init__(self, state: RankState) -> None:
        self.state = state

    def piece(self, name: str, *, model: Any = None, arrays: Mapping[str, Any] | None = None,
              optimizer: Any = None, meta: Mapping[str, Any] | None = None,
              check: Callable[[Mapping[str, Mapping[str, Any]]], None] | None = None) -> None:  # fmt: skip
        saved = self.state.pieces[name]
        if model is not None:
            model.load_state_dict(saved["params"], strict=False)
        for key, target in (arrays or {}).items():
            _put(target, saved["params"][key])
        if optimizer is not None:
            optimizer.load_state_dict(_optimizer_state(optimizer, saved))

    def own_arrays(self, arrays: Mapping[str, Any]) -> None:
        for key, target in arrays.items():
            _put(target, self.state.arrays[key])

    def stateful(self, key: str, obj: Any) -> None:
        obj.load_state(self.state.meta[key])

    def random(self, ctx: Any) -> None:
        ctx.load_random_state(self.state.meta["random"])

    def value(self, key: str, value: Any, *, missing: Any = REQUIRED) -> Any:
        if missing is not REQUIRED and key not in self.state.meta:
            return missing
        return self.state.meta[key]


class Checker(Serializer):
    """Refuses a checkpoint's pieces that do not fit this rank (on rank 0, before anything changes):
    another model (parameter names or shapes), raw arrays of another shape, a piece's ``meta``
    its ``check`` refuses, or the lack of a piece in ``held`` (the pieces this rank holds and
    is about to load; rank 0's check of a whole checkpoint passes none: its pieces are
    checked where they are present).
    """

    def __init__(self, pieces: Mapping[str, Mapping[str, Any]], held: tuple[str, ...] = ()) -> None:
        self.pieces = pieces
        self.held = held

    def piece(self, name: str, *, model: Any = None, arrays: Mapping[str, Any] | None = None,
              optimizer: Any = None, meta: Mapping[str, Any] | None = None,
              check: Callable[[Mapping[str, Mapping[str, Any]]], None] | None = None) -> None:  # fmt: skip
        saved = self.pieces.get(name)
        if check is not None:  # every piece: rank 0 checks them all, whichever this rank holds
            check(self.pieces)
        if saved is None:
            if name in self.held:  # this rank holds it: a checkpoint that lacks it cannot continue it
                raise ConfigError(f"it holds no {name!r} (another placement or model)")
            return
        if model is not None:
            diff = differing_parameters(model, saved.get("params", {}))
            if diff:
                where = "" if name == "model" else f"{name}: "
                raise ConfigError(f"it holds another model ({where}parameters differ: {diff} ...)")
        if optimizer is not None and hasattr(optimizer, "check_state"):
            problem = optimizer.check_state(_optimizer_state(optimizer, saved))
            if problem:
                raise ConfigError(problem)
        for key, target in (arrays or {}).items():
            got = tuple(np.shape(saved.get("params", {}).get(key, ())))
            if got != tuple(np.shape(target)):
                raise ConfigError(f"it holds another model ({name} has {got[0] if got else 0} elements, "
                                  f"this model's {int(np.size(target))})")  # fmt: skip

    def own_arrays(self, arrays: Mapping[str, Any]) -> None:
        return None

    def stateful(self, key: str, obj: Any) -> None:
        return None

    def random(self, ctx: Any) -> None:
        return None

    def value(self, key: str, value: Any, *, missing: Any = REQUIRED) -> Any:
        return value
