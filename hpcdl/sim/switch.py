"""The switch rank of a network file's ``[switch]``: which rank aggregates, as a switch or a host.

The model (a port per peer, a per-packet cost paid on one server or one per port) runs in
:class:`hpcdl._ext.simcore.NetCore`; :class:`hpcdl.sim.network.Network` configures it. Its
keys and the analytic cases are documented in ``docs/network.md`` (The switch rank).
"""

from __future__ import annotations

from typing import Any

from hpcdl.errors import ConfigError
from hpcdl.sim.ticks import TICKS_PER_SECOND

__all__ = ["PROCESSING", "SWITCH_MODES", "Switch", "parse_switch"]

#: ``switch.mode``: a port per peer rank, or one ordinary NIC
SWITCH_MODES = ("switch", "host")
#: ``switch.processing``: a server per port, or one for all
PROCESSING = ("parallel", "serial")


class Switch:
    """The ``[switch]`` section: which rank is the aggregating switch, and how it is modelled.

    Args:
        rank: the switch's rank; -1: the last rank of the run.
        mode: ``"switch"``: a port per peer rank (line rate each) instead of a NIC;
            ``"host"``: an ordinary rank with one NIC (the software baseline).
        per_packet_us: processing cost of each message the rank receives, microseconds.
        processing: ``"parallel"`` (a server per port, a hardware pipeline) or
            ``"serial"`` (one server, a software switch's core); host mode is serial.
        port_bandwidth_GBps: switch mode: each port's bandwidth (None: the inter-node one).
    """

    __slots__ = ("rank", "mode", "per_packet_us", "processing", "port_bandwidth_GBps", "cost")

    def __init__(
        self,
        rank: int = -1,
        *,
        mode: str = "switch",
        per_packet_us: float = 0.0,
        processing: str = "serial",
        port_bandwidth_GBps: float | None = None,
    ) -> None:
        if mode not in SWITCH_MODES or processing not in PROCESSING:
            raise ValueError(
                f"switch mode must be switch or host, processing parallel or serial ({mode}, {processing})"
            )
        if mode == "host" and processing != "serial":
            raise ValueError("a host processes its packets serially (one core): processing must be serial")
        if rank < -1 or not per_packet_us >= 0:
            raise ValueError(
                f"switch rank must be >= -1 and per_packet_us >= 0 (got {rank}, {per_packet_us})"
            )
        self.rank = rank
        self.mode = mode
        self.per_packet_us = float(per_packet_us)
        self.processing = processing
        self.port_bandwidth_GBps = None if port_bandwidth_GBps is None else float(port_bandwidth_GBps)
        #: ticks per message received (picoseconds: exact for any whole number of them)
        self.cost = round(self.per_packet_us * (TICKS_PER_SECOND // 10**6))

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rank": self.rank, "mode": self.mode, "per_packet_us": self.per_packet_us}
        if self.mode == "switch":
            out["processing"] = self.processing
            if self.port_bandwidth_GBps is not None:
                out["port_bandwidth_GBps"] = self.port_bandwidth_GBps
        return out


def parse_switch(values: dict[str, Any] | None, has_inter: bool, kind: str, where: str) -> Switch | None:
    """The :class:`Switch` of a network file's ``[switch]`` values (types already checked).

    Args:
        values: the section's keys and values; None: the file has no ``[switch]``.
        has_inter: the file has an ``[inter]`` link (switch mode's ports take its alpha and B).
        kind: the file's ``topology.kind``.
        where: how errors name the file.

    Raises:
        ConfigError: a key missing, or one that does not apply to the mode (one line).
    """
    if values is None:
        return None
    for k in ("mode", "per_packet_us"):
        if k not in values:
            why = {
                "mode": '"switch" (a port per worker) or "host" (one NIC)',
                "per_packet_us": "the processing cost per message received, measured: 0 for none",
            }[k]
            raise ConfigError(f"{where}: key 'switch.{k}' is missing ([switch] needs it: {why})")
    mode = values["mode"]
    if mode == "host":
        for k in ("processing", "port_bandwidth_GBps"):
            if k in values:
                why = (
                    "a host processes its packets serially, on one core"
                    if k == "processing"
                    else "a host has one NIC, [inter]'s"
                )
                raise ConfigError(f"{where}: key 'switch.{k}' only applies to mode = \"switch\" ({why})")
    else:
        if "processing" not in values:
            raise ConfigError(
                f'{where}: key \'switch.processing\' is missing (mode = "switch" needs it: "parallel", '
                'a pipeline per port as in hardware, or "serial", one core as in a software switch)'
            )
        if not has_inter:
            raise ConfigError(
                f"{where}: key 'inter.latency_us' is missing ([switch] mode = \"switch\" takes its ports' "
                "latency and line rate from [inter])"
            )
        if kind != "switch":
            raise ConfigError(
                f'{where}: key \'switch.mode\' = "switch" needs topology kind = "switch" '
                f"(a switch rank in a fat tree is not modelled; kind is {kind!r})"
            )
    return Switch(
        values.get("rank", -1),
        mode=mode,
        per_packet_us=values["per_packet_us"],
        processing=values.get("processing", "serial"),
        port_bandwidth_GBps=values.get("port_bandwidth_GBps"),
    )
