"""Config loading: presets, files, --set parsing, and the one-line errors."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from hpcdl.config import SCHEMA, Config, load_config, markdown_table, parse_set, preset_names
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


def test_readme_documents_every_key() -> None:
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    assert markdown_table() in readme, "README's config table is stale: paste `python -m hpcdl.config`"
