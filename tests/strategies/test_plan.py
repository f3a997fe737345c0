"""The conformance suite, serial part: a strategy's ``plan`` is pure, and ``--plan -n N`` prints
a placement or refuses in one line, for every registered strategy and the toy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hpcdl.errors import HpcdlError
from hpcdl.parallel.conformance import Case
from hpcdl.train import main as train_command

from .suite import PLAN_SIZES, cases, names, sets, short

TESTS = Path(__file__).resolve().parents[1]

#: run in a fresh interpreter: every case's plan at every size, twice, with an audit hook
#: recording what the calls open, change on disk, launch or connect to, and whether MPI is loaded
_PURE = r"""
import json, sys
from hpcdl.errors import HpcdlError
from hpcdl.parallel import strategy_class
from strategies.suite import PLAN_SIZES, config, conformance, names
from hpcdl.parallel.conformance import Case

WATCHED = ("open", "os.", "shutil.", "socket.", "subprocess.", "ctypes.dlopen", "import")
armed, seen = False, []

def hook(event, args):
    if armed and event.startswith(WATCHED):
        if event == "import" and not str(args[0]).startswith("mpi4py"):
            return
        seen.append(f"{event} {args[0]!r}"[:200])

def plan(cls, cfg, n):
    try:
        return repr(cls.plan(cfg, n))
    except HpcdlError as err:
        return f"refused: {err}"

sys.addaudithook(hook)
out = {}
loaded = "mpi4py.MPI" in sys.modules  # by importing hpcdl and the strategies
for name in names():
    cls, conf = strategy_class(name), conformance(name)
    for case_name, case in (conf.cases if conf else {"default": Case()}).items():
        cfg = config(name, case)
        for n in PLAN_SIZES:
            plan(cls, cfg, n)  # anything imported lazily is imported here, unwatched
            armed = True
            first, second = plan(cls, cfg, n), plan(cls, cfg, n)
            armed = False
            mpi = "mpi4py.MPI" in sys.modules
            out[f"{name}|{case_name}|{n}"] = {"same": first == second, "seen": seen[:], "plan": first[:120],
                                              "mpi": mpi and not loaded}
            loaded = loaded or mpi
            seen.clear()
by_import = "mpi4py.MPI" in sys.modules and not any(p["mpi"] for p in out.values())
print(json.dumps({"plans": out, "mpi": by_import}))
"""


@pytest.fixture(scope="module")
def pure_plans() -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-c", _PURE], capture_output=True, text=True, env=env, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize("name", names(), ids=short)
def test_plan_is_pure(name: str, pure_plans: dict[str, Any]) -> None:
    """Twice the same placement (or the same refusal), nothing opened, changed on disk, launched or
    connected to while planning, and MPI never loaded, for every case at every size."""
    mine = {k: v for k, v in pure_plans["plans"].items() if k.split("|")[0] == name}
    assert len(mine) >= len(PLAN_SIZES)
    for key, got in mine.items():
        assert got["same"], f"{key}: two calls planned differently"
        assert not got["seen"], f"{key}: planning did {got['seen']}"
        assert not got["mpi"], f"{key}: planning loaded mpi4py.MPI"
    assert any(not got["plan"].startswith("refused") for got in mine.values()), "no size fits at all"
    assert not pure_plans["mpi"], "importing hpcdl's strategies loaded mpi4py.MPI"


@pytest.mark.parametrize(("name", "case_name", "case"), cases())
def test_plan_prints_or_refuses_in_one_line(
    name: str, case_name: str, case: Case, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [a for s in sets(name, case) for a in ("--set", s)]
    printed = 0
    for n in PLAN_SIZES:
        try:
            code = train_command(["--config", "digits-mlp", *argv, "--plan", "-n", str(n)])
        except HpcdlError as err:
            said = str(err)
            assert err.exit_status == 2 and said and "\n" not in said, f"-n {n}: {said!r}"
            assert capsys.readouterr().out == "", f"-n {n}: printed before refusing"
            continue
        out = capsys.readouterr().out.splitlines()
        assert code == 0 and out, f"-n {n}"
        plural = "s" * (n > 1)
        assert out[0].startswith(f"strategy {short(name)} on {n} rank{plural}:"), out[0]
        printed += 1
    assert printed, "--plan refused every size"
