"""The training driver: one loop for every strategy, and what the commands share.

``python -m hpcdl.train`` is the driver's command. The driver owns what every way of
spreading training shares: the config and the objects built from it (:mod:`.factory`,
:mod:`.context`), the loop and its periodic work at the strategy's meetings
(:mod:`.loop`), the run file and its log (:mod:`.runlog`), checkpoints and ``--resume``
(:mod:`.checkpoints`), stop signals (:mod:`.signals`), progress output (:mod:`.progress`),
the run's wall time and samples/s, defined once for every output (:mod:`.figures`),
the launcher checks (:mod:`.launch`) and every command's command-line plumbing
(:mod:`.cli`). A strategy (:mod:`hpcdl.parallel`) owns the rest.
"""

from __future__ import annotations

from typing import Any

__all__ = ["RunResult", "plan", "train"]


def __getattr__(name: str) -> Any:
    """``train``, ``plan``, ``RunResult`` from :mod:`.run` on first use: the commands that only
    need :mod:`.cli` (report, bench, simulate) do not import the whole driver (PEP 562)."""
    if name in __all__:
        from hpcdl.driver import run

        return getattr(run, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
