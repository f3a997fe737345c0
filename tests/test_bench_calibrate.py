"""``bench calibrate``: the fit, the placement and the contention as pure functions; a file that loads."""

from __future__ import annotations

import json
import socket
import tempfile
from pathlib import Path
from typing import Any

import pytest

import hpcdl.comm as hc
from hpcdl.bench import SUBCOMMANDS, build_parser, main
from hpcdl.bench.calibrate import fit, fit_memory, placement
from hpcdl.bench.contention import KERNELS, factors, levels
from hpcdl.errors import ConfigError, FileError
from hpcdl.sim.network import load_network


@pytest.mark.parametrize("alpha, bandwidth", [(1.5e-6, 8e9), (2e-5, 1.2e9), (1e-6, 2.4e10)])
def test_fit_recovers_a_hockney_model(alpha: float, bandwidth: float) -> None:
    sizes = [0, 4096, 65536, 1 << 20, 16 << 20]
    got_alpha, got_bw = fit(sizes, [alpha + s / bandwidth for s in sizes])
    assert got_alpha == alpha  # the smallest size's time
    assert got_bw == pytest.approx(bandwidth, rel=1e-12)
    sizes[0] = 8  # alpha includes the 8 bytes' transfer: B comes out a little higher
    got_alpha, got_bw = fit(sizes, [alpha + s / bandwidth for s in sizes])
    assert got_alpha == alpha + 8 / bandwidth and bandwidth < got_bw < 1.01 * bandwidth


def test_fit_weighs_sizes_by_relative_residual() -> None:
    sizes = [8, 1 << 20, 4 << 20]
    times = [1e-6, 1e-6 + (1 << 20) / 5e9, 1e-6 + (4 << 20) / 20e9]  # 5 GB/s, then 20 GB/s
    _, bw = fit(sizes, times)
    assert 5e9 < bw < 20e9


def test_fit_alpha_is_the_median_of_tiny_sizes() -> None:
    sizes = [8, 64, 512, 1 << 20]
    alpha, _ = fit(sizes, [2e-6, 1e-6, 9e-6, 1e-4])  # one slow sample of 512 bytes
    assert alpha == 2e-6


def test_fit_errors() -> None:
    with pytest.raises(ConfigError, match="needs sizes above 1024 bytes too"):
        fit([8, 512], [1e-6, 1e-6])
    with pytest.raises(ConfigError, match="smallest of --sizes is 65536 bytes.*at most 4096"):
        fit([65536, 1 << 20], [1e-5, 1e-4])
    with pytest.raises(ConfigError, match="do not grow with the size"):
        fit([8, 1 << 20], [1e-5, 1e-5])


@pytest.mark.parametrize("fixed, rate", [(3e-5, 27e9), (8e-6, 15e9), (0.0, 4e9)])
def test_fit_memory_recovers_the_fixed_cost_and_the_rate(fixed: float, rate: float) -> None:
    sizes = [256 << 10, 1 << 20, 4 << 20, 16 << 20]
    got = fit_memory(sizes, [fixed + 2 * s / rate for s in sizes])
    assert got is not None
    assert got[0] == pytest.approx(fixed, abs=1e-12) and got[1] == pytest.approx(rate, rel=1e-9)


def test_fit_memory_declines_times_that_do_not_grow() -> None:
    assert fit_memory([1 << 20, 4 << 20], [2e-4, 1e-4]) is None
    assert fit_memory([1 << 20, 4 << 20], [1e-4, 1e-4]) is None
    assert fit_memory([1 << 20], [1e-4]) is None  # one size: no slope


def test_placement() -> None:
    assert placement(["a", "a"]) == (0, 1, None, None)
    assert placement(["a", "a", "a"]) == (0, 1, None, None)
    assert placement(["a", "b", "c"]) == (1, None, 1, None)
    assert placement(["a", "a", "b", "b", "c", "c"]) == (2, 1, 2, None)
    rpn, intra, inter, note = placement(["a", "b", "a", "b"])  # round robin: not the simulator's layout
    assert (rpn, intra, inter) == (2, 2, 1) and note is not None and "consecutive blocks of 2" in note


def test_contention_levels_and_factors() -> None:
    assert levels(1) == [1] and levels(2) == [1, 2] and levels(3) == [1, 2, 3]
    assert levels(6) == [1, 2, 4, 6] and levels(8) == [1, 2, 4, 8]
    assert factors({1: 1.0, 2: 1.1234}, 2) == [1.0, 1.123]
    # linear between the measured counts
    assert factors({1: 1.0, 2: 1.1, 4: 1.3, 6: 1.5}, 6) == [1.0, 1.1, 1.2, 1.3, 1.4, 1.5]
    # never below 1, and entry 0 is 1 whatever rank 0 alone measured
    assert factors({1: 1.0, 2: 0.97, 3: 1.02}, 3) == [1.0, 1.0, 1.02]


@pytest.mark.skipif(hc.world().Get_size() != 1, reason="runs without mpiexec")
def test_calibrate_under_the_simulator_writes_its_network_and_a_contention(tmp_path: Path) -> None:
    """Without compute time (``--compute none``) the fit recovers the simulated link exactly-ish and
    the kernels slow nothing down: ``[compute] contention = [1.0, 1.0]``."""
    from hpcdl.simulate import main as simulate

    out = tmp_path / "sim.toml"
    rows = tmp_path / "rows.json"
    argv = ["-n", "2", "--network", "eth10g", "--compute", "none", "-m", "hpcdl.bench", "calibrate"]
    argv += ["--out", str(out), "--sizes", "8", "64K", "1M", "--repeat", "2", "--contention-repeat", "1"]
    assert simulate([*argv, "--json", str(rows)]) == 0
    net = load_network(out, 2)
    assert net.ranks_per_node == 0 and net.contention == (1.0, 1.0)
    kernel_rows = [r for r in json.loads(rows.read_text()) if "kernel" in r]
    assert [(r["kernel"], r["ranks_at_once"]) for r in kernel_rows] == [
        (k, n) for k in KERNELS for n in (1, 2)
    ]
    assert [r["samples"] for r in kernel_rows] == [1, 2] * len(KERNELS)
    text = out.read_text()
    assert "# contention: step" in text and "compute.contention: the step kernel's slow-down" in text
    # not measured: no [compute]
    assert simulate([*argv[:-2], "--contention-repeat", "0"]) == 0
    assert load_network(out, 2).contention == () and "[compute]" not in out.read_text()


@pytest.mark.skipif(hc.world().Get_size() != 1, reason="runs without mpiexec")
def test_calibrate_under_the_simulator_recovers_its_memory_rate(tmp_path: Path, capsys) -> None:
    """On one simulated node whose network gives node memory a rate, the allreduce shm is timed
    and the rate written back (compute none: the fit is exact); without the rate, it is not
    measured, and the file says why."""
    from hpcdl.simulate import main as simulate

    net = tmp_path / "node.toml"
    net.write_text(
        "ranks_per_node = 0\n[intra]\nlatency_us = 2.0\nbandwidth_GBps = 10.0\nmemory_GBps = 15.0\n"
    )
    out = tmp_path / "out.toml"
    argv = ["-n", "3", "--network", str(net), "--compute", "none", "-m", "hpcdl.bench", "calibrate"]
    argv += [
        "--out",
        str(out),
        "--sizes",
        "8",
        "64K",
        "1M",
        "4M",
        "--repeat",
        "2",
        "--contention-repeat",
        "0",
    ]
    assert simulate(argv) == 0
    got = load_network(out, 3).describe()["intra"]
    assert got["memory_GBps"] == pytest.approx(15.0, rel=1e-3)
    assert got["latency_us"] == pytest.approx(2.0, rel=1e-3)
    assert "memory: 15 GB/s read plus written per rank (3 ranks at once)" in capsys.readouterr().out
    net.write_text("ranks_per_node = 0\n[intra]\nlatency_us = 2.0\nbandwidth_GBps = 10.0\n")
    assert simulate(argv) == 0
    assert "memory_GBps" not in load_network(out, 3).describe()["intra"]
    assert "# memory: not measured (the simulated network gives node memory no rate" in out.read_text()


@pytest.mark.skipif(hc.world().Get_size() != 1, reason="runs without mpiexec")
def test_calibrate_needs_two_ranks(tmp_path: Path) -> None:
    out = tmp_path / "net.toml"
    with pytest.raises(ConfigError, match="run it under mpiexec -n 2 or more"):
        main(["calibrate", "--out", str(out)])
    assert not out.exists()
    with pytest.raises(ConfigError, match="--repeat must be a positive integer"):
        main(["calibrate", "--out", str(out), "--repeat", "0"])
    with pytest.raises(ConfigError, match=r"--contention-repeat must be >= 0 \(got -1\)"):
        main(["calibrate", "--out", str(out), "--contention-repeat", "-1"])
    with pytest.raises(ConfigError, match="the following arguments are required: --out"):
        main(["calibrate"])


@pytest.mark.mpi(min_size=2)
def test_calibrate_writes_a_network_file_that_loads(capsys: pytest.CaptureFixture[str]) -> None:
    comm = hc.world()
    rank = comm.Get_rank()
    tmp = Path(comm.bcast(tempfile.mkdtemp(prefix="hpcdl-net-") if rank == 0 else None, root=0))
    out = tmp / "here.toml"
    argv = [
        "calibrate",
        "--out",
        str(out),
        "--sizes",
        "8",
        "256K",
        "4M",  # sizes far apart, a few repeats: the fit needs times that grow even on a loaded machine
        "--repeat",
        "3",
        "--min-time",
        "0.002",
        "--contention-repeat",
        "1",
    ]
    rows = _run(argv)
    assert rows == comm.bcast(rows, root=0)  # every rank returns rank 0's rows
    hosts = comm.allgather(socket.gethostname())
    host = hosts.count(hosts[0])  # ranks on rank 0's host
    kernel_rows = [r for r in rows if "kernel" in r]
    memory_rows = [r for r in rows if "memory" in r]
    rows = [r for r in rows if "link" in r]
    rpn, intra_peer, inter_peer, _ = placement(hosts)
    links = [link for link, peer in (("intra", intra_peer), ("inter", inter_peer)) if peer is not None]
    assert [(r["link"], r["size_bytes"]) for r in rows] == [
        (k, s) for k in links for s in (8, 256 << 10, 4 << 20)
    ]
    for r in rows:
        assert r["one_way_s"] > 0 and r["round_trips"] >= 1 and r["repeat"] == 3
        assert r["model_s"] == pytest.approx(r["one_way_s"] - r["residual_s"])
    json.dumps(rows)

    net = load_network(out, comm.Get_size())  # written by rank 0 before any rank returned
    d = net.describe()
    assert net.name == "here" and net.ranks_per_node == rpn
    for link in links:
        assert d[link]["latency_us"] > 0 and d[link]["bandwidth_GBps"] > 0
        r = next(r for r in rows if r["link"] == link)
        assert d[link]["latency_us"] == pytest.approx(r["latency_us"], rel=1e-3)
    assert "measured by python -m hpcdl.bench calibrate" in d["source"]
    if rank == 0:
        printed = capsys.readouterr().out
        assert "alpha =" in printed and f"network written to {out}" in printed
    # the contention of rank 0's host: every kernel alone and at once, a factor per rank count
    if host > 1:
        assert [(r["kernel"], r["ranks_at_once"]) for r in kernel_rows] == [
            (k, n) for k in KERNELS for n in levels(host)
        ]
        for r in kernel_rows:
            assert r["samples"] == r["ranks_at_once"] and r["median_s"] > 0 and 0 < r["cpu_share"] <= 1
        assert len(net.contention) == host and net.contention[0] == 1.0 and min(net.contention) >= 1.0
        step = {r["ranks_at_once"]: r["slowdown"] for r in kernel_rows if r["kernel"] == "step"}
        assert net.contention[-1] == max(1.0, round(step[host], 3))
        assert "# contention: step" in out.read_text()
    else:
        assert kernel_rows == [] and net.contention == ()
    # the memory rate of rank 0's host, where its ranks share node memory: the shm allreduce timed
    # (unless /dev/shm has no room for it: a container's, which the file says)
    if rpn == 0 and "# memory: not measured (node memory: " not in out.read_text():
        assert [(r["memory"], r["size_bytes"], r["ranks"]) for r in memory_rows] == [
            ("shm", s, host) for s in (256 << 10, 4 << 20)
        ]
        assert d["intra"]["memory_GBps"] == pytest.approx(memory_rows[0]["memory_GBps"], rel=1e-3)
        assert d["intra"]["memory_GBps"] > 0 and "# memory: the allreduce shm on" in out.read_text()

    # an --out that cannot be written stops every rank before the measurement
    with pytest.raises(FileError, match="does not exist"):
        _run(["calibrate", "--out", str(tmp / "absent" / "net.toml"), "--sizes", "8", "64K"])
    comm.Barrier()
    if rank == 0:
        out.unlink()
        tmp.rmdir()


def _run(argv: list[str]) -> list[dict[str, Any]]:
    """The rows of a ``python -m hpcdl.bench`` command line, run in this process."""
    args = build_parser().parse_args(argv)
    return SUBCOMMANDS[args.command].run(args)
