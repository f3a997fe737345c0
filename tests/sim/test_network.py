"""Network models: analytic cases exact in ticks, order, node and fat-tree paths, presets, TOML errors."""

from __future__ import annotations

import json
import random
import tomllib
from fractions import Fraction
from importlib import resources
from pathlib import Path
from typing import Any

import pytest

from hpcdl.errors import ConfigError
from hpcdl.sim.network import PRESETS, Link, Network, load_network, network_toml, parse_network
from hpcdl.sim.ticks import TICKS_PER_SECOND

US = TICKS_PER_SECOND // 10**6  # ticks per microsecond


def net(**kw: Any) -> Network:
    """A network from keyword sections, as a TOML table would give them."""
    data: dict[str, Any] = {"inter": {"latency_us": 1.0, "bandwidth_GBps": 10.0}}
    data.update(kw)
    return parse_network(data, "test", where="test network")


def exact(nbytes: int, gbps: float) -> int:
    """``S / B`` in ticks, asserting it is a whole number (the figures are chosen so)."""
    t = Fraction(nbytes) / Fraction(round(gbps * 1e9)) * TICKS_PER_SECOND
    assert t.denominator == 1, (nbytes, gbps)
    return int(t)


def ceil_ticks(nbytes: int, gbps: float) -> int:
    """``S / B`` rounded up to a tick, computed independently with fractions."""
    t = Fraction(nbytes) / Fraction(round(gbps * 1e9)) * TICKS_PER_SECOND
    return -(-t.numerator // t.denominator)


# -- the analytic cases ---------------------------------------------------------------------------


def pingpong(n: Network, a: int, b: int, nbytes: int) -> int:
    _, there = n.send(a, b, nbytes, 0)
    _, back = n.send(b, a, nbytes, there)
    return back


@pytest.mark.parametrize("nbytes", [0, 10, 8000, 10**6, 123_450_000])
@pytest.mark.parametrize("latency_us, gbps", [(1.0, 10.0), (0.0, 25.0), (12.5, 1.25)])
def test_pingpong_exact(nbytes: int, latency_us: float, gbps: float) -> None:
    n = net(inter={"latency_us": latency_us, "bandwidth_GBps": gbps})
    n.reset(2)
    alpha = round(latency_us * US)
    assert pingpong(n, 0, 1, nbytes) == 2 * (alpha + exact(nbytes, gbps))


@pytest.mark.parametrize("nbytes", [1, 7, 999_999, 3 * 10**7 + 1])
@pytest.mark.parametrize("preset", PRESETS)
def test_pingpong_rounds_each_message_up_to_a_tick(preset: str, nbytes: int) -> None:
    n = load_network(preset, 2)
    link = n.intra if n.ranks_per_node != 1 else n.inter
    assert link is not None
    assert pingpong(n, 0, 1, nbytes) == 2 * (link.alpha + ceil_ticks(nbytes, link.bandwidth_GBps))


def ring_allreduce(n: Network, size: int, nbytes: int) -> int:
    """Ring allreduce's pattern: 2(n-1) steps, each rank sends nbytes/n once it received from the left."""
    chunk = nbytes // size
    ready = [0] * size  # when each rank may start its next step
    for _ in range(2 * (size - 1)):
        sent = [0] * size
        arrived = [0] * size
        for r in sorted(range(size), key=lambda r: (ready[r], r)):  # calls in time order
            sent[r], arrived[(r + 1) % size] = n.send(r, (r + 1) % size, chunk, ready[r])
        ready = [max(sent[r], arrived[r]) for r in range(size)]  # Sendrecv: both done
    return max(ready)


@pytest.mark.parametrize("size", [2, 3, 4, 5, 8, 13])
@pytest.mark.parametrize("chunk", [0, 10_000, 2_500_000])
def test_ring_allreduce_exact(size: int, chunk: int) -> None:
    n = net()
    n.reset(size)
    nbytes = chunk * size
    expected = 2 * (size - 1) * (1 * US + exact(nbytes // size, 10.0))  # 2(n-1)(alpha + S/(nB))
    assert ring_allreduce(n, size, nbytes) == expected


@pytest.mark.parametrize("senders", [1, 2, 3, 7, 16])
@pytest.mark.parametrize("nbytes", [10, 4_000_000])
def test_incast_exact(senders: int, nbytes: int) -> None:
    n = net()
    n.reset(senders + 1)
    d = exact(nbytes, 10.0)
    results = [n.send(s, 0, nbytes, 0) for s in range(1, senders + 1)]
    assert max(a for _, a in results) == 1 * US + senders * d  # alpha + N S / B
    assert [t for t, _ in results] == [k * d for k in range(1, senders + 1)]  # each sender waits its turn


def test_latency_is_not_serialised() -> None:
    n = net()
    n.reset(2)
    d = exact(10_000, 10.0)
    first = n.send(0, 1, 10_000, 0)
    second = n.send(0, 1, 10_000, 0)
    assert first == (d, d + US) and second == (2 * d, 2 * d + US)


def test_self_message_is_free() -> None:
    n = net()
    n.reset(2)
    assert n.send(1, 1, 10**6, 42) == (42, 42)
    assert pingpong(n, 0, 1, 10_000) == 2 * (US + exact(10_000, 10.0))  # no channel was held


def test_reset_forgets_busy_channels() -> None:
    n = net()
    n.reset(2)
    first = pingpong(n, 0, 1, 10**6)
    n.send(0, 1, 10**8, 0)
    n.reset(2)
    assert pingpong(n, 0, 1, 10**6) == first


def test_rank_outside_the_run_is_an_error() -> None:
    n = net()
    n.reset(2)
    with pytest.raises(ValueError, match=r"0 -> 5 outside the ranks 0\.\.1"):
        n.send(0, 5, 8, 0)


# -- order ----------------------------------------------------------------------------------------

ORDER_CASES = {
    "switch": {},
    "nodes": {"ranks_per_node": 3, "intra": {"latency_us": 0.5, "bandwidth_GBps": 20.0}},
    "shared-nic": {
        "ranks_per_node": 2,
        "intra": {"latency_us": 0.5, "bandwidth_GBps": 20.0},
        "inter": {"latency_us": 1.0, "bandwidth_GBps": 10.0, "nic": "node"},
    },
    "fat-tree": {
        "topology": {"kind": "fat-tree", "nodes_per_leaf": 2, "oversubscription": 3.0, "leaf_latency_us": 0.7}
    },
    "one-node": {"ranks_per_node": 0, "intra": {"latency_us": 0.2, "bandwidth_GBps": 5.0}},
}


@pytest.mark.parametrize("case", list(ORDER_CASES))
def test_messages_of_a_pair_arrive_in_the_order_sent(case: str) -> None:
    n = net(**ORDER_CASES[case])
    size = 8
    n.reset(size)
    rng = random.Random(case)
    t = 0
    last: dict[tuple[int, int], int] = {}
    for _ in range(3000):
        t += rng.choice([0, 0, 1, 10**5, 10**7])
        src, dst = rng.randrange(size), rng.randrange(size)
        nbytes = rng.choice([0, 1, 100, 10**4, 10**6, 10**7])  # a large message, then a small one
        sent, arrival = n.send(src, dst, nbytes, t)
        assert t <= sent <= arrival
        assert arrival >= last.get((src, dst), 0), (src, dst)
        last[src, dst] = arrival


# -- nodes ----------------------------------------------------------------------------------------


def test_ranks_per_node_picks_intra_or_inter() -> None:
    n = net(ranks_per_node=2, intra={"latency_us": 0.25, "bandwidth_GBps": 40.0})
    n.reset(4)
    s = 1_000_000
    intra, inter = 250_000 + exact(s, 40.0), US + exact(s, 10.0)
    assert n.send(0, 1, s, 0)[1] == intra  # node 0
    assert n.send(2, 3, s, 0)[1] == intra  # node 1
    assert n.send(1, 2, s, 0)[1] == inter  # node 0 -> node 1
    # the shared-memory channels are not the NIC's: rank 0 sends to 1 and to 2 at once
    assert n.send(0, 3, s, 0)[1] == inter


def test_ranks_per_node_zero_puts_every_rank_on_one_node() -> None:
    n = parse_network(
        {"ranks_per_node": 0, "intra": {"latency_us": 0.5, "bandwidth_GBps": 20.0}}, "one", where="t"
    )
    n.reset(64)
    assert n.inter is None
    assert pingpong(n, 0, 63, 20_000) == 2 * (500_000 + exact(20_000, 20.0))


def test_a_shared_nic_serialises_the_ranks_of_a_node() -> None:
    intra = {"latency_us": 0.5, "bandwidth_GBps": 20.0}
    own = net(ranks_per_node=2, intra=intra)
    shared = net(
        ranks_per_node=2, intra=intra, inter={"latency_us": 1.0, "bandwidth_GBps": 10.0, "nic": "node"}
    )
    d = exact(10**6, 10.0)
    for n, second in ((own, d), (shared, 2 * d)):
        n.reset(4)
        assert n.send(0, 2, 10**6, 0)[0] == d
        assert n.send(1, 3, 10**6, 0)[0] == second  # ranks 0 and 1 share node 0's NIC or not


# -- fat tree -------------------------------------------------------------------------------------


def fat_tree(o: float, npl: int = 4, leaf_latency_us: float = 0.0) -> Network:
    topo = {
        "kind": "fat-tree",
        "nodes_per_leaf": npl,
        "oversubscription": o,
        "leaf_latency_us": leaf_latency_us,
    }
    return net(topology=topo)


@pytest.mark.parametrize("o", [0.5, 1.0, 2.0, 4.0, 8.0])
def test_fat_tree_slows_a_leaf_to_leaf_exchange_by_the_oversubscription(o: float) -> None:
    """Every node of leaf 0 sends S to its partner in leaf 1: alpha + max(1, o) S / B.

    The uplink carries npl messages at C = npl B / o, so npl S / C = o S / B; each NIC
    needs S / B.
    """
    s, npl = 1_000_000, 4
    n = fat_tree(o, npl)
    n.reset(2 * npl)
    done = max(n.send(i, npl + i, s, 0)[1] for i in range(npl))
    assert done == US + max(1, Fraction(o)) * exact(s, 10.0)
    switch = net()
    switch.reset(2 * npl)
    assert max(switch.send(i, npl + i, s, 0)[1] for i in range(npl)) == US + exact(s, 10.0)


@pytest.mark.parametrize("o", [1.0, 2.0, 4.0, 8.0, 16.0])
@pytest.mark.parametrize("senders", [1, 3, 4])
def test_fat_tree_cross_leaf_incast(o: float, senders: int) -> None:
    """N senders of leaf 0 to one rank of leaf 1: alpha + N S / min(B, C), C = npl B / o.

    The receiver's NIC limits until the downlink is slower than it (o > npl); then the
    incast is slowed by o / npl.
    """
    s, npl = 1_000_000, 4
    n = fat_tree(o, npl)
    n.reset(2 * npl)
    done = max(n.send(i, npl, s, 0)[1] for i in range(senders))
    per_message = max(exact(s, 10.0), exact(s, 10.0 * npl / o))
    assert done == US + senders * per_message
    assert (done - US) * npl == senders * exact(s, 10.0) * max(npl, o)  # slowed by max(1, o / npl)


def test_fat_tree_traffic_within_a_leaf_is_a_switch() -> None:
    n = fat_tree(8.0, 4, leaf_latency_us=0.5)
    n.reset(8)
    d = exact(10**6, 10.0)
    assert max(n.send(i, i ^ 1, 10**6, 0)[1] for i in range(4)) == US + d  # 0<->1, 2<->3 in leaf 0
    n.reset(8)
    assert n.send(4, 0, 0, 0)[1] == US + 500_000  # between leaves: alpha + the leaf latency


# -- presets and files ----------------------------------------------------------------------------


def test_presets_are_the_shipped_files() -> None:
    files = resources.files("hpcdl.sim").joinpath("networks").iterdir()
    assert sorted(p.name for p in files if p.name.endswith(".toml")) == sorted(f"{p}.toml" for p in PRESETS)


@pytest.mark.parametrize("preset", PRESETS)
def test_presets_load_and_describe(preset: str) -> None:
    n = load_network(preset, 16)
    d = n.describe()
    assert n.name == preset == d["name"]
    assert json.loads(json.dumps(d)) == d
    assert "not measured here" in d["source"] or "measured by python -m hpcdl.bench calibrate" in d["source"]
    for sec in ("intra", "inter"):
        if sec in d:
            assert d[sec]["latency_us"] > 0 and d[sec]["bandwidth_GBps"] > 0
    # round trip: the description, written as TOML, is the same network
    data = {k: v for k, v in d.items() if k != "name"}
    again = parse_network(tomllib.loads(network_toml(data)), preset, where="round trip")
    assert again.describe() == d


def test_file_name_and_name_key(tmp_path: Path) -> None:
    path = tmp_path / "my-cluster.toml"
    path.write_text('source = "here"\n[inter]\nlatency_us = 2\nbandwidth_GBps = 5\n')
    n = load_network(path, 4)
    assert n.name == "my-cluster" and n.describe()["file"] == str(path)
    assert n.describe()["inter"] == {"latency_us": 2.0, "bandwidth_GBps": 5.0, "nic": "rank"}
    path.write_text('name = "renamed"\n' + path.read_text())
    assert load_network(str(path)).name == "renamed"


def test_compute_contention_key() -> None:
    n = net(compute={"contention": [1, 1.25, 1.5]})
    assert n.contention == (1.0, 1.25, 1.5) and all(type(f) is float for f in n.contention)
    d = n.describe()
    assert d["compute"] == {"contention": [1.0, 1.25, 1.5]}
    again = parse_network(tomllib.loads(network_toml(d)), "x", where="round trip")
    assert again.contention == n.contention and again.describe() == d
    assert "contention = [1.0, 1.25, 1.5]" in network_toml(d)
    # default: none, and the description says nothing of it
    plain = net()
    assert plain.contention == () and "compute" not in plain.describe()
    with pytest.raises(ValueError, match="contention factors must be >= 1"):
        Network("x", inter=Link(1.0, 1.0), contention=[0.5])


def test_link_rounds_like_the_docs() -> None:
    link = Link(0.3, 12.2)
    assert link.alpha == 300_000 and link.bps == 12_200_000_000
    assert link.transfer(12_200) == 1_000_000 and link.transfer(1) == 82  # 81.97 ticks, rounded up


BAD = [
    ("latency = 1.0\n[inter]\nlatency_us = 1\nbandwidth_GBps = 1\n", "unknown key 'latency'"),
    (
        "[inter]\nlatency_us = 1\nbandwith_GBps = 1\n",
        "unknown key 'inter.bandwith_GBps'; nearest valid key: 'inter.bandwidth_GBps'",
    ),
    ("[topolgy]\nkind = 1\n", r"unknown section \[topolgy\] \(did you mean \[topology\]\?\)"),
    (
        '[inter]\nlatency_us = 1\nbandwidth_GBps = "fast"\n',
        "key 'inter.bandwidth_GBps' .* must be a number, got str",
    ),
    (
        "[inter]\nlatency_us = true\nbandwidth_GBps = 1\n",
        "key 'inter.latency_us' .* must be a number, got bool",
    ),
    (
        "[inter]\nlatency_us = -1.0\nbandwidth_GBps = 1\n",
        r"key 'inter.latency_us' .* must be >= 0 \(got -1.0\)",
    ),
    (
        "[inter]\nlatency_us = 1\nbandwidth_GBps = 0\n",
        r"key 'inter.bandwidth_GBps' .* must be positive \(got 0.0\)",
    ),
    (
        "ranks_per_node = -2\n[inter]\nlatency_us = 1\nbandwidth_GBps = 1\n",
        "key 'ranks_per_node' .* must be >= 0",
    ),
    (
        "ranks_per_node = 1.5\n[inter]\nlatency_us = 1\nbandwidth_GBps = 1\n",
        "key 'ranks_per_node' .* must be an integer",
    ),
    ("[inter]\nlatency_us = 1\n", r"key 'inter.bandwidth_GBps' is missing .*add it to \[inter\]"),
    (
        "ranks_per_node = 4\n[inter]\nlatency_us = 1\nbandwidth_GBps = 1\n",
        r"key 'intra.latency_us' is missing \(ranks_per_node = 4",
    ),
    (
        'source = "no links"\n',
        r"key 'inter.latency_us' is missing \(ranks_per_node = 1 makes several nodes\)",
    ),
    ("inter = 3\n", r"'inter' must be a table: write \[inter\]"),
    (
        '[inter]\nlatency_us = 1\nbandwidth_GBps = 1\nnic = "socket"\n',
        "key 'inter.nic' must be one of 'rank', 'node'",
    ),
    (
        '[inter]\nlatency_us = 1\nbandwidth_GBps = 1\n[topology]\nkind = "torus"\n',
        "must be one of 'switch', 'fat-tree'",
    ),
    (
        '[inter]\nlatency_us = 1\nbandwidth_GBps = 1\n[topology]\nkind = "fat-tree"\n',
        "'topology.nodes_per_leaf' is missing",
    ),
    (
        "[inter]\nlatency_us = 1\nbandwidth_GBps = 1\n[topology]\nnodes_per_leaf = 4\n",
        'only applies to kind = "fat-tree"',
    ),
    (
        '[inter]\nlatency_us = 1\nbandwidth_GBps = 1\n[topology]\nkind = "fat-tree"\nnodes_per_leaf = 4\n'
        "oversubscription = -2\n",
        "key 'topology.oversubscription' .* must be positive",
    ),
    ("[inter\nlatency_us = 1\n", "is not valid TOML"),
    (
        "[compute]\ncontention = 1.2\n",
        r"key 'compute.contention' .* must be a non-empty list of numbers .*got float",
    ),
    ("[compute]\ncontention = []\n", r"key 'compute.contention' .* must be a non-empty list of numbers"),
    ('[compute]\ncontention = [1.0, "x"]\n', r"must be a non-empty list of numbers .*got list \[1.0, 'x'\]"),
    ("[compute]\ncontention = [true]\n", r"key 'compute.contention' .* must be a non-empty list of numbers"),
    (
        "[compute]\ncontention = [1.0, 0.9]\n",
        r"key 'compute.contention' .* must have every entry >= 1 \(got \[1.0, 0.9\]\)",
    ),
    ("contention = [1.0, 1.1]\n", "unknown key 'contention'; nearest valid key: 'compute.contention'"),
    ("[compute]\nfactor = 1.1\n", "unknown key 'compute.factor'; nearest valid key: 'compute.contention'"),
    ("compute = 1.1\n", r"'compute' must be a table: write \[compute\]"),
    ("[comptue]\n", r"unknown section \[comptue\] \(did you mean \[compute\]\?\)"),
]


@pytest.mark.parametrize("text, message", BAD)
def test_file_errors_name_the_file_and_the_key(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message) as err:
        load_network(path)
    assert str(err.value).startswith(f"network file {path}") and "\n" not in str(err.value)


def test_missing_file_or_unknown_preset(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"absent\.toml not found: give a preset \(shm-local, eth10g"):
        load_network(tmp_path / "absent.toml")
    with pytest.raises(ConfigError, match="network file ib-ndr not found: give a preset"):
        load_network("ib-ndr")


class ReferenceNetwork:
    """The channel model of the module docstring in plain Python integers (the C arithmetic's reference)."""

    def __init__(self, n: Network, nranks: int) -> None:
        self.n = n
        rpn = n.ranks_per_node
        nodes = 1 if rpn == 0 else -(-nranks // rpn)
        nics = nodes if n.nic == "node" else nranks
        leaves = -(-nodes // n.nodes_per_leaf) if n.fat_tree else 0
        self.sf, self.rf = [0] * nics, [0] * nics
        self.isf, self.irf = [0] * nranks, [0] * nranks
        self.up, self.down = [0] * leaves, [0] * leaves

    def send(self, src: int, dst: int, nbytes: int, t: int) -> tuple[int, int]:
        n, rpn = self.n, self.n.ranks_per_node
        if src == dst:
            return t, t
        if rpn == 0 or (rpn > 1 and src // rpn == dst // rpn):
            start = max(t, self.isf[src], self.irf[dst])
            end = start + -(-nbytes * TICKS_PER_SECOND // n.intra.bps)
            self.isf[src] = self.irf[dst] = end
            return end, end + n.intra.alpha
        s, d = (src // rpn, dst // rpn) if n.nic == "node" else (src, dst)
        start = max(t, self.sf[s], self.rf[d])
        end = start + -(-nbytes * TICKS_PER_SECOND // n.inter.bps)
        alpha = n.inter.alpha
        if n.fat_tree:
            ls, ld = src // rpn // n.nodes_per_leaf, dst // rpn // n.nodes_per_leaf
            if ls != ld:
                hold = -(-nbytes * TICKS_PER_SECOND // n.uplink_bps)
                self.up[ls] = max(start, self.up[ls]) + hold
                self.down[ld] = max(start, self.down[ld]) + hold
                end = max(end, self.up[ls], self.down[ld])
                alpha += n.leaf_alpha
        self.sf[s] = self.rf[d] = end
        return end, end + alpha


@pytest.mark.parametrize("kind", ["switch", "fat-tree"])
@pytest.mark.parametrize("nic", ["rank", "node"])
@pytest.mark.parametrize("rpn", [0, 1, 2, 3, 4])
def test_channel_arithmetic_matches_the_reference_for_any_rank_count(kind: str, nic: str, rpn: int) -> None:
    """Random traffic, rank counts that do not fill the last node or leaf included."""
    for npl, nranks in [(1, 5), (2, 6), (3, 7), (2, 9), (3, 10)]:
        n = net(
            ranks_per_node=rpn,
            intra={"latency_us": 0.5, "bandwidth_GBps": 50.0},
            inter={"latency_us": 2.0, "bandwidth_GBps": 10.0, "nic": nic},
            topology=(
                {"kind": kind, "nodes_per_leaf": npl, "oversubscription": 2.0, "leaf_latency_us": 0.3}
                if kind == "fat-tree"
                else {"kind": kind}
            ),
        )
        n.reset(nranks)
        ref = ReferenceNetwork(n, nranks)
        rnd = random.Random(rpn * 100 + nranks)
        t = 0
        for _ in range(300):
            src, dst, nbytes = rnd.randrange(nranks), rnd.randrange(nranks), rnd.randrange(1, 10**5)
            t += rnd.randrange(0, 10**6)
            assert n.send(src, dst, nbytes, t) == ref.send(src, dst, nbytes, t), (kind, nic, rpn, npl, nranks)


def test_bad_topology_numbers_are_refused() -> None:
    with pytest.raises(ValueError, match="nodes_per_leaf >= 1"):
        Network("x", inter=Link(1.0, 1.0), kind="fat-tree", nodes_per_leaf=0)
