"""Plans of the parameter-server strategy, as pure functions: its settings, shards, the SSP gate,
staleness bounds.

docs/design.md's "plans are data": nothing here communicates or keeps state; each function is
tested against literal tables (and the staleness bound against an exhaustive search of
the protocol's interleavings).

* **Settings.** :class:`PsSettings` is the strategy's config section, read in one place
  (:meth:`PsSettings.from_config`): the only code that names the config keys.
* **Shards.** The master parameters, packed into one flat buffer, are cut into S
  contiguous ranges, one per server, balanced by bytes: shard k holds elements
  ``[floor(k n / S), floor((k + 1) n / S))`` of the ``n`` (a shard may cut a tensor).
* **Stale Synchronous Parallel** (Ho et al., NIPS 2013). A worker's *clock* is the number
  of its pushes the servers have applied. A worker at clock ``c`` may pull (start push
  ``c + 1``) only when every worker's clock is at least ``c - s``; ``s = 0`` is
  bulk-synchronous through the servers.
* **Staleness** of an applied push: ``tau = v_apply - v_pull``, the server's version
  (pushes applied) when it applies the push less its version when it served the pull the
  push was computed from.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar

from hpcdl.errors import ConfigError

__all__ = ["PsSettings", "ShardPlan", "max_staleness", "shard_plan", "ssp_may_pull", "staleness"]


@dataclass(frozen=True)
class PsSettings:
    """The parameter-server strategy's settings, as read from the config.

    Attributes:
        servers: server ranks ``S`` (ranks ``0 .. S-1``).
        mode: ``async``, ``ssp`` or ``sync``.
        staleness: the SSP bound ``s``.
        compensation: ``none``, ``lr`` or ``dc``.
        dc_lambda: DC-ASGD's ``lambda``.
    """

    servers: int
    mode: str
    staleness: int
    compensation: str
    dc_lambda: float

    #: each setting's config key: the one place that names them (messages name them from here)
    KEYS: ClassVar[Mapping[str, str]] = MappingProxyType({
        "servers": "ps.servers",
        "mode": "ps.mode",
        "staleness": "ps.staleness",
        "compensation": "ps.compensation",
        "dc_lambda": "ps.dc_lambda",
    })  # fmt: skip

    @classmethod
    def from_config(cls, cfg: Any) -> PsSettings:
        """The settings ``cfg`` holds (a validated config: the schema checked types and choices)."""
        return cls(**{name: cfg[key] for name, key in cls.KEYS.items()})


@dataclass(frozen=True)
class ShardPlan:
    """Which range of the packed parameter buffer each server holds.

    Attributes:
        ranges: ``(start, stop)`` in elements of the packed buffer, by server.
        itemsize: bytes per element.
    """

    ranges: tuple[tuple[int, int], ...]
    itemsize: int

    @property
    def servers(self) -> int:
        return len(self.ranges)

    def nbytes(self, server: int) -> int:
        """Bytes of ``server``'s shard."""
        start, stop = self.ranges[server]
        return (stop - start) * self.itemsize

    def __str__(self) -> str:
        rows = [f"server {k}: elements {a:,}..{b - 1:,} ({(b - a) * self.itemsize:,} bytes)"
                for k, (a, b) in enumerate(self.ranges)]  # fmt: skip
        return "\n".join(rows)


def shard_plan(elements: int, servers: int, itemsize: int = 4) -> ShardPlan:
    """Cut a packed buffer of ``elements`` into ``servers`` contiguous shards balanced by bytes.

    Shard sizes differ by at most one element; the larger ones are the later ones.

    Raises:
        ConfigError: fewer than one server, or more servers than elements (one line).
    """
    key = PsSettings.KEYS["servers"]
    if servers < 1:
        raise ConfigError(f"{key} = {servers}: a parameter server job needs at least 1 server")
    if servers > elements:
        raise ConfigError(
            f"{key} = {servers} for a model of {elements} parameters: every server needs "
            "at least one; use fewer servers"
        )
    bounds = [k * elements // servers for k in range(servers + 1)]
    return ShardPlan(tuple(zip(bounds[:-1], bounds[1:])), itemsize)


def ssp_may_pull(clock: int, clocks: Sequence[int], bound: int) -> bool:
    """SSP's gate: a worker at ``clock`` may pull when every worker's clock is ``>= clock - bound``.

    Args:
        clock: the pulling worker's clock (its pushes applied).
        clocks: every worker's clock (the pulling worker's included).
        bound: the staleness bound ``s >= 0``.
    """
    return min(clocks) >= clock - bound


def staleness(v_apply: int, v_pull: int) -> int:
    """``tau`` of a push: the server's version when applying it less its version at the pull."""
    if v_apply < v_pull:
        raise ValueError(f"a push applied at version {v_apply} cannot come from a pull at {v_pull}")
    return v_apply - v_pull


def max_staleness(workers: int, bound: int) -> int:
    """The largest ``tau`` SSP allows with ``workers`` workers and bound ``s``: ``(W - 1)(2 s + 1)``.

    Proof. Let worker w pull at version ``v`` for its push ``c + 1`` (its clock is ``c``,
    and stays ``c`` until that push is applied). Its ``tau`` counts the other workers'
    pushes applied between the pull and the apply. At the pull, every other worker w' has
    clock ``a >= c - s`` (the gate). Until w's push is applied the smallest clock is at
    most ``c``, so w' can pull, hence push, only pushes numbered ``<= c + s + 1``: at most
    ``(c + s + 1) - (c - s) = 2 s + 1`` of its pushes are applied in the window, and
    ``tau <= (W - 1)(2 s + 1)``. The bound is reached: each other worker sits at clock
    ``c - s`` with its push ``c - s + 1`` in flight, pulled before w's pull, and pushes
    ``c - s + 2 .. c + s + 1`` while w computes (the tests find the maximum by searching
    every interleaving for small W and s).

    Raises:
        ValueError: ``workers < 1`` or ``bound < 0``.
    """
    if workers < 1 or bound < 0:
        raise ValueError(f"max_staleness needs workers >= 1 and bound >= 0 (got {workers}, {bound})")
    return (workers - 1) * (2 * bound + 1)
