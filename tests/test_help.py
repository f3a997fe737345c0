"""Every command's ``--help`` (each ``bench`` subcommand too) is help a new user can read.

A one-line description, help for every option with its default, and none of the
developer markup that docstrings carry (``double backquotes``, ``run(args) -> rows``).
"""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys

import pytest

from hpcdl.driver.cli import HelpFormatter

#: command module -> how to build its parser
COMMANDS = ["hpcdl.train", "hpcdl.report", "hpcdl.simulate", "hpcdl.bench"]
if callable(getattr(importlib.import_module("hpcdl.config"), "build_parser", None)):
    COMMANDS.append("hpcdl.config")  # python -m hpcdl.config has a parser of its own
MARKUP = ("``", "`", "->", ":func:", ":class:", "TODO", "XXX")


def _parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    """(name, parser) of every command and of every bench subcommand."""
    out = []
    for name in COMMANDS:
        parser = importlib.import_module(name).build_parser()
        out.append((name, parser))
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                out.extend((f"{name} {sub}", p) for sub, p in action.choices.items())
    return out


PARSERS = _parsers()


def test_every_bench_subcommand_is_walked() -> None:
    from hpcdl.bench import SUBCOMMANDS

    names = {name for name, _ in PARSERS}
    assert {f"hpcdl.bench {sub}" for sub in SUBCOMMANDS} <= names
    assert {"hpcdl.train", "hpcdl.report", "hpcdl.simulate"} <= names


@pytest.mark.parametrize("name,parser", PARSERS, ids=[n for n, _ in PARSERS])
def test_help_has_a_description_and_every_option_its_help_and_default(
    name: str, parser: argparse.ArgumentParser
) -> None:
    description = parser.description or ""
    assert description.strip(), f"{name}: no description"
    assert "\n" not in description.strip(), f"{name}: the description is not one line: {description!r}"
    assert parser.formatter_class is HelpFormatter or issubclass(parser.formatter_class, HelpFormatter)
    formatter = parser._get_formatter()
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        label = "/".join(action.option_strings) or action.dest
        assert action.help and action.help is not argparse.SUPPRESS, f"{name} {label}: no help"
        shown = formatter._expand_help(action)
        flag = action.nargs == 0  # store_true and friends: absent means off
        if action.option_strings and not action.required and not flag:
            assert "default: " in shown, f"{name} {label}: the default is not shown: {shown!r}"
    text = parser.format_help()
    for mark in MARKUP:
        assert mark not in text, f"{name}: {mark!r} in --help:\n{text}"
    assert "None" not in text.replace("none", ""), f"{name}: a default shown as None:\n{text}"


def test_defaults_are_shown_as_typed() -> None:
    parser = argparse.ArgumentParser(prog="x", formatter_class=HelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=[8, 64], help="message sizes")
    parser.add_argument("--rate", default=0.5, help="a fraction; 50%% by default")
    parser.add_argument("--out", default=None, help="where (default: not written)")
    parser.add_argument("--flag", action="store_true", help="a flag")
    text = " ".join(parser.format_help().split())
    assert "message sizes (default: 8 64)" in text
    assert "a fraction; 50% by default (default: 0.5)" in text
    assert "where (default: not written)" in text and "(default: not written) (default" not in text
    assert "a flag (default" not in text


@pytest.mark.parametrize(
    "argv",
    [
        ["hpcdl.train"],
        ["hpcdl.report"],
        ["hpcdl.simulate"],
        ["hpcdl.bench"],
        ["hpcdl.bench", "step"],
        ["hpcdl.bench", "train"],
        ["hpcdl.bench", "pack"],
        ["hpcdl.bench", "allreduce"],
        ["hpcdl.bench", "calibrate"],
    ],
    ids=" ".join,
)
def test_help_runs_as_a_command(argv: list[str]) -> None:
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "COLUMNS": "100"}
    done = subprocess.run(
        [sys.executable, "-m", *argv, "--help"],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: python -m {' '.join(argv)}")
    assert done.stderr == ""
    for mark in MARKUP:
        assert mark not in done.stdout
