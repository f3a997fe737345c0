"""Graceful stops: a signal sets a flag that the training loop reads at step boundaries.

The flag is an object held in a ``contextvars`` variable, not module state, so each
simulated rank can have its own; only a ``python -m`` entry point installs the signal
handlers (docs/design.md, the communicator contract).
"""

from __future__ import annotations

import signal
from contextvars import ContextVar
from types import FrameType

__all__ = ["StopRequest", "current_stop_request", "set_stop_request", "install_handlers", "STOP_SIGNALS"]

#: signals that ask for a graceful stop: a scheduler's walltime warning, a kill, Ctrl-C
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """Set by a signal handler (or by code); read by the loop at each step boundary."""

    def __init__(self) -> None:
        self.signum: int | None = None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def request(self, signum: int = signal.SIGTERM) -> None:
        """Ask for a stop at the next step boundary."""
        if self.signum is None:
            self.signum = signum


_current: ContextVar[StopRequest | None] = ContextVar("hpcdl_stop_request", default=None)


def current_stop_request() -> StopRequest:
    """The stop request of this context (a fresh, never-set one if none was installed)."""
    req = _current.get()
    return req if req is not None else StopRequest()


def set_stop_request(req: StopRequest | None) -> None:
    """Make ``req`` the stop request the training loop of this context reads."""
    _current.set(req)


def install_handlers(req: StopRequest) -> None:
    """Route :data:`STOP_SIGNALS` to ``req`` (entry points only).

    A second SIGINT while a stop is pending raises ``KeyboardInterrupt``: a user
    pressing Ctrl-C twice wants out now, checkpoint or not.
    """

    def handler(signum: int, _frame: FrameType | None) -> None:
        if signum == signal.SIGINT and req.requested:
            raise KeyboardInterrupt
        req.request(signum)

    for sig in STOP_SIGNALS:
        signal.signal(sig, handler)
