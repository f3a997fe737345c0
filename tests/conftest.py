"""Shared fixtures: ``comm`` is the current world communicator (MPI's, or a world of one);
``figures`` the figures the report saves."""

from __future__ import annotations

from pathlib import Path

import pytest

import hpcdl.comm as hc


@pytest.fixture
def comm() -> hc.Communicator:
    """The current world, ``hpcdl.comm.world()`` (MPI's COMM_WORLD outside the simulator)."""
    return hc.world()


@pytest.fixture
def figures(monkeypatch: pytest.MonkeyPatch) -> dict:
    """The figures the report saves, by file stem (``a+b-staleness``) and by figure name
    (``staleness``: the last run's of that name)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    saved: dict = {}
    original = Figure.savefig

    def savefig(self, fname, *args, **kwargs):  # noqa: ANN001, ANN202
        stem = Path(getattr(fname, "name", str(fname))).name.split(".png")[0].lstrip(".")  # .<stem>.png...
        saved[stem] = saved[stem.rsplit("-", 1)[-1]] = self
        return original(self, fname, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return saved
