"""Components and what each declares: config keys, fit keys, metric columns, row tables, plots.

A *component* is a part of a run that a config selects or always has: a strategy
(``parallel.strategy``), the optimizer and its schedule, sync's gradient exchange. Each
declares what it owns (:class:`Declares`) — its config section (keys, types, defaults,
checks, help), which of its keys fix the trajectory (a resume refuses another value), its
extra metric columns, its extra row tables (with the column a resume cuts by), what the
report draws for it, and old names of its keys — and the config, the checkpoints, the run
file and the report collect these from here and never name a strategy (as pytest plug-ins
add their own options).

The registry names components as ``module:attribute`` text, imported on first use, so this
module sits below everything it lists: built-in strategies (:data:`STRATEGIES`), an
outside one named by ``parallel.strategy = "module:Class"`` or installed under the entry
point group ``hpcdl.strategies``, and the shared components every run has (:data:`SHARED`).
"""

from __future__ import annotations

import functools
import importlib
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from hpcdl.errors import ConfigError

__all__ = [
    "ENTRY_POINTS",
    "SHARED",
    "STRATEGIES",
    "Declares",
    "Key",
    "Plot",
    "Table",
    "all_declared",
    "declared",
    "load",
    "strategy_names",
    "strategy_target",
]

#: built-in strategies: ``parallel.strategy`` name -> ``module:Class``
STRATEGIES: dict[str, str] = {
    "sync": "hpcdl.parallel.sync:SyncDataParallel",
    "ps": "hpcdl.parallel.ps:ParameterServer",
    "pipeline": "hpcdl.parallel.pipeline:Pipeline",
    "local": "hpcdl.parallel.local:LocalAveraging",
}
#: components every run has whatever its strategy: ``module:attribute`` of their :class:`Declares`
SHARED: tuple[str, ...] = (
    "hpcdl.optim:DECLARES",
    "hpcdl.parallel.exchange:DECLARES",
    "hpcdl.parallel.fault:DECLARES",
)
#: the entry-point group an installed package registers its strategies under (name = ``module:Class``)
ENTRY_POINTS = "hpcdl.strategies"


def _type_name(t: type) -> str:
    return {str: "a string", int: "an integer", float: "a float", bool: "a boolean", list: "a list"}[t]


@dataclass(frozen=True)
class Key:
    """One config key: its type, default, allowed values and meaning.

    Numbers lie in ``[minimum, below)`` and above ``above`` (each bound only when
    given), or are one of ``also`` (a value with a meaning of its own, such as 0 for
    "infer"); floats must be finite.

    ``legacy`` is for a key added after runs were made without it: the value those runs
    behaved as (None: the key's ``default``, nothing changed). A stored config without the key
    (a run file or checkpoint that predates it) is read with that value
    (:func:`hpcdl.config.legacy_values`): a resume of such a run continues with it when the
    config leaves the key at its default, saying so in one line, and a fit key is compared
    with it. So a key may give new runs a new behaviour by default while old runs continue,
    bitwise, as they began (``exchange.int32_scale``: ``pow2``, ``legacy="max"``).
    """

    type: type
    default: Any
    doc: str
    choices: tuple[Any, ...] = ()
    minimum: float | None = None
    below: float | None = None  # exclusive upper bound
    item: type | None = None  # lists: the type of every element (positive when numeric)
    above: float | None = None  # exclusive lower bound
    also: tuple[Any, ...] = ()  # values allowed outside the bounds
    pattern: str = ""  # lists of strings: the regular expression every element matches
    pattern_doc: str = ""  # ... and how it reads, for the table and errors
    or_list: bool = False  # a string of ``choices`` or a non-empty list of positive ``item``s
    legacy: Any = None  # the value of runs that predate the key (None: its default)

    @property
    def type_name(self) -> str:
        """The type column of the key table: ``str``, or ``str or list`` for ``or_list`` keys."""
        return f"{self.type.__name__} or list" if self.or_list else self.type.__name__

    def bounds(self) -> str:
        """The allowed values in words, e.g. ``>= 2, or 0``, ``> 0``, ``>= 0, < 1``; '' if any."""
        if self.choices:
            text = " / ".join(map(str, self.choices))
            if self.or_list and self.item is not None:
                text += f", or a list of {_type_name(self.item).split()[-1]}s > 0"
            return text
        parts = []
        if self.minimum is not None:
            parts.append(f">= {self.minimum:g}")
        if self.above is not None:
            parts.append(f"> {self.above:g}")
        if self.below is not None:
            parts.append(f"< {self.below:g}")
        if self.item is str:
            parts.append(f"strings {self.pattern_doc}")
        elif self.item is not None:
            parts.append(f"{_type_name(self.item).split()[-1]}s > 0")
        text = ", ".join(parts)
        if self.also:
            text += ", or " + " or ".join(map(str, self.also))
        return text


@dataclass(frozen=True)
class Table:
    """A row group of the run file beside ``metrics/`` (``staleness/``: a row per applied push).

    Attributes:
        columns: column -> NumPy dtype (a name such as ``"int64"``, or a type).
        cut_by: the column a resume cuts by: rows whose value is past the checkpoint's step go.
    """

    columns: Mapping[str, Any]
    cut_by: str

    def __post_init__(self) -> None:
        if self.cut_by not in self.columns:
            raise ValueError(f"a table's cut_by column {self.cut_by!r} is not one of its columns")


@dataclass(frozen=True)
class Plot:
    """A figure the report draws for a component's runs (``<prefix>-<name>.png``).

    Attributes:
        name: the figure's name in the file name.
        draw: ``draw(runs)`` -> a Matplotlib figure, or None when nothing is to be shown; ``runs``
            are ``(run, label)`` pairs of the runs of this component, each run having ``attrs``
            (the run file's attributes), ``metrics`` and ``tables`` (row group -> column ->
            array). Matplotlib is imported by ``draw`` itself, not at module load.
    """

    name: str
    draw: Callable[[list[tuple[Any, str]]], Any]


@dataclass(frozen=True)
class Declares:
    """What a component owns (see the module's docstring); every field may be empty.

    Attributes:
        keys: config keys by dotted name (the component's section, ``ps.mode``).
        fit_keys: keys that fix the trajectory: a resume with another value is refused.
        metrics: extra ``metrics/`` columns, column -> NumPy dtype: the keys a strategy's
            rows may carry beyond the driver's (a row key nobody declared is an error).
        tables: extra row groups, name -> :class:`Table`.
        plots: figures the report draws for runs of the component.
        legend: ``legend(config)`` -> a run's label in the report's legends (``ssp s=1``), from
            the run's config values by dotted key (None: the strategy's name).
        renamed: an old key name -> its name now: a config, run file or checkpoint with the old
            name is read under the new one (a config says so in one line).
        series: the strategy's own per-rank series (``ranks/``) in words, for the report
            (``pushes_per_s``: ``pushes per second``).
        rate: the per-rank series that is the steps a rank made per second, when ``ranks/`` rows
            are meetings: the report divides a rank's time in a meeting by its share of the
            meeting's steps (a rank without it served every step).
        step_name: what one step is, in the report's words (``push``).
    """

    keys: Mapping[str, Key] = field(default_factory=dict)
    fit_keys: tuple[str, ...] = ()
    metrics: Mapping[str, Any] = field(default_factory=dict)
    tables: Mapping[str, Table] = field(default_factory=dict)
    plots: tuple[Plot, ...] = ()
    legend: Callable[[Mapping[str, Any]], str] | None = None
    renamed: Mapping[str, str] = field(default_factory=dict)
    series: Mapping[str, str] = field(default_factory=dict)
    rate: str = ""
    step_name: str = "step"

    def __post_init__(self) -> None:
        unknown = [k for k in self.fit_keys if k not in self.keys]
        if unknown:
            raise ValueError(f"fit keys {unknown} are not among the component's own keys")

    @staticmethod
    def merge(parts: Iterable[Declares]) -> Declares:
        """The union of ``parts`` (the first declaration of a name wins; a legend, rate and step name:
        the last given)."""
        keys: dict[str, Key] = {}
        fit: dict[str, None] = {}
        metrics: dict[str, Any] = {}
        tables: dict[str, Table] = {}
        plots: dict[str, Plot] = {}
        renamed: dict[str, str] = {}
        series: dict[str, str] = {}
        legend, rate, step_name = None, "", "step"
        for part in parts:
            for name, key in part.keys.items():
                keys.setdefault(name, key)
            fit.update(dict.fromkeys(part.fit_keys))
            for column, dtype in part.metrics.items():
                metrics.setdefault(column, dtype)
            for name, table in part.tables.items():
                tables.setdefault(name, table)
            for plot in part.plots:
                plots.setdefault(plot.name, plot)
            for old, new in part.renamed.items():
                renamed.setdefault(old, new)
            for name, words in part.series.items():
                series.setdefault(name, words)
            legend, rate = part.legend or legend, part.rate or rate
            step_name = part.step_name if part.step_name != "step" else step_name
        return Declares(keys=keys, fit_keys=tuple(fit), metrics=metrics, tables=tables,
                        plots=tuple(plots.values()), legend=legend, renamed=renamed, series=series,
                        rate=rate, step_name=step_name)  # fmt: skip


def load(target: str) -> Any:
    """The object ``module:attribute`` names (a strategy class, a :class:`Declares`).

    Raises:
        ConfigError: the module cannot be imported or has no such attribute.
    """
    module, sep, attribute = target.partition(":")
    if not sep or not module or not attribute:
        raise ConfigError(f"{target!r} is not module:attribute (e.g. my_package.strategies:Gossip)")
    try:
        found = importlib.import_module(module)
    except ImportError as err:
        raise ConfigError(f"cannot import {module!r} for {target!r}: {err} (is it on PYTHONPATH?)") from None
    try:
        return getattr(found, attribute)
    except AttributeError:
        raise ConfigError(f"module {module!r} has no {attribute!r} (named by {target!r})") from None


@functools.cache
def _entry_points() -> dict[str, str]:
    """Strategies installed packages register (``hpcdl.strategies``): name -> ``module:Class``."""
    return {ep.name: ep.value for ep in metadata.entry_points(group=ENTRY_POINTS)}


def strategy_names() -> list[str]:
    """Every registered strategy's name: the built-in ones, then those of installed packages."""
    return [*STRATEGIES, *(n for n in _entry_points() if n not in STRATEGIES)]


def strategy_target(name: str) -> str:
    """The ``module:Class`` of strategy ``name``: a registered name, or ``module:Class`` itself.

    Raises:
        ConfigError: no strategy has that name.
    """
    if ":" in name:
        return name
    target = STRATEGIES.get(name) or _entry_points().get(name)
    if target is None:
        raise ConfigError(
            f"parallel.strategy = {name!r} is not a strategy; strategies: {', '.join(strategy_names())}, "
            "or module:Class of your own"
        )
    return target


def _strategy_declares(target: str) -> Declares:
    return getattr(load(target), "declares", None) or Declares()


def declared(strategy: str) -> Declares:
    """What a run of ``strategy`` (a name or ``module:Class``) has: the shared components' and its own.

    Raises:
        ConfigError: the strategy is unknown or cannot be imported.
    """
    return _declared(strategy_target(strategy))


@functools.cache
def _declared(target: str) -> Declares:
    return Declares.merge([*(load(t) for t in SHARED), _strategy_declares(target)])


def all_declared(strategy: str = "") -> Declares:
    """Every registered component's declarations, and ``strategy``'s (an outside ``module:Class``):
    the config keys a config may set (a key of a strategy not running is known, and ignored).

    Raises:
        ConfigError: ``strategy`` is ``module:Class`` and cannot be imported.
    """
    return _all_declared(strategy if ":" in strategy else "")


@functools.cache
def _all_declared(outside: str) -> Declares:
    parts = [load(t) for t in SHARED] + [_strategy_declares(STRATEGIES[n]) for n in STRATEGIES]
    for name, target in _entry_points().items():  # an installed package's: a broken one is named, not fatal
        if name in STRATEGIES:
            continue
        try:
            parts.append(_strategy_declares(target))
        except ConfigError as err:
            warnings.warn(f"the strategy {name!r} an installed package registers cannot be loaded: {err}",
                          RuntimeWarning, stacklevel=2)  # fmt: skip
    if outside:
        parts.append(_strategy_declares(outside))
    return Declares.merge(parts)
