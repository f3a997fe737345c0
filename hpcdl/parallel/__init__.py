"""Parallel strategies, picked by name: ``make_exchange("allreduce", comm, params)``."""

from __future__ import annotations

from collections.abc import Sequence

from hpcdl.comm import Communicator
from hpcdl.nn.parameter import Parameter
from hpcdl.parallel.exchange import AllreduceExchange, ExchangeError, GradientExchange, LocalExchange

__all__ = [
    "EXCHANGES",
    "make_exchange",
    "GradientExchange",
    "AllreduceExchange",
    "LocalExchange",
    "ExchangeError",
]

EXCHANGES = {"allreduce": AllreduceExchange}


def make_exchange(
    name: str, comm: Communicator, params: Sequence[Parameter], *, debug: bool = False
) -> GradientExchange:
    """The gradient exchange ``name`` over ``comm`` (a :class:`LocalExchange` on one rank)."""
    if name not in EXCHANGES:
        raise ValueError(f"unknown exchange {name!r}; exchanges: {', '.join(EXCHANGES)}")
    if comm.Get_size() == 1:
        return LocalExchange(comm, params, debug=debug)
    return EXCHANGES[name](comm, params, debug=debug)
