"""Every bad config value, through the real command: one line naming the key, exit status 2.

The sweep runs ``python -m hpcdl.train``'s entry point in-process (argument parsing, config
loading, the data set and the model built from it, exactly as ``__main__`` does, minus the
signal handlers), so that some 150 cases cost well under a second; two cases also run as
real subprocesses.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hpcdl import train
from hpcdl.config import SCHEMA, Key, _toml_value, load_config
from hpcdl.driver.cli import entry
from hpcdl.driver.factory import load_data

#: a value of another type for each key type (TOML text); ints are accepted for floats
WRONG_TYPE = {str: "7", int: "2.5", float: '"fast"', bool: "1", list: "3"}


def _outside(spec: Key) -> list[Any]:
    """Values just outside the key's allowed range (none for an unbounded key)."""
    if spec.choices:
        return [f"{spec.choices[0]}x"]
    if spec.item is not None:
        return [[*spec.default[:-1], 0]]
    step = 1 if spec.type is int else None
    values: list[Any] = []
    if spec.minimum is not None:
        values.append(spec.minimum - step if step else math.nextafter(spec.minimum, -math.inf))
    if spec.above is not None:
        values.append(spec.above)
    if spec.below is not None:
        values.append(spec.below)
    if spec.also:  # allowed besides the range: the values next to them are not
        values += [min(spec.also) - 1, *(v + 1 for v in spec.also)]
    return [v for v in dict.fromkeys(values) if v not in spec.also and not _allowed(spec, v)]


def _allowed(spec: Key, v: Any) -> bool:
    return (
        (spec.minimum is None or v >= spec.minimum)
        and (spec.above is None or v > spec.above)
        and (spec.below is None or v < spec.below)
    )


def _cases() -> list[Any]:
    cases = []
    for key, spec in SCHEMA.items():
        cases.append(pytest.param(key, WRONG_TYPE[spec.type], id=f"{key}:type"))
        for v in _outside(spec):
            text = _toml_value(v)
            cases.append(pytest.param(key, text, id=f"{key}:{text}"))
        if spec.type is float:
            cases += [pytest.param(key, v, id=f"{key}:{v}") for v in ("nan", "inf", "-inf")]
    return cases


CASES = _cases()


def run_train(argv: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch):
    """``python -m hpcdl.train ARGV`` in-process: (exit status, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", ["hpcdl.train", *argv])
    with pytest.raises(SystemExit) as info:
        entry(train.main, "hpcdl.train")
    out, err = capsys.readouterr()
    return info.value.code, out, err


def test_sweep_covers_every_key_and_bound() -> None:
    keys = {c.values[0] for c in CASES}
    assert keys == set(SCHEMA)
    bounded = [
        k for k, s in SCHEMA.items() if s.choices or s.item or s.minimum is not None or s.above is not None
    ]
    assert all(len([c for c in CASES if c.values[0] == k]) >= 2 for k in bounded)
    assert {"model.width_mult:0.0", "data.num_classes:1", "debug.stall_s:-5e-324"} <= {c.id for c in CASES}


@pytest.mark.parametrize(("key", "value"), CASES)
def test_bad_value_is_one_line_naming_the_key(key, value, capsys, monkeypatch, tmp_path) -> None:
    monkeypatch.chdir(tmp_path)  # nothing may be written, but if it were, not into the checkout
    code, out, err = run_train(["--config", "digits-mlp", "--set", f"{key}={value}"], capsys, monkeypatch)
    lines = err.splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("hpcdl.train: error: "), err
    assert key in lines[0]
    assert not list(tmp_path.iterdir())


def _labels_file(path: Path, y_train: np.ndarray, y_test: np.ndarray) -> str:
    x = np.zeros((len(y_train), 1, 4, 4), np.uint8)
    np.savez(path, x_train=x, y_train=y_train, x_test=x[: len(y_test)], y_test=y_test)
    return str(path)


#: values that pass the schema's type and range checks but cannot be built (or were silently
#: wrong): (config, --set items, fragments of the one line)
BUILD_CASES = {
    "width_mult 0": ("digits-cnn", ["model.width_mult=0.0"], ["model.width_mult", "> 0.0", "got 0.0"]),
    "adam eps 0": ("digits-mlp", ["optimizer.name=adam", "optimizer.eps=0.0"], ["optimizer.eps", "> 0"]),
    "step every 0 epochs": ("digits-mlp", ["schedule.step_epochs=0.0"], ["schedule.step_epochs", "> 0"]),
    "gamma 0": ("digits-mlp", ["schedule.gamma=0"], ["schedule.gamma", "> 0"]),
    "digits has 10 classes": (
        "digits-mlp",
        ["data.num_classes=5"],
        ["digits.npz", "labels 0..9", "expected 0..4", "data.num_classes = 10"],
    ),
    "cnn on 1x1 images": (
        "digits-cnn",
        ["data.name=synthetic", "data.shape=[1, 1, 1]"],
        ["model.name = 'cnn'", "at least 2x2", "1x1"],
    ),
    "model too large": (
        "digits-mlp",
        ["model.width=1000000000000"],
        ["model.width = 1000000000000", "memory"],
    ),
    "data too large": (
        "digits-mlp",
        ["data.name=synthetic", "data.train_size=100000000000"],
        ["data.train_size = 100000000000", "memory"],
    ),
    "cosine rises": ("digits-mlp", ["schedule.min_lr=1.0"], ["schedule.min_lr = 1.0", "peak", "0.05"]),
    "nesterov without momentum": (
        "digits-mlp",
        ["optimizer.nesterov=true", "optimizer.momentum=0"],
        ["optimizer.nesterov", "optimizer.momentum"],
    ),
    "vgg16 on flat samples": (
        "digits-cnn",
        ["model.name=vgg16", "data.name=synthetic", "data.shape=[64]"],
        ["model.name = 'vgg16'", "(C, H, W)"],
    ),  # fmt: skip
}


@pytest.mark.parametrize("case", list(BUILD_CASES))
def test_value_that_breaks_a_builder_is_one_line(case, capsys, monkeypatch, tmp_path) -> None:
    monkeypatch.chdir(tmp_path)
    config, sets, fragments = BUILD_CASES[case]
    argv = ["--config", config, "--progress", "none"] + [a for s in sets for a in ("--set", s)]
    code, out, err = run_train(argv, capsys, monkeypatch)
    lines = err.splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("hpcdl.train: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert not list(tmp_path.iterdir())  # refused before the run file is created


LABEL_CASES = {
    # the case: labels 5..14 trained a 15-class model without a word
    "5..14, default count": (np.arange(40) % 10 + 5, [], ["y_train has labels 5..14", "expected 0..9",
                                                         "data.num_classes = 15"]),
    "5..14, inferred": (np.arange(40) % 10 + 5, ["data.num_classes=0"], ["labels run 5..14", "0..14",
                                                                       "0..4 never occur"]),
    "negative": (np.arange(40) % 10 - 1, [], ["y_train has labels -1..8", "expected 0..9"]),
    "float": ((np.arange(40) % 10).astype(np.float32), [], ["float32 labels", "values 0..9",
                                                           "expected integer"]),
    "above a given count": (np.arange(40) % 10, ["data.num_classes=4"], ["labels 0..9", "expected 0..3"]),
}  # fmt: skip


@pytest.mark.parametrize("case", list(LABEL_CASES))
def test_labels_outside_the_classes_name_file_and_ranges(case, capsys, monkeypatch, tmp_path) -> None:
    monkeypatch.chdir(tmp_path)
    y, sets, fragments = LABEL_CASES[case]
    f = _labels_file(tmp_path / "d.npz", y, y[:8])
    argv = ["--config", "digits-mlp", "--set", "data.name=npz", "--set", f"data.path={f!r}"]
    code, out, err = run_train(argv + [a for s in sets for a in ("--set", s)], capsys, monkeypatch)
    lines = err.splitlines()
    assert code == 2 and len(lines) == 1, err
    assert str(f) in lines[0]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_labels_fitting_a_given_or_inferred_count_train(capsys, monkeypatch, tmp_path) -> None:
    monkeypatch.chdir(tmp_path)
    f = _labels_file(tmp_path / "d.npz", np.arange(40) % 10 + 5, np.arange(8) + 5)
    g = _labels_file(tmp_path / "e.npz", np.arange(40) % 4, np.arange(8) % 4)
    for path, count, outputs in ((f, 15, 15), (g, 0, 4)):
        sets = ["train.steps=2", "data.name=npz", f"data.path={path!r}", f"data.num_classes={count}"]
        argv = ["--config", "digits-mlp", "--progress", "none", "--out", f"{path}.h5"]
        code, out, err = run_train(argv + [a for s in sets for a in ("--set", s)], capsys, monkeypatch)
        assert code == 0, err
        assert load_data(load_config("digits-mlp", sets)).num_classes == outputs


def test_through_python_m(tmp_path) -> None:
    """The same errors from the installed command itself (``__main__``, with its signal handlers)."""
    f = _labels_file(tmp_path / "d.npz", np.arange(40) % 10 + 5, np.arange(8) + 5)
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    commands = {
        "model.width_mult": ["--config", "digits-cnn", "--set", "model.width_mult=0.0"],
        str(f): ["--config", "digits-mlp", "--set", "data.name=npz", "--set", f"data.path={str(f)!r}"],
    }
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "hpcdl.train", *argv],
            cwd=tmp_path,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )  # fmt: skip
        for name, argv in commands.items()
    }
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 2, err
        assert len(err.splitlines()) == 1 and name in err and err.startswith("hpcdl.train: error: "), err
