"""Config loading: presets, files, --set parsing, and the one-line errors."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from hpcdl.config import SCHEMA, Config, build_parser, load_config, markdown_table, parse_set, preset_names
from hpcdl.config import main as config_main
from hpcdl.driver.cli import entry
from hpcdl.errors import ConfigError


def test_presets_ship_and_load() -> None:
    names = preset_names()
    for required in ("digits-mlp", "digits-cnn", "mlp32-synthetic"):
        assert required in names
    for name in names:
        cfg = load_config(name)
        assert cfg["name"] == name


def test_file_and_set_override(tmp_path: Path) -> None:
    f = tmp_path / "exp.toml"
    f.write_text("[optimizer]\nlr = 1\n[data]\nbatch_size = 8\n")
    cfg = load_config(str(f), ["data.batch_size=16", "model.name=cnn", "data.shape=[3, 32, 32]"])
    assert cfg["optimizer.lr"] == 1.0 and isinstance(cfg["optimizer.lr"], float)  # int widened to float
    assert cfg["data.batch_size"] == 16
    assert cfg["model.name"] == "cnn"  # a bare word is a string
    assert cfg["data.shape"] == [3, 32, 32]
    assert cfg["name"] == "exp"


@pytest.mark.parametrize(
    ("sets", "fragments"),
    [
        (["optimizer.lrr=0.1"], ["unknown config key 'optimizer.lrr'", "'optimizer.lr'", "a float"]),
        (["data.batch_size=abc"], ["'data.batch_size'", "an integer", "str"]),
        (["data.batch_size=1.5"], ["'data.batch_size'", "an integer", "float"]),
        (["optimizer.nesterov=1"], ["'optimizer.nesterov'", "a boolean"]),
        (["model.name=alexnet"], ["'model.name'", "must be one of", "'mlp'"]),
        (["data.batch_size=0"], ["'data.batch_size'", ">= 1"]),
        (["nokey"], ["--set expects key=value"]),
    ],
)
def test_bad_values_name_key_type_and_nearest(sets: list[str], fragments: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        load_config("digits-mlp", sets)
    msg = str(info.value)
    assert "\n" not in msg
    for frag in fragments:
        assert frag in msg


def test_unknown_key_in_file(tmp_path: Path) -> None:
    f = tmp_path / "bad.toml"
    f.write_text("[train]\nepocs = 3\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'train.epocs'.*'train.epochs'"):
        load_config(str(f))


def test_missing_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="neither a file nor a preset; presets: .*digits-mlp"):
        load_config(str(tmp_path / "none.toml"))
    f = tmp_path / "broken.toml"
    f.write_text("[model\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(str(f))


def test_parse_set_reads_toml_values() -> None:
    assert parse_set("a.b=3") == ("a.b", 3)
    assert parse_set("a.b=3.0") == ("a.b", 3.0)
    assert parse_set("a.b=true") == ("a.b", True)
    assert parse_set('a.b="x y"') == ("a.b", "x y")
    assert parse_set("a.b=word") == ("a.b", "word")


def test_toml_round_trip() -> None:
    cfg = load_config("digits-cnn", ["optimizer.lr=0.125", 'name="a \\"quoted\\" name"'])
    again = Config(_flatten(tomllib.loads(cfg.toml())))
    assert again.values == cfg.values


def _flatten(table: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in table.items():
        out.update(_flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
    return out


def test_defaults_are_valid() -> None:
    Config({k: spec.default for k, spec in SCHEMA.items()})


def test_docs_document_every_key() -> None:
    """docs/config.md's table is generated at build time (docs/hooks.py) from the declared schemas."""
    root = Path(__file__).parents[1]
    spec = importlib.util.spec_from_file_location("docs_hooks", root / "docs" / "hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    page = hooks.config_page((root / "docs" / "config.md").read_text())
    assert markdown_table() in page, "docs/config.md lost its generated table (the marker: docs/hooks.py)"
    for key in SCHEMA:
        assert f"| `{key}` |" in page


# -- bounds: exclusive minimums, values allowed besides the range, finite floats --------------


@pytest.mark.parametrize(
    ("item", "fragment"),
    [
        ("model.width_mult=0.0", "'model.width_mult' must be > 0.0 (got 0.0)"),
        ("optimizer.eps=0", "'optimizer.eps' must be > 0.0 (got 0.0)"),
        ("model.dropout=1.0", "'model.dropout' must be < 1.0 (got 1.0)"),
        ("data.num_classes=1", "'data.num_classes' must be >= 2, or 0 (got 1)"),
        ("data.num_classes=-3", "'data.num_classes' must be >= 2, or 0 (got -3)"),
        ("optimizer.lr=nan", "'optimizer.lr' expects a finite float (got nan)"),
        ("schedule.gamma=inf", "'schedule.gamma' expects a finite float (got inf)"),
        ("debug.stall_s=-1", "'debug.stall_s' must be >= 0.0 (got -1.0)"),
    ],
)
def test_values_out_of_range(item: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config("digits-mlp", [item])
    assert fragment in str(info.value)


def test_values_at_the_edge_of_the_range() -> None:
    cfg = load_config("digits-mlp", ["data.num_classes=0", "model.width_mult=1e-3", "debug.stall_s=0"])
    assert cfg["data.num_classes"] == 0 and cfg["model.width_mult"] == 1e-3 and cfg["debug.stall_s"] == 0.0
    assert load_config("digits-mlp", ["data.num_classes=2"])["data.num_classes"] == 2


def test_stall_watchdog_key() -> None:
    spec = SCHEMA["debug.stall_s"]
    assert (spec.type, spec.default, spec.minimum) == (float, 600.0, 0.0)
    assert "0: off" in spec.doc
    assert load_config("digits-mlp")["debug.stall_s"] == 600.0
    assert load_config("digits-mlp", ["debug.stall_s=30"])["debug.stall_s"] == 30.0  # int widened


def test_bounds_in_words() -> None:
    assert SCHEMA["data.num_classes"].bounds() == ">= 2, or 0"
    assert SCHEMA["model.dropout"].bounds() == ">= 0, < 1"
    assert SCHEMA["model.width_mult"].bounds() == "> 0"
    assert SCHEMA["data.shape"].bounds() == "integers > 0"
    assert SCHEMA["dtype"].bounds() == "float32 / float64"
    assert SCHEMA["name"].bounds() == ""
    assert "| `data.num_classes` | int | `10` | >= 2, or 0 |" in markdown_table()


# -- python -m hpcdl.config ---------------------------------------------------------------------


def _config_command(argv: list[str], capsys, monkeypatch) -> tuple[int, str, str]:
    """``python -m hpcdl.config ARGV`` in-process, through its entry point."""
    monkeypatch.setattr(sys, "argv", ["hpcdl.config", *argv])
    with pytest.raises(SystemExit) as info:
        entry(config_main, "hpcdl.config")
    out, err = capsys.readouterr()
    return info.value.code, out, err


def test_config_command_prints_the_key_table(capsys, monkeypatch) -> None:
    code, out, err = _config_command([], capsys, monkeypatch)
    assert code == 0 and out == markdown_table() + "\n" and err == ""


def test_config_command_prints_a_resolved_config(capsys, monkeypatch) -> None:
    code, out, err = _config_command(
        ["--config", "digits-cnn", "--set", "optimizer.lr=0.5", "--set", "data.num_classes=0"],
        capsys,
        monkeypatch,
    )
    assert code == 0 and err == ""
    cfg = Config(_flatten(tomllib.loads(out)))
    assert cfg.values == load_config("digits-cnn", ["optimizer.lr=0.5", "data.num_classes=0"]).values
    assert cfg["optimizer.lr"] == 0.5 and cfg["model.name"] == "cnn" and cfg["debug.stall_s"] == 600.0


def test_config_command_help(capsys, monkeypatch) -> None:
    code, out, err = _config_command(["--help"], capsys, monkeypatch)
    assert code == 0 and err == ""
    text = " ".join(out.split())
    assert text.startswith("usage: python -m hpcdl.config")
    assert "Print the table of config keys" in text and "| key |" not in text
    options = [a for a in build_parser()._actions if a.dest != "help"]
    assert {o.dest for o in options} == {"config", "sets"}
    for option in options:  # every option: its help, with its default, shown
        assert "default:" in option.help and " ".join(option.help.split()) in text


@pytest.mark.parametrize(
    ("argv", "fragments"),
    [
        (["--bogus"], ["unrecognized arguments: --bogus", "--help"]),
        (["table"], ["unrecognized arguments: table"]),
        (["--set", "optimizer.lr=1"], ["--set optimizer.lr=1 needs --config"]),
        (["--config", "digits-mlp", "--set", "optimizer.lr=-1"], ["'optimizer.lr'", ">= 0"]),
        (["--config", "nope"], ["neither a file nor a preset"]),
    ],
)
def test_config_command_errors_are_one_line(argv, fragments, capsys, monkeypatch) -> None:
    code, out, err = _config_command(argv, capsys, monkeypatch)
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("hpcdl.config: error: "), err
    for fragment in fragments:
        assert fragment in err


def test_config_command_as_python_m() -> None:
    """The real ``python -m hpcdl.config``: an unknown option is an error, not the table."""
    proc = subprocess.run(
        [sys.executable, "-m", "hpcdl.config", "--bogus"],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        "hpcdl.config: error: unrecognized arguments: --bogus (see python -m hpcdl.config --help)"
    ]


def test_a_key_newer_than_a_stored_config_reads_as_its_legacy_value() -> None:
    """exchange.int32_scale came after runs without it: they ran the max rule, new runs get pow2."""
    from hpcdl.config import legacy_values, stored_values
    from hpcdl.driver.checkpoints import check_run_config
    from hpcdl.driver.settle import continue_legacy

    cfg = load_config("digits-mlp", ['exchange.compression="int32"'])
    assert cfg["exchange.int32_scale"] == "pow2" and SCHEMA["exchange.int32_scale"].legacy == "max"
    new = stored_values(cfg.toml())
    old = {k: v for k, v in new.items() if k != "exchange.int32_scale"}  # as a hpcdl before the key wrote it
    assert legacy_values(new) == {} and legacy_values(old) == {"exchange.int32_scale": "max"}
    legacy = {k: spec.legacy for k, spec in SCHEMA.items() if spec.legacy is not None}
    assert legacy == {"exchange.int32_scale": "max", "model.winograd": "rule"}

    resumed, lines = continue_legacy(cfg, old)  # the config leaves the key at its default: the run's rule
    assert resumed["exchange.int32_scale"] == "max" and len(lines) == 1 and "predates" in lines[0]
    assert continue_legacy(cfg, new) == (cfg, []) and continue_legacy(cfg, None) == (cfg, [])
    text = "\n".join(line for line in cfg.toml().splitlines() if not line.startswith("int32_scale"))
    assert check_run_config({"config": text}, resumed, 1) == {}  # no change: the run's own rule


def test_a_fit_key_newer_than_a_checkpoint_is_compared_with_its_legacy_value(monkeypatch) -> None:
    """Were a key with a legacy value a fit key, a checkpoint without it ran with that value."""
    from hpcdl.config import DRIVER_FIT_KEYS
    from hpcdl.driver import checkpoints
    from hpcdl.driver.run import plan
    from hpcdl.store.checkpoint import Checkpoint, CheckpointError

    monkeypatch.setattr(checkpoints, "fit_keys", lambda config: (*DRIVER_FIT_KEYS, "exchange.int32_scale"))
    cfg = load_config("digits-mlp", [])
    placement = plan(cfg, 1)
    fit = {k: cfg[k] for k in DRIVER_FIT_KEYS}  # a checkpoint's fit keys of before the key
    ckpt = Checkpoint(1, 0, cfg.toml(), placement.to_json(), {}, [({}, {})], meta={"fit": fit})
    with pytest.raises(CheckpointError, match="exchange.int32_scale = 'max'; this run has 'pow2'"):
        checkpoints.check_fits(ckpt, cfg, placement)
    checkpoints.check_fits(ckpt, cfg.with_updates({"exchange.int32_scale": "max"}), placement)
