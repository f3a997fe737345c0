"""Run files and checkpoints of format 1, whose ps keys were ``parallel.servers``, ``parallel.mode``,
...: a config with the old names is read under the new ones with one line each, and such a run
is continued (the file becomes format 2, its row table learns the column a resume cuts by)."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import h5py
import pytest

from hpcdl.config import Config, load_config
from hpcdl.errors import ConfigError
from hpcdl.simulate import main as simulate
from hpcdl.store.checkpoint import list_checkpoints

SIM = ["-n", "3", "--network", "ib-hdr", "--compute", "none", "-m", "hpcdl.train", "--config", "digits-mlp",
       "--progress", "none"]  # fmt: skip
OLD = ["--set", 'parallel.strategy="ps"', "--set", 'parallel.mode="sync"', "--set", "train.steps=12",
       "--set", "checkpoint.every=8", "--set", "model.width=32"]  # fmt: skip


def test_an_old_name_is_read_under_the_new_one_with_one_line() -> None:
    cfg = load_config("digits-mlp", ['parallel.mode="ssp"', "parallel.staleness=3"])
    assert cfg["ps.mode"] == "ssp" and cfg["ps.staleness"] == 3
    assert cfg.notes == [
        "parallel.mode is now ps.mode: read as ps.mode = 'ssp' (rename it in the config)",
        "parallel.staleness is now ps.staleness: read as ps.staleness = 3 (rename it in the config)",
    ]
    with pytest.raises(ConfigError, match="parallel.mode and ps.mode are both set"):
        Config({"parallel.mode": "ssp", "ps.mode": "sync"})


def _as_format_1(run: Path) -> None:
    """What the run file and its checkpoints held before format 2: old key names, no cut column."""
    with h5py.File(run, "r+") as f:
        table = tomllib.loads(f.attrs["config"])
        ps = table.pop("ps")
        table["parallel"].update(ps)
        lines = [f"{k} = {json.dumps(v)}" for k, v in table.items() if not isinstance(v, dict)]
        for section, body in table.items():
            if isinstance(body, dict):
                lines += ["", f"[{section}]", *(f"{k} = {json.dumps(v)}" for k, v in body.items())]
        f.attrs["config"] = "\n".join(lines) + "\n"
        f.attrs["format_version"] = 1
        del f["staleness"].attrs["cut_by"]
    for ckpt in list_checkpoints(run):
        with h5py.File(ckpt, "r+") as f:
            meta = json.loads(f.attrs["meta"])
            meta["fit"] = {k.replace("ps.", "parallel."): v for k, v in meta["fit"].items()}
            f.attrs["meta"] = json.dumps(meta)


def test_a_run_of_format_1_with_the_old_names_is_continued(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "old.h5"
    assert simulate([*SIM, *OLD, "--set", "train.stop_at=8", "--out", str(run)]) == 0
    assert "parallel.mode is now ps.mode" in capfd.readouterr().err
    _as_format_1(run)
    with h5py.File(run, "r") as f:
        assert "ps.mode" not in f.attrs["config"] and 'mode = "sync"' in f.attrs["config"]
    # the same settings (the stop at 8 is behind it): nothing recorded as changed, the config rewritten
    assert simulate([*SIM, *OLD, "--set", "train.stop_at=8", "--out", str(run), "--resume", "auto"]) == 0
    with h5py.File(run, "r") as f:
        assert f.attrs["format_version"] == 2 and f.attrs["status"] == "finished"
        assert json.loads(f.attrs["config_changes"]) == []
        assert tomllib.loads(f.attrs["config"])["ps"]["mode"] == "sync"  # today's names
        assert f["staleness"].attrs["cut_by"] == "update"
        assert list(f["metrics/step"][...]) == list(range(1, 13))
    # another value of an old-named fit key is refused, as under the new name
    other = [*SIM, *OLD[:2], "--set", 'parallel.mode="async"', *OLD[4:], "--set", "train.steps=16"]
    assert simulate([*other, "--out", str(run), "--resume", "auto"]) == 2
    assert "ps.mode = 'sync'" in capfd.readouterr().err
