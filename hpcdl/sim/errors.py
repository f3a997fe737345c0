"""How a simulation ends badly: a deadlock, an ``Abort``, a rank's exception."""

from __future__ import annotations

from hpcdl.errors import HpcdlError

__all__ = ["RankFailure", "SimAbort", "SimDeadlock", "Stall"]


class SimDeadlock(HpcdlError, RuntimeError):
    """Every unfinished virtual rank waits and nothing is in flight; the message says who waits for what."""


class Stall(BaseException):
    """Raised inside a rank at a polling stall; the engine's ``run`` turns it into :class:`SimDeadlock`.

    A ``BaseException``, so that a rank's ``except Exception`` cannot swallow it.
    """


class SimAbort(BaseException):
    """Raised in a virtual rank by ``Abort``: ends the whole simulation with ``errorcode``."""

    def __init__(self, errorcode: int, rank: int) -> None:
        super().__init__(f"rank {rank} called Abort({errorcode})")
        self.errorcode = errorcode
        self.rank = rank


class RankFailure(RuntimeError):
    """A virtual rank raised: ``rank`` and the original exception (``__cause__``)."""

    def __init__(self, rank: int, exc: BaseException) -> None:
        super().__init__(f"virtual rank {rank} raised {type(exc).__name__}: {exc}")
        self.rank = rank
        self.exc = exc
