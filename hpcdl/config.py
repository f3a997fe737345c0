"""Run configuration: TOML files and presets with dotted keys, checked against typed defaults."""

from __future__ import annotations

import difflib
import functools
import math
import operator
import re
import tomllib
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpcdl.components import SHARED, STRATEGIES, Key, _type_name, all_declared, load
from hpcdl.data import DATASETS, KINDS
from hpcdl.errors import ConfigError
from hpcdl.models import MODELS

if TYPE_CHECKING:  # pragma: no cover
    from hpcdl.driver.cli import ArgumentParser

__all__ = [
    "add_set_argument",
    "stored_values",
    "legacy_values",
    "DRIVER_FIT_KEYS",
    "DRIVER_KEYS",
    "Key",
    "schema",
    "Config",
    "load_config",
    "preset_names",
    "parse_set",
    "markdown_table",
    "build_parser",
    "main",
]  # fmt: skip


#: The driver's own config keys (the run, model, data, train, profile, checkpoint, log and
#: debug sections, and ``parallel.strategy``); every other key is a component's
#: (:mod:`hpcdl.components`): the optimizer's, the exchange's, each strategy's section.
DRIVER_KEYS: dict[str, Key] = {
    "name": Key(str, "", "run name (defaults to the preset or file name)"),
    "seed": Key(int, 0, "seed of every random stream (init, epoch permutation, dropout)", minimum=0),
    "device": Key(str, "cpu", "array device", choices=("cpu", "gpu")),
    "dtype": Key(str, "float32", "parameter and activation dtype", choices=("float32", "float64")),
    "model.name": Key(str, "mlp", "model builder", choices=MODELS),
    "model.depth": Key(int, 3, "mlp: number of Linear layers", minimum=1),
    "model.width": Key(int, 256, "mlp: hidden width", minimum=1),
    "model.width_mult": Key(float, 1.0, "cnn/vgg16/resnet: channel width multiplier", above=0.0),
    "model.channels": Key(int, 32, "cnn: channels of the first convolution", minimum=1),
    "model.dropout": Key(float, 0.0, "mlp/cnn: dropout probability before the head", minimum=0.0, below=1.0),
    "model.winograd": Key(
        str,
        "measure",
        "which 3x3 stride-1 convolutions multiply by Winograd: measure (each layer shape timed both "
        "ways on this machine, once, and cached; settles into layers), layers (model.winograd_layers), "
        "rule (64+ channels), always, never",
        choices=("measure", "layers", "rule", "always", "never"),
        legacy="rule",
    ),
    "model.winograd_layers": Key(
        list,
        [],
        "model.winograd = layers: the layers that multiply by Winograd (what measure settles: those "
        "where it was faster; recorded, and a resume keeps them)",
        item=str,
        pattern=r"\S+",
        pattern_doc="(layer names, as 3.conv1)",
    ),
    "data.name": Key(str, "digits", "data set", choices=DATASETS),
    "data.path": Key(str, "", "file or directory of the data set (digits: bundled when empty)"),
    "data.batch_size": Key(int, 32, "samples per step PER RANK (global batch = ranks x batch)", minimum=1),
    "data.sampler": Key(
        str,
        "shuffle",
        "shuffle: strided shards of one permutation; random: with replacement",
        choices=KINDS,
    ),
    "data.shape": Key(list, [1, 28, 28], "synthetic: per-sample input shape", item=int),
    "data.num_classes": Key(
        int,
        10,
        "classes, the model's outputs: every label must lie in 0 .. num_classes - 1 (digits, mnist, "
        "fashion-mnist, cifar10: 10 or 0); 0: the data set's own (npz/hdf5: inferred from the labels; "
        "synthetic: 10)",
        minimum=2,
        also=(0,),
    ),
    "data.train_size": Key(int, 8192, "synthetic: training samples", minimum=1),
    "data.test_size": Key(int, 1024, "synthetic: test samples", minimum=1),
    "train.epochs": Key(int, 10, "epochs to train (ignored when train.steps > 0)", minimum=1),
    "train.steps": Key(int, 0, "total steps; 0: train.epochs epochs", minimum=0),
    "train.stop_at": Key(
        int, 0, "stop gracefully after this step (checkpoint, exit 0), as a signal would; 0: never", minimum=0
    ),
    "train.eval_every": Key(int, 0, "steps between test evaluations; 0: at the end of each epoch", minimum=0),
    "train.log_every": Key(int, 20, "steps between progress lines (batch jobs)", minimum=1),
    "train.log_every_s": Key(
        float,
        30.0,
        "progress lines (batch jobs) also by time: a line at the first step (or meeting) after this many "
        "seconds without one, however few steps passed (virtual seconds in the simulator); 0: by steps only",
        minimum=0.0,
    ),
    "parallel.strategy": Key(
        str,
        "sync",
        f"how training is spread over the ranks: a built-in strategy ({', '.join(STRATEGIES)}), one an "
        "installed package registers (entry points hpcdl.strategies) or module:Class of your own",
    ),
    "profile.layers": Key(bool, False, "record per-layer forward/backward times and output sizes"),
    "checkpoint.every": Key(int, 200, "steps between checkpoints (0: only at the end or a stop)", minimum=0),
    "checkpoint.keep": Key(int, 2, "checkpoints kept beside the run file (the newest)", minimum=1),
    "log.flush_every": Key(
        int, 10, "steps between writes of the run file (a crash loses at most these)", minimum=1
    ),
    "log.trace": Key(
        bool,
        False,
        "record timeline events in the run file's trace/ (sync: each bucket's pack, the wait for the "
        "allreduces, the unpack), for python -m hpcdl.report --trace",
    ),
    "debug.stall_s": Key(
        float,
        600.0,
        "stall watchdog under MPI: seconds a rank may wait in one communication before the job "
        "is aborted with a report (0: off)",
        minimum=0.0,
    ),
    "debug.slowdown": Key(
        list,
        [],
        "world ranks that take FACTOR times their compute time (a sleep after each layer), to "
        "study heterogeneous ranks under mpiexec as the simulator's --straggler does",
        item=str,
        pattern=r"\d+:\d+(\.\d*)?",
        pattern_doc='"RANK:FACTOR" (FACTOR >= 1)',
    ),
}


#: the driver's keys that fix a run's trajectory: a resume with another value is refused
DRIVER_FIT_KEYS = (
    "seed", "dtype", "model.name", "model.depth", "model.width", "model.width_mult", "model.channels",
    "model.winograd", "model.winograd_layers",
    "data.name", "data.path", "data.batch_size", "data.sampler", "data.shape", "data.num_classes",
    "data.train_size", "data.test_size", "parallel.strategy",
)  # fmt: skip

_HEAD = ("", "model", "data", "train")  # the driver's sections shown before the components'


@functools.cache
def schema(strategy: str = "") -> dict[str, Key]:
    """Every key a config may set, by dotted name: the driver's and every registered component's,
    and, when ``strategy`` is an outside ``module:Class``, its own (docs/config.md's table: the registered).

    Raises:
        ConfigError: ``strategy`` names a module that cannot be imported.
    """
    head = {k: v for k, v in DRIVER_KEYS.items() if k.rpartition(".")[0] in _HEAD}
    tail = {k: v for k, v in DRIVER_KEYS.items() if k not in head}
    keys = all_declared(strategy).keys
    first = load(SHARED[0]).keys  # the optimizer's: then the strategy's choice, their sections, the rest
    chosen = {k: tail.pop(k) for k in ("parallel.strategy",)}
    shared = {k: v for t in SHARED[1:] for k, v in load(t).keys.items()}
    strategies = {k: v for k, v in keys.items() if k not in first and k not in shared}
    return {**head, **first, **chosen, **strategies, **shared, **tail}


def _renamed(strategy: str = "") -> dict[str, str]:
    return dict(all_declared(strategy).renamed)


def __getattr__(name: str) -> Any:
    if name == "SCHEMA":  # every registered component's keys and the driver's (docs/config.md's table),
        return schema()  # collected on first use: an installed strategy may import this module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _nearest(key: str, keys: dict[str, Key]) -> str:
    close = difflib.get_close_matches(key, keys, n=1, cutoff=0.0)
    best = close[0] if close else "name"
    return f"{best!r} ({_type_name(keys[best].type)})"


def _check(key: str, value: Any, keys: dict[str, Key]) -> Any:
    """Validate one value against the schema ``keys`` and return it normalised."""
    spec = keys.get(key)
    if spec is None:
        raise ConfigError(f"unknown config key {key!r}; nearest valid key: {_nearest(key, keys)}")
    t = spec.type
    if spec.or_list and isinstance(value, list):
        ok = all(isinstance(v, spec.item) and not isinstance(v, bool) and v > 0 for v in value)  # type: ignore[arg-type]
        if not ok or not value:
            raise ConfigError(
                f"config key {key!r} expects one of {', '.join(map(repr, spec.choices))} or a non-empty "
                f"list of positive {spec.item.__name__}s (got {value!r})"  # type: ignore[union-attr]
            )
        return value
    if t is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, t) or (t is int and isinstance(value, bool)):
        raise ConfigError(
            f"config key {key!r} expects {_type_name(t)}, got {type(value).__name__} {value!r} "
            f"(nearest valid key: {_nearest(key, keys)})"
        )
    if t is float and not math.isfinite(value):
        raise ConfigError(f"config key {key!r} expects a finite float (got {value!r})")
    if spec.choices and value not in spec.choices:
        alt = f" or a list of positive {spec.item.__name__}s" if spec.or_list and spec.item else ""
        raise ConfigError(
            f"config key {key!r} must be one of {', '.join(map(repr, spec.choices))}{alt} (got {value!r})"
        )
    also = "".join(f", or {v!r}" for v in spec.also)
    for bound, broken, text in ((spec.minimum, operator.lt, ">="), (spec.above, operator.le, ">"),
                                (spec.below, operator.ge, "<")):  # fmt: skip
        if bound is not None and broken(value, bound) and value not in spec.also:
            raise ConfigError(f"config key {key!r} must be {text} {bound}{also} (got {value!r})")
    if spec.item is str:
        bad = [v for v in value if not isinstance(v, str) or not re.fullmatch(spec.pattern, v)]
        if bad:
            raise ConfigError(f"config key {key!r} expects strings {spec.pattern_doc} (got {bad[0]!r})")
    elif spec.item is not None and not spec.or_list:
        ok = all(isinstance(v, spec.item) and not isinstance(v, bool) and v > 0 for v in value)
        if not ok or (not value and spec.default):  # empty only where it is the default
            raise ConfigError(
                f"config key {key!r} expects a non-empty list of positive "
                f"{spec.item.__name__}s (got {value!r})"
            )
    return value


def _flatten(table: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``: a TOML table's values by dotted key."""
    flat: dict[str, Any] = {}
    for k, v in table.items():
        if isinstance(v, dict):
            flat.update(_flatten(v, f"{prefix}{k}."))
        else:
            flat[prefix + k] = v
    return flat


def stored_values(text: str) -> dict[str, Any]:
    """The values of a config as TOML text (a run file's ``config``), by dotted key, unchecked.

    A config stored by an older hpcdl may hold keys or values this one refuses; they are
    returned as they are, for comparison, under their names now (``parallel.mode`` is
    ``ps.mode``).

    Raises:
        ConfigError: the text is not valid TOML.
    """
    try:
        values = _flatten(tomllib.loads(text))
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"a stored config is not valid TOML: {err}") from None
    renamed = _renamed(str(values.get("parallel.strategy", "")))
    return {renamed.get(k, k): v for k, v in values.items()}  # old names: a file of an older hpcdl


def legacy_values(stored: Mapping[str, Any]) -> dict[str, Any]:
    """The keys a stored config lacks because it predates them, at the value its run behaved as
    (:attr:`Key.legacy <hpcdl.components.Key>`): ``{"exchange.int32_scale": "max"}`` for a run
    file written before that key existed.

    Args:
        stored: a stored config's values (:func:`stored_values`).
    """
    strategy = str(stored.get("parallel.strategy", ""))
    keys = schema(strategy if ":" in strategy else "")
    return {k: spec.legacy for k, spec in keys.items() if spec.legacy is not None and k not in stored}


def add_set_argument(parser: Any, help_prefix: str = "") -> None:
    """The ``--set KEY=VALUE`` option every command taking a config has (repeatable)."""
    parser.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"{help_prefix}override a config key; the value is read as TOML (repeatable; default: none)",
    )


def parse_set(item: str) -> tuple[str, Any]:
    """Parse one ``--set key=value``; the value is read as a TOML value.

    A bare word that is not valid TOML (``--set model.name=cnn``) is taken as a string.
    """
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"--set expects key=value (got {item!r}), e.g. --set optimizer.lr=0.05")
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text.strip()
    return key, value


def preset_names() -> list[str]:
    """Names of the presets shipped in ``hpcdl/presets``."""
    return sorted(p.name[:-5] for p in resources.files("hpcdl.presets").iterdir() if p.name.endswith(".toml"))


class Config:
    """A validated config: every key of its :func:`schema`, defaults filled in.

    Read values with ``cfg["optimizer.lr"]``; ``cfg.toml()`` gives the full
    config back as TOML text (stored in run files). A key given under an old name
    (:attr:`Declares.renamed <hpcdl.components.Declares>`) is read under its name now, and
    :attr:`notes` says so in one line each (the commands print them once).

    Raises:
        ConfigError: a key is unknown, of the wrong type or out of range; ``parallel.strategy``
            names a ``module:Class`` that cannot be imported.
    """

    def __init__(self, values: dict[str, Any] | None = None) -> None:
        given = dict(values or {})
        strategy = str(given.get("parallel.strategy", ""))
        renamed = _renamed(strategy)
        #: one line per key given under an old name
        self.notes: list[str] = []
        for old in [k for k in given if k in renamed]:
            new = renamed[old]
            if new in given:
                raise ConfigError(f"{old} and {new} are both set: {old} is {new}'s old name; keep {new}")
            given[new] = given.pop(old)
            self.notes.append(f"{old} is now {new}: read as {new} = {given[new]!r} (rename it in the config)")
        #: the keys this config may hold, by dotted name
        self.schema = schema(strategy if ":" in strategy else "")
        self.values: dict[str, Any] = {k: spec.default for k, spec in self.schema.items()}
        for k, v in given.items():
            self.values[k] = _check(k, v, self.schema)

    def __getitem__(self, key: str) -> Any:
        return self.values[key]

    def is_set(self, key: str) -> bool:
        """True when ``key`` differs from its default."""
        return bool(self.values[key] != self.schema[key].default)

    def changed(self) -> list[str]:
        """The keys that differ from their defaults, in the schema's order."""
        return [k for k in self.schema if self.is_set(k)]

    def with_updates(self, updates: dict[str, Any]) -> Config:
        """A new config with ``updates`` (dotted keys, old names read as new) applied and checked;
        another ``parallel.strategy`` drops the keys of an outside strategy it no longer names."""
        strategy = str(updates.get("parallel.strategy", self.values.get("parallel.strategy", "")))
        renamed = _renamed(strategy)
        updates = {renamed.get(k, k): v for k, v in updates.items()}
        keys = schema(strategy if ":" in strategy else "")
        cfg = Config({**{k: v for k, v in self.values.items() if k in keys}, **updates})
        cfg.notes = [*self.notes, *cfg.notes]
        return cfg

    def toml(self) -> str:
        """The whole config as TOML text, one table per section."""
        sections: dict[str, list[str]] = {}
        for key, value in self.values.items():
            section, _, leaf = key.rpartition(".")
            sections.setdefault(section, []).append(f"{leaf} = {_toml_value(value)}")
        lines = sections.pop("", [])
        for section, body in sections.items():
            lines += ["", f"[{section}]", *body]
        return "\n".join(lines) + "\n"


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return repr(v)


def load_config(source: str, sets: list[str] | tuple[str, ...] = ()) -> Config:
    """Load a preset name or a TOML file, then apply ``--set key=value`` items.

    Raises:
        ConfigError: the file or preset does not exist, is not valid TOML, or a
            key is unknown, of the wrong type or out of range.
    """
    path = Path(source)
    if source in preset_names():
        text = resources.files("hpcdl.presets").joinpath(f"{source}.toml").read_text()
        origin, default_name = f"preset {source!r}", source
    elif path.is_file():
        text, origin, default_name = path.read_text(), str(path), path.stem
    else:
        raise ConfigError(
            f"--config {source!r} is neither a file nor a preset; presets: {', '.join(preset_names())}"
        )
    try:
        table = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{origin} is not valid TOML: {err}") from None
    values = _flatten(table)
    for item in sets:
        key, value = parse_set(item)
        values[key] = value
    if not values.get("name"):
        values["name"] = default_name
    return Config(values)


def markdown_table() -> str:
    """The table of config keys of docs/config.md (``python -m hpcdl.config`` prints it)."""
    rows = ["| key | type | default | allowed | meaning |", "|---|---|---|---|---|"]
    for key, spec in schema().items():
        rows.append(
            f"| `{key}` | {spec.type_name} | `{_toml_value(spec.default)}` | {spec.bounds() or 'any'} "
            f"| {spec.doc} |"
        )
    return "\n".join(rows)


def build_parser() -> ArgumentParser:
    """The command line of ``python -m hpcdl.config``."""
    from hpcdl.driver.cli import ArgumentParser  # the command's plumbing, not the schema's

    parser = ArgumentParser(
        prog="python -m hpcdl.config",
        description=(
            "Print the table of config keys (type, default, allowed values, meaning) as in "
            "docs/config.md, or with --config the whole resolved config as TOML."
        ),
    )
    parser.add_argument(
        "--config",
        default=None,
        metavar="PRESET|FILE",
        help="print this config (a preset name or a TOML file) with defaults and --set applied, "
        "as TOML, instead of the table (default: none, print the table)",
    )
    add_set_argument(parser, "with --config: ")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``python -m hpcdl.config`` with ``argv`` (without the program name); returns 0.

    Raises:
        ConfigError: an unknown option, ``--set`` without ``--config``, or a bad config.
        HelpRequested: ``--help`` was answered.
    """
    from hpcdl.driver.cli import parse_args

    parser = build_parser()
    args = parse_args(parser, list(argv or []))
    if args.config is None:
        if args.sets:
            raise ConfigError(
                f"--set {args.sets[0]} needs --config: the preset or file to apply it to "
                f"(see {parser.prog} --help)"
            )
        print(markdown_table())
    else:
        print(load_config(args.config, args.sets).toml(), end="")
    return 0


if __name__ == "__main__":
    from hpcdl.driver.cli import entry

    entry(main, "hpcdl.config")
