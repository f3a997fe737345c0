"""Network models: analytic cases exact in ticks, order, node and fat-tree paths, presets, TOML errors."""

from __future__ import annotations

import json
import math
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


def one(n: Network, src: int, dst: int, nbytes: int, t: int = 0) -> tuple[int, int]:
    """``(t_sent, t_arrival)`` of one message alone on idle channels."""
    return n.schedule([(src, dst, nbytes, t)])[0]


def pingpong(n: Network, a: int, b: int, nbytes: int) -> int:
    _, there = one(n, a, b, nbytes)
    _, back = one(n, b, a, nbytes, there)
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
        times = n.schedule([(r, (r + 1) % size, chunk, ready[r]) for r in range(size)])
        sent = [s for s, _ in times]
        arrived = [times[(r - 1) % size][1] for r in range(size)]
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
def test_incast_shares_the_receiver_and_ends_at_alpha_plus_n_s_over_b(senders: int, nbytes: int) -> None:
    """N flows of S into one NIC, started together, share it: all end at N S / B (+ alpha)."""
    n = net()
    n.reset(senders + 1)
    d = exact(nbytes, 10.0)
    times = n.schedule([(s, 0, nbytes, 0) for s in range(1, senders + 1)])
    assert times == [(senders * d, 1 * US + senders * d)] * senders


@pytest.mark.parametrize("small", [0, 1, 100, 8000, 393_216])
@pytest.mark.parametrize("posted_us", [0, 3, 50])
def test_a_small_message_shares_the_receiver_with_a_large_one(small: int, posted_us: int) -> None:
    """s bytes posted while another sender's large transfer into the same rank is under way.

    Both flows get B/2 while both go: the small one arrives by alpha + 2 s / B after it was
    posted, and delays the large one by s / B. (The model before flows held the receiver
    whole: the small message waited for the large one to end.)
    """
    n = net(inter={"latency_us": 1.0, "bandwidth_GBps": 1.0})  # a byte: exactly 1,000 ticks
    n.reset(3)
    large, t1 = 10**6, posted_us * US
    (big_sent, big_arrival), (s_sent, s_arrival) = n.schedule([(1, 0, large, 0), (2, 0, small, t1)])
    assert s_sent == t1 + 2 * small * 1000 and s_arrival == s_sent + US
    assert big_sent == (large + small) * 1000 and big_arrival == big_sent + US


def test_flows_share_a_sender_too() -> None:
    """One rank pushing to two at once (a server's pulls) gives each half of its NIC."""
    n = net()
    n.reset(3)
    d = exact(10**6, 10.0)
    assert n.schedule([(0, 1, 10**6, 0), (0, 2, 10**6, 0)]) == [(2 * d, 2 * d + US)] * 2


def test_max_min_gives_the_unused_share_to_the_others() -> None:
    """1->0, 2->0, 3->0 and 3->4 at once: a max-min share, not an equal split per channel.

    Rank 0's receive side is the tightest channel (B/3 for each of three flows); rank 3's
    send side carries 3->0 at B/3 and gives the rest, 2B/3 (not B/2), to 3->4.
    """
    n = net(inter={"latency_us": 0.0, "bandwidth_GBps": 1.2})
    n.reset(5)
    s = 120_000  # 100 us at the full 1.2 GB/s
    times = n.schedule([(1, 0, s, 0), (2, 0, s, 0), (3, 0, s, 0), (3, 4, s, 0)])
    assert times[3][0] == 150 * US  # S / (2B/3); then rank 3's NIC has one flow, 3->0, still at B/3
    assert [t for t, _ in times[:3]] == [300 * US] * 3  # S / (B/3)


def test_latency_is_not_serialised_and_a_pair_keeps_its_order() -> None:
    """Two messages of one pair go one after the other (one connection), each arriving alpha later."""
    n = net()
    n.reset(2)
    d = exact(10_000, 10.0)
    first, second = n.schedule([(0, 1, 10_000, 0), (0, 1, 10_000, 0)])
    assert first == (d, d + US) and second == (2 * d, 2 * d + US)
    # an empty message behind a large one of the same pair waits for it: order is kept
    big, empty = n.schedule([(0, 1, 10**6, 0), (0, 1, 0, 5)])
    assert empty == big


def test_self_message_is_free() -> None:
    n = net()
    n.reset(2)
    d = exact(10_000, 10.0)
    assert n.schedule([(1, 1, 10**6, 42), (0, 1, 10_000, 0)]) == [(42, 42), (d, d + US)]


def test_schedule_leaves_the_channels_idle() -> None:
    n = net()
    n.reset(4)
    msgs = [(0, 1, 10**6, 0), (2, 1, 10**4, 5), (3, 1, 0, 7), (1, 0, 10**5, 9)]
    assert n.schedule(msgs) == n.schedule(msgs)
    n.reset(4)
    assert pingpong(n, 0, 1, 10**6) == 2 * (US + exact(10**6, 10.0))


def test_rank_outside_the_run_is_an_error() -> None:
    n = net()
    n.reset(2)
    with pytest.raises(ValueError, match=r"0 -> 5 of 8 bytes: .* ranks in 0\.\.1"):
        one(n, 0, 5, 8)


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
    msgs = []
    for _ in range(3000):
        t += rng.choice([0, 0, 1, 10**5, 10**7])
        src, dst = rng.randrange(size), rng.randrange(size)
        nbytes = rng.choice([0, 1, 100, 10**4, 10**6, 10**7])  # a large message, then a small one
        msgs.append((src, dst, nbytes, t))
    last: dict[tuple[int, int], int] = {}
    for (src, dst, _, t), (sent, arrival) in zip(msgs, n.schedule(msgs)):
        assert t <= sent <= arrival
        assert arrival >= last.get((src, dst), 0), (src, dst)
        last[src, dst] = arrival


# -- nodes ----------------------------------------------------------------------------------------


def test_ranks_per_node_picks_intra_or_inter() -> None:
    n = net(ranks_per_node=2, intra={"latency_us": 0.25, "bandwidth_GBps": 40.0})
    n.reset(4)
    s = 1_000_000
    intra, inter = 250_000 + exact(s, 40.0), US + exact(s, 10.0)
    assert one(n, 0, 1, s)[1] == intra  # node 0
    assert one(n, 2, 3, s)[1] == intra  # node 1
    assert one(n, 1, 2, s)[1] == inter  # node 0 -> node 1
    # the shared-memory channels are not the NIC's: rank 0 sends to 1 and to 3 at once
    assert [a for _, a in n.schedule([(0, 1, s, 0), (0, 3, s, 0)])] == [intra, inter]


def test_ranks_per_node_zero_puts_every_rank_on_one_node() -> None:
    n = parse_network(
        {"ranks_per_node": 0, "intra": {"latency_us": 0.5, "bandwidth_GBps": 20.0}}, "one", where="t"
    )
    n.reset(64)
    assert n.inter is None
    assert pingpong(n, 0, 63, 20_000) == 2 * (500_000 + exact(20_000, 20.0))


def test_a_shared_nic_is_shared_by_the_ranks_of_a_node() -> None:
    intra = {"latency_us": 0.5, "bandwidth_GBps": 20.0}
    own = net(ranks_per_node=2, intra=intra)
    shared = net(
        ranks_per_node=2, intra=intra, inter={"latency_us": 1.0, "bandwidth_GBps": 10.0, "nic": "node"}
    )
    d = exact(10**6, 10.0)
    for n, each in ((own, d), (shared, 2 * d)):
        n.reset(4)
        times = n.schedule([(0, 2, 10**6, 0), (1, 3, 10**6, 0)])
        assert [t for t, _ in times] == [each, each]  # ranks 0 and 1 share node 0's NIC or not


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

    The uplink carries npl flows at C = npl B / o, C / npl = B / o each; each NIC B.
    """
    s, npl = 1_000_000, 4
    n = fat_tree(o, npl)
    n.reset(2 * npl)
    done = max(a for _, a in n.schedule([(i, npl + i, s, 0) for i in range(npl)]))
    assert done == US + max(1, Fraction(o)) * exact(s, 10.0)
    switch = net()
    switch.reset(2 * npl)
    assert max(a for _, a in switch.schedule([(i, npl + i, s, 0) for i in range(npl)])) == US + exact(s, 10.0)


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
    done = max(a for _, a in n.schedule([(i, npl, s, 0) for i in range(senders)]))
    per_message = max(exact(s, 10.0), exact(s, 10.0 * npl / o))
    assert done == US + senders * per_message
    assert (done - US) * npl == senders * exact(s, 10.0) * max(npl, o)  # slowed by max(1, o / npl)


def test_fat_tree_traffic_within_a_leaf_is_a_switch() -> None:
    n = fat_tree(8.0, 4, leaf_latency_us=0.5)
    n.reset(8)
    d = exact(10**6, 10.0)
    assert max(a for _, a in n.schedule([(i, i ^ 1, 10**6, 0) for i in range(4)])) == US + d  # in leaf 0
    assert one(n, 4, 0, 0)[1] == US + 500_000  # between leaves: alpha + the leaf latency


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


def test_memory_rate_key() -> None:
    """``intra.memory_GBps``: the seconds per byte of node memory for ranks of one node, round-tripped
    by ``describe``; None without the key, or for ranks on two nodes."""
    intra = {"latency_us": 1.0, "bandwidth_GBps": 10.0, "memory_GBps": 25.0}
    n = net(ranks_per_node=2, intra=intra)
    assert n.memory_beta([0, 1]) == pytest.approx(1 / 25e9) and n.memory_beta([2, 3]) == n.memory_beta([0, 1])
    assert n.memory_beta([1, 2]) is None and n.one_node([2, 3]) and not n.one_node([1, 2])
    d = n.describe()
    assert d["intra"]["memory_GBps"] == 25.0
    again = parse_network(tomllib.loads(network_toml(d)), "x", where="round trip")
    assert again.describe() == d
    everyone = net(ranks_per_node=0, intra=intra)
    assert everyone.memory_beta(list(range(64))) == pytest.approx(1 / 25e9)
    plain = net(ranks_per_node=0, intra={"latency_us": 1.0, "bandwidth_GBps": 10.0})
    assert plain.memory_beta([0, 1]) is None and "memory_GBps" not in plain.describe()["intra"]
    with pytest.raises(ValueError, match="memory_GBps needs an intra-node link"):
        Network("x", inter=Link(1.0, 1.0), memory_GBps=10.0)


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
    (
        "ranks_per_node = 0\n[intra]\nlatency_us = 1\nbandwidth_GBps = 1\nmemory_GBps = 0\n",
        r"key .intra.memory_GBps. \(node memory a rank reads plus writes .*\) must be positive \(got 0.0\)",
    ),
    (
        "ranks_per_node = 0\n[intra]\nmemory_GBps = 20\n",
        r"key 'intra.latency_us' is missing \(\[intra\] needs both latency_us and bandwidth_GBps\)",
    ),
    (
        "ranks_per_node = 0\n[intra]\nlatency_us = 1\nbandwidth_GBps = 1\nmemory_gbps = 20\n",
        "unknown key 'intra.memory_gbps'; nearest valid key: 'intra.memory_GBps'",
    ),
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


class ReferenceFlows:
    """The flow model of the module docstring, written plainly (the C engine's reference).

    Every change (a flow starting or ending) re-shares *all* channels at once by
    progressive filling: the channel with the smallest share ``floor(capacity left /
    flows not fixed)`` (equal shares: the lowest channel number, numbered as the C code
    numbers them) fixes its flows at that share. The C code only re-shares the flows
    connected to the change, keeps intrusive lists and a completion heap; this does none
    of that.
    """

    def __init__(self, n: Network, nranks: int) -> None:
        self.n, self.nranks = n, nranks
        rpn = n.ranks_per_node
        nodes = 1 if rpn == 0 else -(-nranks // rpn)
        self.nics = nodes if n.nic == "node" else nranks
        self.leaves = -(-nodes // n.nodes_per_leaf) if n.fat_tree else 0
        inter = n.inter.bps if n.inter else 1
        intra = n.intra.bps if n.intra else 1
        self.cap = [inter] * (2 * self.nics) + [intra] * (2 * nranks) + [n.uplink_bps] * (2 * self.leaves)

    def route(self, src: int, dst: int) -> tuple[list[int], int]:
        n, rpn, nics, nr = self.n, self.n.ranks_per_node, self.nics, self.nranks
        if rpn == 0 or (rpn > 1 and src // rpn == dst // rpn):
            return [2 * nics + src, 2 * nics + nr + dst], n.intra.alpha
        s, d = (src // rpn, dst // rpn) if n.nic == "node" else (src, dst)
        chans, alpha = [s, nics + d], n.inter.alpha
        if n.fat_tree:
            ls, ld = src // rpn // n.nodes_per_leaf, dst // rpn // n.nodes_per_leaf
            if ls != ld:
                base = 2 * nics + 2 * nr
                chans += [base + ls, base + self.leaves + ld]
                alpha += n.leaf_alpha
        return chans, alpha

    def reshare(self, flows: list[dict[str, Any]], t: int) -> None:
        left = list(self.cap)
        count = [0] * len(self.cap)
        for f in flows:
            for c in f["chans"]:
                count[c] += 1
        rate: dict[int, int] = {}
        while len(rate) < len(flows):
            busy = [c for c in range(len(left)) if count[c] > 0]
            best = min(busy, key=lambda c: (Fraction(left[c], count[c]), c))
            share = Fraction(max(1, left[best]), count[best])
            for f in flows:
                if best in f["chans"] and id(f) not in rate:
                    rate[id(f)] = share
                    for c in f["chans"]:
                        left[c] -= math.ceil(share)
                        count[c] -= 1
        for f in flows:
            if rate[id(f)] != f["rate"]:
                f["rem"] -= math.floor(f["rate"] * (t - f["t_last"]))
                f["t_last"], f["rate"] = t, rate[id(f)]
                f["t_end"] = t + math.ceil(f["rem"] / f["rate"])

    def schedule(self, msgs: list[tuple[int, int, int, int]]) -> list[tuple[int, int]]:
        out: list[Any] = [None] * len(msgs)
        posts = sorted(range(len(msgs)), key=lambda i: (msgs[i][3], i))
        active: list[dict[str, Any]] = []
        queues: dict[tuple[int, int], list[dict[str, Any]]] = {}

        def start(f: dict[str, Any], t: int) -> None:
            f.update(rate=0, t_last=t)
            active.append(f)

        k = 0
        while k < len(posts) or active:
            t_next = min((f["t_end"] for f in active), default=None)
            if k < len(posts) and (t_next is None or msgs[posts[k]][3] < t_next):
                i = posts[k]
                k += 1
                src, dst, nbytes, t = msgs[i]
                if src == dst:
                    out[i] = (t, t)
                    continue
                chans, alpha = self.route(src, dst)
                queue = queues.setdefault((src, dst), [])
                if not queue and nbytes == 0:
                    out[i] = (t, t + alpha)
                    continue
                f = {"i": i, "chans": chans, "alpha": alpha, "pair": (src, dst)}
                f["rem"] = nbytes * TICKS_PER_SECOND
                queue.append(f)
                if len(queue) == 1:
                    start(f, t)
                    self.reshare(active, t)
                continue
            while any(f["t_end"] == t_next for f in active):
                for f in [f for f in active if f["t_end"] == t_next]:
                    active.remove(f)
                    out[f["i"]] = (t_next, t_next + f["alpha"])
                    queue = queues[f["pair"]]
                    queue.pop(0)
                    if queue:
                        start(queue[0], t_next)
                self.reshare(active, t_next)
        return out


@pytest.mark.parametrize("kind", ["switch", "fat-tree"])
@pytest.mark.parametrize("nic", ["rank", "node"])
@pytest.mark.parametrize("rpn", [0, 1, 2, 3])
def test_flows_match_the_reference_for_any_rank_count(kind: str, nic: str, rpn: int) -> None:
    """Random overlapping traffic, rank counts that do not fill the last node or leaf included."""
    for npl, nranks in [(1, 5), (2, 6), (3, 7), (2, 9)]:
        n = net(
            ranks_per_node=rpn,
            intra={"latency_us": 0.5, "bandwidth_GBps": 50.0},
            inter={"latency_us": 2.0, "bandwidth_GBps": 10.0 / 3, "nic": nic},
            topology=(
                {"kind": kind, "nodes_per_leaf": npl, "oversubscription": 2.0, "leaf_latency_us": 0.3}
                if kind == "fat-tree"
                else {"kind": kind}
            ),
        )
        n.reset(nranks)
        rnd = random.Random(rpn * 100 + nranks)
        t, msgs = 0, []
        for _ in range(150):
            src, dst = rnd.randrange(nranks), rnd.randrange(nranks)
            t += rnd.choice([0, 0, 1, 10**5, 10**6, 10**7])
            msgs.append((src, dst, rnd.choice([0, 7, rnd.randrange(1, 10**5), rnd.randrange(1, 10**7)]), t))
        assert n.schedule(msgs) == ReferenceFlows(n, nranks).schedule(msgs), (kind, nic, rpn, npl, nranks)


def test_bad_topology_numbers_are_refused() -> None:
    with pytest.raises(ValueError, match="nodes_per_leaf >= 1"):
        Network("x", inter=Link(1.0, 1.0), kind="fat-tree", nodes_per_leaf=0)


def test_a_refused_schedule_leaves_the_channels_idle() -> None:
    n = net()
    n.reset(4)
    with pytest.raises(ValueError, match="message 1: 2 -> 3 of -1 bytes"):
        n.schedule([(0, 1, 10**6, 0), (2, 3, -1, 5)])
    with pytest.raises(ValueError, match="message 0: 0 -> 9"):
        n.schedule([(0, 9, 10, 0)])
    assert one(n, 0, 1, 10)[1] == US + exact(10, 10.0)


def test_an_incast_keeps_one_completion_per_group_not_per_flow() -> None:
    """4,096 flows into one rank (all sizes different): re-shared at each start and end, yet fast and small.

    Each change re-rates every flow of the group; only the group's earliest end is an event.
    """
    import tracemalloc

    senders = 4096
    n = net()
    n.reset(senders + 1)
    tracemalloc.start()
    times = n.schedule([(s, 0, 1000 + 37 * s, 0) for s in range(1, senders + 1)])
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 20 * 2**20  # the stale completions of a heap of one event per flow: 270 MB
    # processor sharing: the smaller ones end first, every one at the bytes sent until then
    ends = [t for t, _ in times]
    assert ends == sorted(ends)
    total = sum(1000 + 37 * s for s in range(1, senders + 1))
    assert total * 100 <= ends[-1] <= total * 100 + senders  # all bytes at B (each end rounded up a tick)
