"""Network models of the simulator: full-duplex NICs, latency alpha and bandwidth B, switch or fat tree.

Every message is a *flow* over its sender's send channel and its receiver's receive channel
(and a fat tree's leaf links), sharing them max-min fairly with the flows of the moment,
rates recomputed at every start and end, in exact integer ticks; it arrives ``alpha`` after
its last byte is through. A ``[switch]`` section names one rank an aggregating switch (a port
per peer instead of a NIC) or its host baseline, with a per-packet processing cost. The
model, its derivation, the analytic cases the tests check, the network file's keys and the
presets are documented once, in ``docs/network.md``.
"""

from __future__ import annotations

import difflib
import os
import tomllib
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from hpcdl._ext.simcore import NetCore
from hpcdl.errors import ConfigError
from hpcdl.sim.switch import PROCESSING, SWITCH_MODES, Switch, parse_switch
from hpcdl.sim.ticks import TICKS_PER_SECOND

__all__ = ["PRESETS", "Link", "Network", "Switch", "load_network", "parse_network", "network_toml"]

#: names of the shipped presets (``hpcdl/sim/networks/<name>.toml``)
PRESETS: tuple[str, ...] = ("shm-local", "eth10g", "eth40g", "ib-edr", "ib-hdr")

_KINDS = ("switch", "fat-tree")
_NICS = ("rank", "node")
#: section -> key -> (type, minimum, strict, meaning); strict: the value must exceed the minimum
#: (a list: a non-empty list of numbers, each checked against the minimum)
_SCHEMA: dict[str, dict[str, tuple[type, float | None, bool, str]]] = {
    "": {
        "name": (str, None, False, "the model's name"),
        "source": (str, None, False, "where the figures come from"),
        "ranks_per_node": (int, 0, False, "consecutive ranks per node (0: all on one node)"),
    },
    "intra": {
        "latency_us": (float, 0.0, False, "intra-node latency in microseconds"),
        "bandwidth_GBps": (float, 0.0, True, "intra-node bandwidth in GB/s"),
        "memory_GBps": (float, 0.0, True, "node memory a rank reads plus writes per second, in GB/s"),
    },
    "inter": {
        "latency_us": (float, 0.0, False, "inter-node latency in microseconds"),
        "bandwidth_GBps": (float, 0.0, True, "inter-node bandwidth in GB/s"),
        "nic": (str, None, False, 'one NIC per "rank" or per "node"'),
    },
    "topology": {
        "kind": (str, None, False, '"switch" or "fat-tree"'),
        "nodes_per_leaf": (int, 1, False, "nodes per leaf switch"),
        "oversubscription": (float, 0.0, True, "leaf downlink/uplink bandwidth ratio"),
        "leaf_latency_us": (float, 0.0, False, "latency added between leaves in microseconds"),
    },
    "compute": {
        "contention": (list, 1.0, False, "measured-compute slow-down by ranks on a node"),
    },
    "switch": {
        "rank": (int, -1, False, "the rank that is the switch (-1: the last)"),
        "mode": (str, None, False, '"switch" (a port per worker) or "host" (one NIC)'),
        "per_packet_us": (float, 0.0, False, "processing cost per message received, in microseconds"),
        "processing": (str, None, False, '"parallel" (a pipeline per port) or "serial" (one core)'),
        "port_bandwidth_GBps": (float, 0.0, True, "bandwidth of each switch port in GB/s"),
    },
}
_CHOICES = {
    "inter.nic": _NICS,
    "topology.kind": _KINDS,
    "switch.mode": SWITCH_MODES,
    "switch.processing": PROCESSING,
}


class Link:
    """One class of path: latency in ticks and bandwidth in whole bytes per second."""

    __slots__ = ("alpha", "bps", "latency_us", "bandwidth_GBps")

    def __init__(self, latency_us: float, bandwidth_GBps: float) -> None:
        self.latency_us = float(latency_us)
        self.bandwidth_GBps = float(bandwidth_GBps)
        self.alpha = round(self.latency_us * (TICKS_PER_SECOND // 10**6))
        self.bps = max(1, round(self.bandwidth_GBps * 1e9))

    def transfer(self, nbytes: int) -> int:
        """Ticks to push ``nbytes`` through at this bandwidth, rounded up: ``ceil(S / B)``."""
        return -(-nbytes * TICKS_PER_SECOND // self.bps)

    def describe(self) -> dict[str, float]:
        return {"latency_us": self.latency_us, "bandwidth_GBps": self.bandwidth_GBps}


class Network(NetCore):
    """The NIC/switch/fat-tree model of the module docstring; built by :func:`load_network`.

    Args:
        name: the model's name (a preset name or a file's stem).
        ranks_per_node: consecutive ranks per node; 0: all ranks on one node.
        intra: shared-memory path (needed unless ``ranks_per_node == 1``).
        inter: path between nodes (needed unless ``ranks_per_node == 0``).
        nic: ``"rank"`` (a NIC per rank) or ``"node"`` (one per node).
        kind: ``"switch"`` or ``"fat-tree"``.
        nodes_per_leaf: fat tree: nodes per leaf switch.
        oversubscription: fat tree: downlink/uplink bandwidth ratio of a leaf.
        leaf_latency_us: fat tree: microseconds added to alpha between leaves.
        contention: measured compute's slow-down by ranks on a node (entry k-1 for k
            ranks, the last for more); empty: none. The compute model applies it
            (:class:`hpcdl.sim.compute.Contention`); the network only carries it.
        switch: the rank that is an aggregating switch, or its host baseline (None: none).
        memory_GBps: the bytes per second, in GB/s, that a rank reads plus writes when it
            reduces in memory its node shares (the allreduce ``"shm"``, charged as
            :meth:`memory_beta` says); None: not modelled (the pass is measured compute, and
            ``auto`` does not choose ``"shm"``).
        source: where the figures come from.
        path: the file it was read from, if any.
    """

    def __init__(
        self,
        name: str,
        *,
        ranks_per_node: int = 1,
        intra: Link | None = None,
        inter: Link | None = None,
        nic: str = "rank",
        kind: str = "switch",
        nodes_per_leaf: int = 1,
        oversubscription: float = 1.0,
        leaf_latency_us: float = 0.0,
        contention: Sequence[float] = (),
        switch: Switch | None = None,
        memory_GBps: float | None = None,
        source: str = "",
        path: str | None = None,
    ) -> None:
        if ranks_per_node != 1 and intra is None:
            raise ValueError("ranks_per_node != 1 needs an intra-node link")
        if ranks_per_node != 0 and inter is None:
            raise ValueError("ranks_per_node != 0 needs an inter-node link")
        if ranks_per_node < 0 or nodes_per_leaf < 1:
            raise ValueError(
                "ranks_per_node must be >= 0 and nodes_per_leaf >= 1 "
                f"(got {ranks_per_node}, {nodes_per_leaf})"
            )
        if any(not f >= 1.0 for f in contention):
            raise ValueError(f"contention factors must be >= 1 (got {list(contention)})")
        if memory_GBps is not None and (intra is None or not memory_GBps > 0):
            raise ValueError(f"memory_GBps needs an intra-node link and must be positive (got {memory_GBps})")
        if switch is not None and switch.mode == "switch" and (inter is None or kind != "switch"):
            raise ValueError('a switch rank in mode "switch" needs an inter-node link and kind "switch"')
        self.name = name
        self.source = source
        self.path = path
        self.ranks_per_node = ranks_per_node
        self.intra = intra
        self.inter = inter
        self.nic = nic
        self.kind = kind
        self.nodes_per_leaf = nodes_per_leaf
        self.oversubscription = float(oversubscription)
        self.leaf_latency_us = float(leaf_latency_us)
        self.contention = tuple(float(f) for f in contention)
        self.switch = switch
        self.memory_GBps = None if memory_GBps is None else float(memory_GBps)
        self.fat_tree = kind == "fat-tree"
        self._nic_node = nic == "node"
        #: capacity of a leaf's uplink and downlink, bytes per second
        self.uplink_bps = (
            max(1, round(nodes_per_leaf * inter.bps / self.oversubscription)) if inter is not None else 0
        )
        self.leaf_alpha = round(self.leaf_latency_us * (TICKS_PER_SECOND // 10**6))
        self.reset(0)

    def switch_rank(self, nranks: int) -> int | None:
        """The switch's rank in a run of ``nranks`` ranks (None: no ``[switch]``).

        Raises:
            ConfigError: ``switch.rank`` is not one of the run's ranks.
        """
        if self.switch is None:
            return None
        rank = nranks - 1 if self.switch.rank == -1 else self.switch.rank
        if not 0 <= rank < nranks:
            where = f"network file {self.path}" if self.path else f"network {self.name}"
            raise ConfigError(
                f"{where}: key 'switch.rank' = {self.switch.rank} is not a rank of this run of {nranks} "
                "ranks: give one of 0..{} or -1 (the last)".format(nranks - 1)
            )
        return rank

    def reset(self, nranks: int) -> None:
        """Fresh, idle channels for a run of ``nranks`` ranks.

        Raises:
            ConfigError: ``switch.rank`` is not one of the ``nranks`` ranks.
        """
        sw = self.switch
        rank = self.switch_rank(nranks) if sw is not None and nranks > 0 else None
        ports = rank is not None and sw.mode == "switch"
        port_bps = 1
        if ports:
            port_bps = (
                self.inter.bps
                if sw.port_bandwidth_GBps is None
                else max(1, round(sw.port_bandwidth_GBps * 1e9))
            )
        self.nranks = nranks
        self._configure(
            self.ranks_per_node,
            self.intra,
            self.inter,
            self._nic_node,
            self.fat_tree,
            self.nodes_per_leaf,
            self.uplink_bps,
            self.leaf_alpha,
            nranks,
            -1 if rank is None else rank,
            ports,
            port_bps,
            0 if sw is None else sw.cost,
            sw is not None and sw.processing == "parallel",
        )

    # NetCore (in C) runs the flows: the engine posts each message and takes the network's
    # completions in time order; schedule([(src, dst, nbytes, t_ready), ...]) ->
    # [(t_sent, t_arrival), ...] does the same for a list of messages without an engine.
    # A rank outside 0 .. nranks - 1 is a ValueError.

    def alpha_beta(self, ranks: int) -> tuple[float, float]:
        """``(alpha, beta)`` in seconds and seconds per byte between two of ``ranks`` ranks: the
        intra-node link when they share a node (``ranks_per_node`` 0 puts every rank on one),
        else the inter-node one (the pipeline planner's network, ``pipeline.network``)."""
        per_node = self.ranks_per_node
        shared = per_node == 0 or ranks <= per_node or self.inter is None
        chosen = self.intra if shared else self.inter
        return chosen.latency_us * 1e-6, 1.0 / (chosen.bandwidth_GBps * 1e9)

    def one_node(self, ranks: Sequence[int]) -> bool:
        """Whether the world ranks ``ranks`` all run on one node."""
        per_node = self.ranks_per_node
        return per_node == 0 or len({r // per_node for r in ranks}) <= 1

    def memory_beta(self, ranks: Sequence[int]) -> float | None:
        """Seconds per byte that a rank of ``ranks`` (world ranks) takes to read or write memory
        the others read too: ``1 / memory_GBps``, when they all run on one node and the model
        has ``intra.memory_GBps``; else None (nothing of theirs is summed in node memory).

        The allreduce ``"shm"`` charges its pass at this rate (each rank reads and writes its
        chunk of every rank's buffer: ``2 n`` bytes of an ``n``-byte vector), in place of
        measuring it: the virtual ranks run one at a time, each with the machine's memory
        to itself, where real ranks of a node share it. A calibrated figure is the rate of
        the node's ranks reducing at once (``bench calibrate``).
        """
        if self.memory_GBps is None or not self.one_node(ranks):
            return None
        return 1.0 / (self.memory_GBps * 1e9)

    def describe(self) -> dict[str, Any]:
        """The model's parameters, JSON-able (for run-file attributes)."""
        out: dict[str, Any] = {
            "name": self.name,
            "source": self.source,
            "ranks_per_node": self.ranks_per_node,
        }
        if self.path is not None:
            out["file"] = self.path
        if self.intra is not None:
            out["intra"] = self.intra.describe()
            if self.memory_GBps is not None:
                out["intra"]["memory_GBps"] = self.memory_GBps
        if self.inter is not None:
            out["inter"] = {**self.inter.describe(), "nic": self.nic}
        topo: dict[str, Any] = {"kind": self.kind}
        if self.fat_tree:
            topo |= {
                "nodes_per_leaf": self.nodes_per_leaf,
                "oversubscription": self.oversubscription,
                "leaf_latency_us": self.leaf_latency_us,
            }
        out["topology"] = topo
        if self.contention:
            out["compute"] = {"contention": list(self.contention)}
        if self.switch is not None:
            out["switch"] = self.switch.describe()
        return out

    def __repr__(self) -> str:
        return f"Network({self.name!r}, ranks_per_node={self.ranks_per_node}, kind={self.kind!r})"


def _check(data: dict[str, Any], where: str) -> dict[str, dict[str, Any]]:
    """The values of a network table, by section, with the types of :data:`_SCHEMA` checked."""
    fix = "see the network keys in docs/network.md"
    out: dict[str, dict[str, Any]] = {sec: {} for sec in _SCHEMA}
    for key, value in data.items():
        if isinstance(value, dict):
            if key not in _SCHEMA or key == "":
                near = difflib.get_close_matches(key, [s for s in _SCHEMA if s], n=1)
                hint = f" (did you mean [{near[0]}]?)" if near else ""
                sections = ", ".join(f"[{s}]" for s in _SCHEMA if s)
                raise ConfigError(f"{where}: unknown section [{key}]{hint}; sections: {sections}")
            items = [(f"{key}.{k}", key, k, v) for k, v in value.items()]
        elif key in _SCHEMA:
            raise ConfigError(
                f"{where}: {key!r} must be a table: write [{key}] and its keys on the lines below"
            )
        else:
            items = [(key, "", key, value)]
        for dotted, sec, k, v in items:
            spec = _SCHEMA[sec].get(k)
            if spec is None or isinstance(v, dict):
                # a top-level key may belong in a section (contention = [...] above [compute])
                valid = [f"{s}.{n}" if s else n for s in (_SCHEMA if not sec else [sec]) for n in _SCHEMA[s]]
                near = difflib.get_close_matches(dotted, valid, n=1, cutoff=0.0)
                raise ConfigError(f"{where}: unknown key {dotted!r}; nearest valid key: {near[0]!r}; {fix}")
            typ, minimum, strict, meaning = spec
            if typ is list:
                out[sec][k] = _check_list(v, dotted, meaning, minimum, where)
                continue
            if typ is float and isinstance(v, int) and not isinstance(v, bool):
                v = float(v)
            if not isinstance(v, typ) or isinstance(v, bool):
                kind = {str: "a string", int: "an integer", float: "a number"}[typ]
                raise ConfigError(
                    f"{where}: key {dotted!r} ({meaning}) must be {kind}, got {type(v).__name__} {v!r}"
                )
            if minimum is not None and (v <= minimum if strict else v < minimum):
                bound = "positive" if strict and minimum == 0 else f">= {minimum:g}"
                raise ConfigError(f"{where}: key {dotted!r} ({meaning}) must be {bound} (got {v!r})")
            choices = _CHOICES.get(dotted)
            if choices and v not in choices:
                raise ConfigError(
                    f"{where}: key {dotted!r} must be one of {', '.join(map(repr, choices))} (got {v!r})"
                )
            out[sec][k] = v
    return out


def _check_list(v: Any, dotted: str, meaning: str, minimum: float | None, where: str) -> list[float]:
    """A key whose value is a non-empty list of numbers, each ``>= minimum``, as floats."""
    if (
        not isinstance(v, list)
        or not v
        or any(not isinstance(x, (int, float)) or isinstance(x, bool) for x in v)
    ):
        raise ConfigError(
            f"{where}: key {dotted!r} ({meaning}) must be a non-empty list of numbers such as "
            f"[1.0, 1.1], got {type(v).__name__} {v!r}"
        )
    if minimum is not None and any(not x >= minimum for x in v):
        raise ConfigError(
            f"{where}: key {dotted!r} ({meaning}) must have every entry >= {minimum:g} (got {v!r})"
        )
    return [float(x) for x in v]


def parse_network(data: dict[str, Any], name: str, *, where: str, path: str | None = None) -> Network:
    """A :class:`Network` from the table of a TOML file (the keys of the module docstring).

    Args:
        data: the parsed TOML.
        name: the name to use when the table has no ``name`` key.
        where: how errors name the source, e.g. ``"network file net.toml"``.
        path: the file, recorded by :meth:`Network.describe`.

    Raises:
        ConfigError: an unknown key or section, a wrong type, a value out of range, or a
            missing section (one line naming ``where`` and the key).
    """
    v = _check(data, where)
    top, intra, inter, topo = v[""], v["intra"], v["inter"], v["topology"]
    contention = v["compute"].get("contention", ())
    rpn = top.get("ranks_per_node", 1)
    links: dict[str, Link | None] = {}
    for sec, values, needed, why in (
        ("intra", intra, rpn != 1, f"ranks_per_node = {rpn} puts several ranks on a node"),
        ("inter", inter, rpn != 0, f"ranks_per_node = {rpn} makes several nodes"),
    ):
        if not values and not needed:
            links[sec] = None
            continue
        for k in ("latency_us", "bandwidth_GBps"):
            if k not in values:
                cause = why if not values else f"[{sec}] needs both latency_us and bandwidth_GBps"
                raise ConfigError(f"{where}: key '{sec}.{k}' is missing ({cause}): add it to [{sec}]")
        links[sec] = Link(values["latency_us"], values["bandwidth_GBps"])
    kind = topo.get("kind", "switch")
    switch = parse_switch(v["switch"] if "switch" in data else None, links["inter"] is not None, kind, where)
    if kind == "fat-tree" and "nodes_per_leaf" not in topo:
        raise ConfigError(f"{where}: key 'topology.nodes_per_leaf' is missing (kind = \"fat-tree\" needs it)")
    if kind == "switch":
        extra = sorted(set(topo) - {"kind"})
        if extra:
            raise ConfigError(
                f'{where}: key \'topology.{extra[0]}\' only applies to kind = "fat-tree" (kind is "switch")'
            )
    return Network(
        top.get("name", name),
        ranks_per_node=rpn,
        intra=links["intra"],
        inter=links["inter"],
        nic=inter.get("nic", "rank"),
        kind=kind,
        nodes_per_leaf=topo.get("nodes_per_leaf", 1),
        oversubscription=topo.get("oversubscription", 1.0),
        leaf_latency_us=topo.get("leaf_latency_us", 0.0),
        contention=contention,
        switch=switch,
        memory_GBps=intra.get("memory_GBps") if links["intra"] is not None else None,
        source=top.get("source", ""),
        path=path,
    )


def load_network(spec: str | os.PathLike[str], nranks: int | None = None) -> Network:
    """The network model of a preset name (:data:`PRESETS`) or a TOML file.

    Args:
        spec: a preset name, or the path of a TOML file (keys in the module docstring).
        nranks: if given, the model is :meth:`~Network.reset` for that many ranks.

    Raises:
        ConfigError: the file is missing, unreadable, not TOML, or has a bad key (one line
            naming the file, the key and the fix).
    """
    text_spec = os.fspath(spec)
    if text_spec in PRESETS:
        where = f"network preset {text_spec}"
        try:
            text = resources.files("hpcdl.sim").joinpath("networks", f"{text_spec}.toml").read_text("utf-8")
        except OSError as err:
            raise ConfigError(f"{where} cannot be read ({err.strerror or err}): reinstall hpcdl") from None
        name, path = text_spec, None
    else:
        p = Path(text_spec)
        where = f"network file {text_spec}"
        try:
            text = p.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(
                f"{where} not found: give a preset ({', '.join(PRESETS)}) or the path of a TOML file "
                "(python -m hpcdl.bench calibrate --out NET.toml writes one)"
            ) from None
        except (OSError, UnicodeDecodeError) as err:
            why = getattr(err, "strerror", None) or err
            raise ConfigError(f"{where} cannot be read ({why}): give a readable TOML file") from None
        name, path = p.stem, text_spec
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{where} is not valid TOML ({err}): fix the file") from None
    net = parse_network(data, name, where=where, path=path)
    if nranks is not None:
        net.reset(nranks)
    return net


def network_toml(data: dict[str, Any], comments: Sequence[str] = ()) -> str:
    """TOML text of a network table (top-level keys, then its sections: ``[intra]``, ``[inter]``, ...).

    Args:
        data: the table, as :func:`parse_network` takes it.
        comments: lines written first, as ``#`` comments.
    """

    def value(v: Any) -> str:
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ") + '"'
        if isinstance(v, float):
            return repr(v)
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return str(v)

    lines = [f"# {c}" if c else "#" for c in comments]
    lines += [f"{k} = {value(v)}" for k, v in data.items() if not isinstance(v, dict)]
    for sec, table in data.items():
        if isinstance(table, dict):
            lines += ["", f"[{sec}]", *(f"{k} = {value(v)}" for k, v in table.items())]
    return "\n".join(lines) + "\n"
