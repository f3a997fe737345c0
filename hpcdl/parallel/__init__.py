"""Parallel strategies (``parallel.strategy``) and sync's gradient exchanges (``make_exchange``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hpcdl.comm import Communicator
from hpcdl.nn.parameter import Parameter
from hpcdl.parallel.bucketed import DEFAULT_BUCKET_MB, BucketedExchange
from hpcdl.parallel.exchange import AllreduceExchange, ExchangeError, GradientExchange, LocalExchange
from hpcdl.parallel.strategy import (
    Agreement,
    FreeRunningStrategy,
    LockstepStrategy,
    PhaseAgreement,
    PhaseStats,
    Placement,
    RankPlace,
    RankState,
    RunContext,
    StepStats,
    Strategy,
    strategy_class,
)
from hpcdl.parallel.switched import SwitchExchange

__all__ = [
    "Agreement",
    "FreeRunningStrategy",
    "LockstepStrategy",
    "PhaseAgreement",
    "Placement",
    "RankPlace",
    "RankState",
    "RunContext",
    "PhaseStats",
    "StepStats",
    "Strategy",
    "strategy_class",
    "EXCHANGES",
    "DEFAULT_BUCKET_MB",
    "make_exchange",
    "GradientExchange",
    "AllreduceExchange",
    "BucketedExchange",
    "SwitchExchange",
    "LocalExchange",
    "ExchangeError",
]

#: exchange name -> class; "allreduce": one flat blocking Allreduce after backward,
#: "bucketed": buckets reduced with hpcdl's collectives while backward runs, "switch": buckets
#: summed by an aggregation switch (its link in ``options``: ``switched.make_switch_exchange``)
EXCHANGES: dict[str, type] = {
    "allreduce": AllreduceExchange,
    "bucketed": BucketedExchange,
    "switch": SwitchExchange,
}


def make_exchange(
    name: str, comm: Communicator, params: Sequence[Parameter], *, debug: bool = False, **options: Any
) -> GradientExchange:
    """The gradient exchange ``name`` over ``comm`` (a :class:`LocalExchange` on one rank).

    ``options`` go to the bucketed and switch exchanges (``bucket_mb``, ``algorithm``; the
    switch's ``link`` and ``address``).
    """
    if name not in EXCHANGES:
        raise ValueError(f"unknown exchange {name!r}; exchanges: {', '.join(EXCHANGES)}")
    if comm.Get_size() == 1:
        return LocalExchange(comm, params, debug=debug)
    if name in ("bucketed", "switch"):
        return EXCHANGES[name](comm, params, debug=debug, **options)
    return EXCHANGES[name](comm, params, debug=debug)


def __getattr__(name: str) -> Any:
    if name == "STRATEGIES":  # moved: the registry is hpcdl.components's
        import warnings  # noqa: PLC0415

        from hpcdl import components  # noqa: PLC0415

        warnings.warn("hpcdl.parallel.STRATEGIES is hpcdl.components.STRATEGIES now", DeprecationWarning,
                      stacklevel=2)  # fmt: skip
        return components.STRATEGIES
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
