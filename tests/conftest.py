"""Shared fixtures: ``comm`` is the current world communicator (MPI's, or a world of one);
``figures`` the figures the report saves, by figure name."""

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
    """The figures the report saves, by figure name (``gantt``, ``stages``, ...)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    saved: dict = {}
    original = Figure.savefig

    def savefig(self, fname, *args, **kwargs):  # noqa: ANN001, ANN202
        name = Path(getattr(fname, "name", str(fname))).name  # a temporary .<prefix>-<figure>.png...
        saved[name.split(".png")[0].rsplit("-", 1)[-1]] = self
        return original(self, fname, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return saved
