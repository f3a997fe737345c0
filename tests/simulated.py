"""Training on N virtual ranks, for the strategy tests (not shipped)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hpcdl.comm import world
from hpcdl.driver.run import train
from hpcdl.sim.compute import make_compute
from hpcdl.sim.engine import simulate
from hpcdl.sim.network import load_network


def sim(
    n: int, config: Any, out: Path | None = None, compute: str = "none", resume: str | None = None
) -> list[Any]:
    """Train ``config`` on ``n`` virtual ranks (eth10g, ``compute`` as ``--compute``); each rank's result."""
    result = simulate(
        n,
        lambda: train(config, world(), out=out, resume=resume),
        network=load_network("eth10g", n),
        compute=make_compute(compute),
    )
    return result.results


def schedule_setting(tmp_path: Path, text: str) -> str:
    """``fault.schedule`` set to ``tmp_path/faults.csv`` holding ``text`` (outages ``rank,start,end``)."""
    f = tmp_path / "faults.csv"
    f.write_text(text)
    return f'fault.schedule="{f}"'
