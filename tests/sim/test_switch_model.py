"""The switch rank of the network model: ports per peer, per-packet processing, the [switch] keys."""

from __future__ import annotations

import random
import tomllib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import hpcdl.comm as hc
from hpcdl.errors import ConfigError
from hpcdl.sim.compute import make_compute
from hpcdl.sim.engine import simulate
from hpcdl.sim.network import Network, load_network, network_toml, parse_network
from hpcdl.sim.ticks import TICKS_PER_SECOND

US = TICKS_PER_SECOND // 10**6  # ticks per microsecond
ALPHA = 1 * US  # [inter] latency_us = 1.0
SIZES = [256 + 40, 1024 + 40]  # one datagram's payload and a header
COST_US = 0.35
C = 350_000  # COST_US in ticks


def xfer(nbytes: int) -> int:
    """``S / B`` in ticks at 10 GB/s (the figures are chosen so that it is whole)."""
    assert nbytes * TICKS_PER_SECOND % 10**10 == 0
    return nbytes * TICKS_PER_SECOND // 10**10


def net(switch: dict[str, Any] | None, nranks: int, **kw: Any) -> Network:
    data: dict[str, Any] = {"inter": {"latency_us": 1.0, "bandwidth_GBps": 10.0}, **kw}
    if switch is not None:
        data["switch"] = switch
    n = parse_network(data, "test", where="test network")
    n.reset(nranks)
    return n


def switch(processing: str = "parallel", cost: float = 0.0, **kw: Any) -> dict[str, Any]:
    return {"mode": "switch", "per_packet_us": cost, "processing": processing, **kw}


def host(cost: float = 0.0, **kw: Any) -> dict[str, Any]:
    return {"mode": "host", "per_packet_us": cost, **kw}


# -- the ports ------------------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [2, 3, 8])
@pytest.mark.parametrize("nbytes", SIZES)
def test_an_incast_into_the_switch_takes_each_sender_its_own_port(workers: int, nbytes: int) -> None:
    """W workers send S to the switch at once: each on its own port, all arrive at alpha + S/B."""
    n = net(switch(), workers + 1)
    times = n.schedule([(w, workers, nbytes, 0) for w in range(workers)])
    assert times == [(xfer(nbytes), ALPHA + xfer(nbytes))] * workers


@pytest.mark.parametrize("workers", [2, 3, 8])
@pytest.mark.parametrize("nbytes", SIZES)
def test_an_incast_into_the_host_shares_its_nic(workers: int, nbytes: int) -> None:
    """The host baseline is an ordinary rank: W senders into one NIC end at W S/B (+ alpha)."""
    n = net(host(), workers + 1)
    times = n.schedule([(w, workers, nbytes, 0) for w in range(workers)])
    assert times == [(workers * xfer(nbytes), ALPHA + workers * xfer(nbytes))] * workers


@pytest.mark.parametrize("workers", [2, 3, 8])
@pytest.mark.parametrize("nbytes", SIZES)
def test_the_result_goes_back_to_every_worker_in_parallel(workers: int, nbytes: int) -> None:
    """The switch sends S to each of W workers: a port each, line rate, alpha + S/B; the host: W S/B."""
    out = [(workers, w, nbytes, 0) for w in range(workers)]
    for processing in ("parallel", "serial"):
        times = net(switch(processing, COST_US), workers + 1).schedule(out)
        assert times == [(xfer(nbytes), ALPHA + xfer(nbytes))] * workers  # sending costs nothing
    times = net(host(COST_US), workers + 1).schedule(out)
    assert times == [(workers * xfer(nbytes), ALPHA + workers * xfer(nbytes))] * workers


def test_ports_are_full_duplex_and_a_worker_keeps_its_nic() -> None:
    """A port's two directions are independent; a worker's NIC is shared by its flows, as any rank's."""
    s = xfer(SIZES[1])
    n = net(switch(), 3)
    assert n.schedule([(0, 2, SIZES[1], 0), (2, 0, SIZES[1], 0)]) == [(s, ALPHA + s)] * 2
    # worker 0 sends to the switch and to worker 1 at once: they share 0's send channel
    assert n.schedule([(0, 2, SIZES[1], 0), (0, 1, SIZES[1], 0)]) == [(2 * s, ALPHA + 2 * s)] * 2


def test_port_bandwidth_sets_the_ports_line_rate() -> None:
    """``port_bandwidth_GBps`` below the workers' NICs: the port is the bottleneck."""
    n = net(switch(port_bandwidth_GBps=5.0), 3)
    s = 2 * xfer(SIZES[1])  # 5 GB/s
    assert n.schedule([(0, 2, SIZES[1], 0), (2, 1, SIZES[1], 0)]) == [(s, ALPHA + s)] * 2


def test_messages_between_other_ranks_are_unchanged() -> None:
    """Traffic that does not touch the switch rank is timed as with no [switch] at all."""
    rng = random.Random(26)
    msgs = [
        (rng.randrange(6), rng.randrange(6), rng.choice([0, 296, 1064, 10**5]), rng.randrange(5 * US))
        for _ in range(200)
    ]
    for sw in (switch("serial", COST_US), switch("parallel", COST_US), host(COST_US)):
        assert net(sw, 7).schedule(msgs) == net(None, 7).schedule(msgs)


def test_the_switch_can_be_any_rank() -> None:
    n = net(switch(rank=0), 4)
    s = xfer(SIZES[0])
    assert n.schedule([(w, 0, SIZES[0], 0) for w in (1, 2, 3)]) == [(s, ALPHA + s)] * 3
    assert n.schedule([(w, 3, SIZES[0], 0) for w in (1, 2)]) == [(2 * s, ALPHA + 2 * s)] * 2  # 3: a host


# -- per-packet processing ------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [2, 3, 8])
@pytest.mark.parametrize("nbytes", SIZES)
def test_serial_processing_delivers_the_kth_packet_k_costs_later(workers: int, nbytes: int) -> None:
    """One core: n packets arriving together are delivered at alpha + S/B + k c, k = 1..n."""
    n = net(switch("serial", COST_US), workers + 1)
    times = n.schedule([(w, workers, nbytes, 0) for w in range(workers)])
    assert {t for t, _ in times} == {xfer(nbytes)}
    assert sorted(a for _, a in times) == [ALPHA + xfer(nbytes) + k * C for k in range(1, workers + 1)]


@pytest.mark.parametrize("workers", [2, 3, 8])
@pytest.mark.parametrize("nbytes", SIZES)
def test_parallel_processing_pays_the_cost_once_per_port(workers: int, nbytes: int) -> None:
    """A pipeline per port: packets arriving together on W ports are all delivered at alpha + S/B + c."""
    n = net(switch("parallel", COST_US), workers + 1)
    times = n.schedule([(w, workers, nbytes, 0) for w in range(workers)])
    assert times == [(xfer(nbytes), ALPHA + xfer(nbytes) + C)] * workers


@pytest.mark.parametrize("workers", [2, 3, 8])
def test_the_host_pays_the_cost_serially_after_its_incast(workers: int) -> None:
    n = net(host(COST_US), workers + 1)
    times = n.schedule([(w, workers, SIZES[0], 0) for w in range(workers)])
    arrive = ALPHA + workers * xfer(SIZES[0])
    assert sorted(a for _, a in times) == [arrive + k * C for k in range(1, workers + 1)]


def test_serial_processing_is_first_in_first_out() -> None:
    """Packets arriving 0.1 us apart queue in arrival order; one arriving to an idle core waits c only."""
    s = xfer(SIZES[1])
    n = net(switch("serial", COST_US), 4)
    posted = [2 * US // 10, 0, US // 10, 5 * US]  # ranks 0, 1, 2, and 0 again much later
    times = n.schedule([(r, 3, SIZES[1], t) for r, t in zip([0, 1, 2, 0], posted, strict=True)])
    first = ALPHA + s
    assert [a for _, a in times] == [first + 3 * C, first + C, first + 2 * C, 5 * US + first + C]


def test_parallel_processing_queues_the_packets_of_one_port() -> None:
    """Two packets on port 0 (one after the other on its link) share port 0's server; port 1's is free."""
    s = xfer(SIZES[0])
    assert C > s  # the second packet arrives while the first is processed
    n = net(switch("parallel", COST_US), 3)
    times = n.schedule([(0, 2, SIZES[0], 0), (0, 2, SIZES[0], 0), (1, 2, SIZES[0], 0)])
    assert [a for _, a in times] == [ALPHA + s + C, ALPHA + s + 2 * C, ALPHA + s + C]
    assert [t for t, _ in times] == [s, 2 * s, s]


def test_processing_covers_empty_messages_but_not_self_messages() -> None:
    n = net(switch("serial", COST_US), 3)
    assert n.schedule([(0, 2, 0, 0), (1, 2, 0, 0)]) == [(0, ALPHA + C), (0, ALPHA + 2 * C)]
    assert n.schedule([(2, 2, 100, 7)]) == [(7, 7)]


def test_a_cost_below_a_tick_is_no_cost() -> None:
    """Costs are whole picoseconds: 0.0000001 us rounds to 0 ticks (no processing)."""
    n = net(switch("serial", 1e-7), 3)
    assert n.schedule([(0, 2, 296, 0), (1, 2, 296, 0)]) == [(xfer(296), ALPHA + xfer(296))] * 2


# -- the engine delivers what schedule() says -----------------------------------------------------


def _aggregate(nbytes: int, rounds: int):
    """Every worker sends a chunk to the switch (the last rank), which returns the sum to each."""

    def body() -> list[int]:
        comm = hc.world()
        rank, size = comm.Get_rank(), comm.Get_size()
        clock = comm._engine.clock
        seen = []
        chunk = np.zeros(nbytes // 4, dtype=np.int32)
        for _ in range(rounds):
            if rank == size - 1:
                total = np.zeros_like(chunk)
                for _ in range(size - 1):
                    comm.Recv(chunk, source=-1, tag=1)
                    total += chunk
                    seen.append(clock(rank))
                reqs = [comm.Isend(total, dest=w, tag=2) for w in range(size - 1)]
                comm.waitall(reqs)
            else:
                comm.Send(chunk, dest=size - 1, tag=1)
                comm.Recv(chunk, source=size - 1, tag=2)
                seen.append(clock(rank))
        return seen

    return body


@pytest.mark.parametrize("workers", [2, 3, 8])
@pytest.mark.parametrize(
    "sw",
    [switch("serial", COST_US), switch("parallel", COST_US), host(COST_US)],
    ids=["serial", "parallel", "host"],
)
def test_the_engine_delivers_at_the_times_of_the_model(workers: int, sw: dict[str, Any]) -> None:
    """A simulated round: the switch receives at the processed times, the workers get the result."""
    nbytes = SIZES[1]
    n = net(sw, workers + 1)
    inn = sorted(a for _, a in n.schedule([(w, workers, nbytes, 0) for w in range(workers)]))
    result = simulate(workers + 1, _aggregate(nbytes, 2), network=n, compute=make_compute("none"))
    got = result.results[workers]
    assert got[:workers] == inn  # round 1: the switch's receives, in order
    back = n.schedule([(workers, w, nbytes, inn[-1]) for w in range(workers)])
    assert [r[0] for r in result.results[:workers]] == [a for _, a in back]
    # round 2 starts when each worker has its result; the switch's clock only moves forward
    assert got == sorted(got) and got[workers] > got[workers - 1]


# -- the [switch] keys ----------------------------------------------------------------------------


def test_describe_round_trips_through_a_file(tmp_path: Path) -> None:
    for sw in (switch("serial", 0.25), switch("parallel", 1.5, rank=0, port_bandwidth_GBps=12.5), host(2.0)):
        n = net(sw, 4)
        data = {k: v for k, v in n.describe().items() if k != "file"}
        assert data["switch"] == {"rank": -1, **sw} if "rank" not in sw else data["switch"] == sw
        path = tmp_path / "net.toml"
        path.write_text(network_toml(data))
        assert tomllib.loads(path.read_text())["switch"] == data["switch"]
        assert load_network(path, 4).describe()["switch"] == data["switch"]


def test_no_switch_section_means_no_switch() -> None:
    n = load_network("eth10g", 4)
    assert n.switch is None and "switch" not in n.describe() and n.switch_rank(4) is None


INTER = "[inter]\nlatency_us = 1\nbandwidth_GBps = 10\n"
BAD = [
    ('[switch]\nmode = "router"\nper_packet_us = 1\n', "key 'switch.mode' must be one of 'switch', 'host'"),
    (
        '[switch]\nmode = "host"\nper_packet_us = -0.5\n',
        r"key 'switch.per_packet_us' .* must be >= 0 \(got -0.5\)",
    ),
    ('[switch]\nmode = "host"\nper_packet_us = 1\nrank = -2\n', r"key 'switch.rank' .* must be >= -1"),
    (
        '[switch]\nmode = "host"\nper_packet_us = 1\nprocessing = "serial"\n',
        r"key 'switch.processing' only applies to mode = \"switch\" \(a host processes",
    ),
    (
        '[switch]\nmode = "host"\nper_packet_us = 1\nport_bandwidth_GBps = 5\n',
        "key 'switch.port_bandwidth_GBps' only applies to mode = \"switch\"",
    ),
    ('[switch]\nmode = "switch"\nper_packet_us = 1\n', "key 'switch.processing' is missing"),
    (
        '[switch]\nmode = "switch"\nper_packet_us = 1\nprocessing = "batch"\n',
        "key 'switch.processing' must be one of 'parallel', 'serial'",
    ),
    ("[switch]\nper_packet_us = 1\n", "key 'switch.mode' is missing"),
    ('[switch]\nmode = "host"\n', "key 'switch.per_packet_us' is missing"),
    ('[switch]\nmode = "host"\nper_packet_us = 1\ncost_us = 1\n', "unknown key 'switch.cost_us'"),
    (
        '[switch]\nmode = "switch"\nper_packet_us = 1\nprocessing = "serial"\nport_bandwidth_GBps = 0\n',
        "key 'switch.port_bandwidth_GBps' .* must be positive",
    ),
    (
        '[topology]\nkind = "fat-tree"\nnodes_per_leaf = 2\n[switch]\nmode = "switch"\nper_packet_us = 1\n'
        'processing = "serial"\n',
        'key \'switch.mode\' = "switch" needs topology kind = "switch"',
    ),
    (
        '[switch]\nmode = "host"\nper_packet_us = 1\nrank = 8\n',
        r"key 'switch.rank' = 8 is not a rank of this run of 8",
    ),
]


@pytest.mark.parametrize("text, message", BAD)
def test_a_bad_switch_section_is_refused_in_one_line(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(INTER + text)
    with pytest.raises(ConfigError, match=message) as err:
        load_network(path, 8)
    assert str(err.value).startswith(f"network file {path}") and "\n" not in str(err.value)


def test_switch_mode_needs_the_inter_node_link() -> None:
    data = {"ranks_per_node": 0, "intra": {"latency_us": 1.0, "bandwidth_GBps": 10.0}}
    data["switch"] = switch("serial")
    with pytest.raises(
        ConfigError, match=r"key 'inter.latency_us' is missing \(\[switch\] mode = \"switch\""
    ):
        parse_network(data, "t", where="t")
    data["switch"] = host(1.0)  # the host baseline is an ordinary rank: fine on one node
    n = parse_network(data, "t", where="t")
    n.reset(3)
    assert sorted(a for _, a in n.schedule([(0, 2, 0, 0), (1, 2, 0, 0)])) == [ALPHA + US, ALPHA + 2 * US]


def test_the_switch_object_refuses_what_the_file_would() -> None:
    from hpcdl.sim.switch import Switch

    with pytest.raises(ValueError, match="processing must be serial"):
        Switch(mode="host", processing="parallel")
    with pytest.raises(ValueError, match="per_packet_us >= 0"):
        Switch(per_packet_us=-1.0)
    with pytest.raises(ValueError, match="switch mode must be"):
        Switch(mode="router")
    assert Switch(per_packet_us=0.35).cost == C


def test_the_switch_is_on_no_node_and_a_shared_nic_stays_shared() -> None:
    """ranks_per_node = 2: rank 2 shares the switch's node number but reaches it through a port (inter
    alpha, not shared memory); with nic = "node", ranks 0 and 1 share their node's NIC to the switch."""
    s = xfer(SIZES[1])
    intra = {"latency_us": 0.5, "bandwidth_GBps": 20.0}
    n = net(switch(), 4, ranks_per_node=2, intra=intra)
    assert n.schedule([(2, 3, SIZES[1], 0)]) == [(s, ALPHA + s)]
    assert n.schedule([(0, 1, SIZES[1], 0)]) == [(s // 2, US // 2 + s // 2)]  # shared memory, as before
    inter = {"latency_us": 1.0, "bandwidth_GBps": 10.0, "nic": "node"}
    n = net(switch(), 5, ranks_per_node=2, intra=intra, inter=inter)
    times = n.schedule([(0, 4, SIZES[1], 0), (1, 4, SIZES[1], 0), (2, 4, SIZES[1], 0)])
    assert times == [(2 * s, ALPHA + 2 * s)] * 2 + [(s, ALPHA + s)]
