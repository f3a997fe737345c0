"""Shared fixtures: ``comm`` is the current world communicator (MPI's, or a world of one);
``figures`` the figures the report saves."""

from __future__ import annotations

from pathlib import Path

import pytest

import hpcdl.comm as hc


@pytest.fixture(autouse=True, scope="session")
def _auto_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """``auto``'s calibration cache (``$XDG_CACHE_HOME/hpcdl``) in a directory of the session's:
    runs calibrate as a user's first run does, and the user's own cache is left alone."""
    import os

    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg-cache"))


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
