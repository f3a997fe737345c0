"""``bench calibrate``: ping-pong latency and bandwidth of this system, written as a simulator network file.

Run under mpiexec with 2 or more ranks. Rank 0 ping-pongs with the first rank on its own
host (the intra-node pair: shared memory) and with the first rank on another host (the
inter-node pair), when there is one; every size is timed as ``repeat`` samples of enough
round trips to last ``min_time``, and the one-way time is half a round trip, the fastest
of the samples (a scheduler's quantum or another process only ever adds time: on a loaded
node the median of small pings can outlast a large transfer). The fit is Hockney's
``T(S) = alpha + S / B``: alpha is the median one-way time of the tiny sizes (up to 1 KiB),
and ``1 / B`` the slope through ``(0, alpha)`` that minimises the *relative* residuals of
the larger sizes (so that medium and large messages count alike).
Rank 0 prints the fit and the residual per size, and writes a TOML file that
``python -m hpcdl.simulate --network FILE`` loads (:func:`hpcdl.sim.network.load_network`):
``ranks_per_node`` from the host names (0 when every rank is on one host), ``[intra]`` and
``[inter]`` as measured, the date, hosts and MPI library in ``source``.

When rank 0's host has several ranks, it also measures the compute contention of a node
(:mod:`hpcdl.bench.contention`: kernels timed on rank 0 alone and on the host's ranks at
once) and writes ``[compute] contention``, the slow-down of hpcdl's training step by the
number of ranks on a node, with every kernel's figures as comments. And it measures the rate
at which those ranks reduce in the memory they share (:func:`memory_rate`: the allreduce
``"shm"`` timed at the sizes from 64 KiB up), written as ``[intra] memory_GBps``, by which the
simulator charges ``"shm"`` and ``auto`` prices it there.
"""

from __future__ import annotations

import datetime
import math
import socket
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hpcdl.atomic import check_writable, write_text_atomic
from hpcdl.bench import contention
from hpcdl.comm import Communicator, on_root, world, wtime
from hpcdl.driver.cli import parse_size, positive_float
from hpcdl.errors import ConfigError, NodeMemoryError
from hpcdl.sim.network import load_network, network_toml, parse_network

__all__ = [
    "COLD_BYTES",
    "DEFAULT_SIZES",
    "MEMORY_MIN",
    "TINY",
    "add_parser",
    "calibrate",
    "fit",
    "fit_memory",
    "memory_rate",
    "placement",
    "pingpong",
    "run",
]

#: 8 bytes to 16 MiB, powers of 8 and 4 (gradient buckets reach megabytes): the default ``--sizes``
DEFAULT_SIZES: tuple[int, ...] = (8, 64, 512, 4096, 32768, 262144, 1 << 20, 4 << 20, 16 << 20)
#: sizes up to this many bytes are "tiny": alpha is the median of their one-way times
TINY = 1024
#: the smallest size may not exceed this (alpha is measured on it when no size is tiny)
MAX_LATENCY_SIZE = 4096
#: the memory rate is fitted on the sizes from this many bytes up (below, the barriers dominate)
MEMORY_MIN = 64 << 10
#: bytes of node memory per rank that the memory rate's calls cycle through: more than a cache
COLD_BYTES = 64 << 20
_TAG = 77


def placement(hosts: Sequence[str]) -> tuple[int, int | None, int | None, str | None]:
    """Where the ranks are, from each rank's host name.

    Args:
        hosts: the host name of every world rank.

    Returns:
        ``(ranks_per_node, intra_peer, inter_peer, note)``: ranks per node as the simulator
        counts them (0: every rank on one host; otherwise the number of ranks on rank 0's
        host), the first rank sharing rank 0's host and the first on another host (None
        when there is none), and a note when the ranks are not in consecutive blocks of
        equal size per host (the simulator's layout), else None.
    """
    n = len(hosts)
    h0 = hosts[0]
    intra = next((r for r in range(1, n) if hosts[r] == h0), None)
    inter = next((r for r in range(1, n) if hosts[r] != h0), None)
    if inter is None:
        return 0, intra, None, None
    k = hosts.count(h0)
    blocks = [hosts[b : b + k] for b in range(0, n, k)]
    if all(len(set(b)) == 1 for b in blocks) and len({b[0] for b in blocks}) == len(blocks):
        return k, intra, inter, None
    note = (
        f"the ranks are not in consecutive blocks of {k} per host (hosts by rank: "
        f"{', '.join(hosts[:8])}{', ...' if n > 8 else ''}); the simulator puts ranks r with the "
        f"same r // {k} on one node"
    )
    return k, intra, inter, note


def pingpong(
    comm: Communicator, peer: int, sizes: Sequence[int], repeat: int, min_time: float
) -> list[dict[str, Any]]:
    """One-way times between rank 0 and ``peer`` (collective: the other ranks only wait).

    Each size: two warm-up round trips; rank 0 times three more and picks the number of
    round trips per sample (at least ``min_time`` seconds, 1 to 100,000), which it sends to
    ``peer``; then ``repeat`` samples.

    Returns:
        One row per size (the same on every rank): ``size_bytes``, ``one_way_s`` (the fastest
        sample: waits for the scheduler or another process only ever add time, so the fastest
        is the link's own), ``median_s``, ``max_s``, ``round_trips`` per sample, ``repeat``.
    """
    rank = comm.Get_rank()
    rows: list[dict[str, Any]] = []
    if rank in (0, peer):
        other = peer if rank == 0 else 0
        count = np.zeros(1, dtype=np.int64)
        for nbytes in sizes:
            buf = np.zeros(nbytes, dtype=np.uint8)

            def round_trips(n: int, buf: np.ndarray = buf) -> None:
                for _ in range(n):
                    if rank == 0:
                        comm.Send(buf, other, _TAG)
                        comm.Recv(buf, other, _TAG)
                    else:
                        comm.Recv(buf, other, _TAG)
                        comm.Send(buf, other, _TAG)

            round_trips(2)
            t0 = wtime()
            round_trips(3)
            if rank == 0:
                per = max((wtime() - t0) / 3, 1e-9)
                count[0] = min(100_000, max(1, math.ceil(min_time / per)))
                comm.Send(count, other, _TAG)
            else:
                comm.Recv(count, 0, _TAG)
            inner = int(count[0])
            samples = []
            for _ in range(repeat):
                t0 = wtime()
                round_trips(inner)
                samples.append((wtime() - t0) / (2 * inner))
            rows.append(
                {
                    "size_bytes": nbytes,
                    "one_way_s": min(samples),
                    "median_s": statistics.median(samples),
                    "max_s": max(samples),
                    "round_trips": inner,
                    "repeat": repeat,
                }
            )
    return comm.bcast(rows if rank == 0 else None, root=0)


def fit(sizes: Sequence[int], times: Sequence[float]) -> tuple[float, float]:
    """Hockney's ``T(S) = alpha + S / B`` through measured one-way times.

    ``alpha`` is the median time of the tiny sizes (up to :data:`TINY` bytes; the smallest
    size when none is that small): one noisy sample does not set it. ``1 / B`` is the slope
    through ``(0, alpha)`` that minimises the relative residuals
    ``sum(((T - alpha - S / B) / T) ** 2)`` of the other sizes.

    Args:
        sizes: message sizes in bytes (a tiny one and larger ones).
        times: one-way seconds per size.

    Returns:
        ``(alpha_s, bandwidth_Bps)``: seconds and bytes per second, both positive.

    Raises:
        ConfigError: a smallest size above :data:`MAX_LATENCY_SIZE`, no size above the
            tiny ones, or times that do not grow with the size.
    """
    pairs = sorted(zip(sizes, times))
    s0 = pairs[0][0]
    if s0 > MAX_LATENCY_SIZE:
        raise ConfigError(
            f"the smallest of --sizes is {s0} bytes; alpha is the time of a tiny message: "
            f"add a size of at most {MAX_LATENCY_SIZE} bytes, e.g. 8"
        )
    tiny = [t for s, t in pairs if s <= max(s0, TINY)]
    rest = [(s, t) for s, t in pairs if s > max(s0, TINY)]
    if not rest:
        raise ConfigError(
            f"--sizes needs sizes above {max(s0, TINY)} bytes too (B is fitted on them), e.g. 64K 1M 4M"
        )
    alpha = statistics.median(tiny)
    num = den = 0.0
    for s, t in rest:
        x, y = s / t, (t - alpha) / t
        num += x * y
        den += x * x
    if alpha <= 0 or num <= 0:
        raise ConfigError(
            "the one-way times do not grow with the size (no bandwidth to fit): "
            "add larger --sizes (e.g. 1M 4M) or raise --repeat"
        )
    return alpha, den / num


def fit_memory(sizes: Sequence[int], times: Sequence[float]) -> tuple[float, float] | None:
    """The memory rate of the allreduce ``"shm"``: ``T(n) = c + 2 n / M`` (each rank reads and
    writes ``2 n`` bytes of an ``n``-byte vector) through the times of two sizes or more,
    ``c`` and ``1 / M`` by least squares of the *relative* residuals, as :func:`fit`'s.

    ``c`` is the call's fixed cost: its barriers, and the Python around them, which the
    simulator measures as compute (only ``M`` goes into the network file).

    Returns:
        ``(c_s, M_bytes_per_second)``; None when the times do not grow with the size.
    """
    a = b = d = e = f = 0.0  # sums of w, w x, w x^2, w t, w x t with x = 2 n, w = 1 / t^2
    for s, t in zip(sizes, times):
        x, w = 2.0 * s, 1.0 / (t * t)
        a, b, d, e, f = a + w, b + w * x, d + w * x * x, e + w * t, f + w * x * t
    det = a * d - b * b
    if len(sizes) < 2 or det <= 0:
        return None
    slope = (a * f - b * e) / det
    return ((e - b * slope) / a, 1.0 / slope) if slope > 0 else None


def memory_rate(
    comm: Communicator,
    host: Sequence[int],
    sizes: Sequence[int],
    repeat: int,
    min_time: float,
) -> tuple[float | None, list[dict[str, Any]], str]:
    """How fast the ranks of rank 0's host reduce in the memory they share (collective).

    The ranks ``host`` time the allreduce ``"shm"`` in place, taking the mean as the exchange
    does, at each of ``sizes`` from :data:`MEMORY_MIN` up, all at once, as in a run (so the
    rate is a rank's share of the node's memory bandwidth at that many ranks). Each call
    takes the next vector of a block of :data:`COLD_BYTES` per rank (at least two vectors),
    so that it finds its buffers out of the caches, as a run's buckets are after the
    backward pass that filled them; a vector reduced again and again in cache went 2-3x
    faster on the machine this was written on. :func:`fit_memory` gives the rate.

    Returns:
        ``(bytes_per_second, rows, why)``, the same on every rank: None and ``why`` (what
        to do) when nothing was measured or the times did not grow; a row per size:
        ``memory``, ``size_bytes``, ``ranks``, ``time_s`` (the fastest of ``repeat``
        samples of about ``min_time``), ``median_s``, ``calls`` per sample, ``model_s``,
        ``residual_s``, ``memory_GBps``, ``fixed_s`` (the fit's fixed cost per call).
    """
    from hpcdl.comm.collectives import NODE_ALGORITHMS, available_algorithms

    rank = comm.Get_rank()
    sizes = sorted({s // 4 * 4 for s in sizes if s >= MEMORY_MIN})
    sub = comm.Split(0 if rank in host else 1, rank)
    out: tuple[float | None, list[dict[str, Any]], str] = (None, [], "")
    try:
        if len(sizes) < 2:
            out = (None, [], f"fewer than two --sizes of {MEMORY_MIN // 1024} KiB or more (add 1M 4M)")
        elif rank in host and not set(NODE_ALGORITHMS) <= set(available_algorithms(sub)):
            simulated = getattr(sub, "alpha_beta", None) is not None
            why = (
                "the simulated network gives node memory no rate, intra.memory_GBps"
                if simulated
                else "these ranks have no memory they can all read (node memory)"
            )
            out = (None, [], why)
        elif rank in host:
            try:
                out = _time_memory(sub, sizes, repeat, min_time)
            except NodeMemoryError as err:  # on every rank of the host, before anything was timed
                out = (None, [], str(err))
    finally:
        sub.Free()
    return comm.bcast(out if rank == 0 else None, root=0)


def _time_memory(
    comm: Communicator, sizes: Sequence[int], repeat: int, min_time: float
) -> tuple[float | None, list[dict[str, Any]], str]:
    """:func:`memory_rate`'s timing on the host's ranks ``comm``."""
    from hpcdl.comm.collectives import Collectives
    from hpcdl.comm.collectives.timing import calls_for, time_per_call

    ranks = comm.Get_size()
    # simulated ranks are charged by the network's rate, not timed: no caches to leave
    cold = COLD_BYTES if getattr(comm, "memory_pass", None) is None else 0
    block_len = max(cold, 2 * max(sizes)) // 4
    times: dict[int, list[float]] = {}
    calls: dict[int, int] = {}
    with Collectives(comm, "shm") as coll:
        block = coll.node_empty(block_len, "float32")
        block[...] = 1.0  # the mean of ones stays one: no overflow, no denormals
        for nbytes in sizes:
            n = nbytes // 4
            slots = block_len // n
            turn = [0]

            def call(n: int = n, slots: int = slots, turn: list[int] = turn) -> None:
                at = turn[0] % slots * n
                turn[0] += 1
                coll.Allreduce(block[at : at + n], block[at : at + n], scale=1.0 / ranks)

            calls[nbytes] = calls_for(comm, call, min_time)
            times[nbytes] = [time_per_call(comm, call, calls[nbytes]) for _ in range(repeat)]
    best = [min(times[s]) for s in sizes]
    fitted = fit_memory(sizes, best)
    overhead, rate = fitted if fitted is not None else (0.0, None)
    rows = []
    for s, t in zip(sizes, best):
        model = overhead + 2 * s / rate if rate else None
        rows.append(
            {
                "memory": "shm",
                "size_bytes": s,
                "ranks": ranks,
                "time_s": t,
                "median_s": statistics.median(times[s]),
                "calls": calls[s],
                "model_s": model,
                "residual_s": t - model if model is not None else None,
                "memory_GBps": rate / 1e9 if rate else None,
                "fixed_s": overhead if rate else None,
            }
        )
    why = "" if rate else "the times do not grow with the size: add larger --sizes or raise --repeat"
    return rate, rows, why


_WHAT = "the network file"


def _check_out(out: Path) -> None:
    """Raise if ``out`` cannot be written (before the measurement).

    Raises:
        ConfigError: ``out`` is a directory or does not end in ``.toml``.
        FileError: its directory is missing or does not let us create a file.
    """
    if out.is_dir():
        raise ConfigError(f"--out {out} is a directory: give a file name such as {out / 'net.toml'}")
    if out.suffix != ".toml":
        raise ConfigError(f"--out {out} should end in .toml (the simulator's --network reads TOML files)")
    check_writable(out, what=_WHAT)


def calibrate(
    comm: Communicator,
    out: Path,
    sizes: Sequence[int] = DEFAULT_SIZES,
    repeat: int = 15,
    min_time: float = 0.005,
    name: str | None = None,
    contention_repeat: int = 9,
) -> list[dict[str, Any]]:
    """Measure alpha and B of this system's links and write them as a network file (collective).

    Args:
        comm: the world (2 ranks or more).
        out: the TOML file to write (rank 0 writes it atomically).
        sizes: message sizes in bytes; the smallest gives alpha.
        repeat: samples per size (the median is used).
        min_time: seconds per sample, at least.
        name: the model's name (default: the file's stem).
        contention_repeat: samples per kernel and rank count of the compute contention
            (0: not measured, no ``[compute]`` written; nor with one rank on rank 0's host).

    Returns:
        One row per (link, size) with the fit, then one per (kernel, ranks at once) of the
        contention (:func:`hpcdl.bench.contention.measure`); the same on every rank.

    Raises:
        ConfigError: one rank, a bad size list or ``out``, or a failed fit (on every rank).
        FileError: ``out`` cannot be written: checked before the measurement, and again
            when it is written (on every rank; an older file there is kept).
    """
    size = comm.Get_size()
    if size < 2:
        raise ConfigError(
            "bench calibrate measures ping-pong between two ranks: run it under mpiexec -n 2 or more "
            "(on a cluster, with ranks on two nodes to measure the network too)"
        )
    on_root(comm, lambda: _check_out(out))
    hosts = comm.allgather(socket.gethostname())
    rpn, intra_peer, inter_peer, note = placement(hosts)
    rows: list[dict[str, Any]] = []
    links: dict[str, dict[str, float]] = {}
    error = None
    for link, peer in (("intra", intra_peer), ("inter", inter_peer)):
        if peer is None:
            continue
        measured = pingpong(comm, peer, sorted(set(sizes)), repeat, min_time)
        try:
            alpha, bandwidth = fit([r["size_bytes"] for r in measured], [r["one_way_s"] for r in measured])
        except ConfigError as err:
            error = str(err)
            break
        links[link] = {"latency_us": round(alpha * 1e6, 4), "bandwidth_GBps": round(bandwidth / 1e9, 4)}
        for r in measured:
            model = alpha + r["size_bytes"] / bandwidth
            rows.append(
                {
                    "link": link,
                    "peer": peer,
                    **r,
                    "model_s": model,
                    "residual_s": r["one_way_s"] - model,
                    "latency_us": alpha * 1e6,
                    "bandwidth_GBps": bandwidth / 1e9,
                }
            )
    if error is not None:
        raise ConfigError(error)
    host = [r for r, h in enumerate(hosts) if h == hosts[0]]
    kernel_rows = (
        contention.measure(comm, host, contention_repeat) if contention_repeat and len(host) > 1 else []
    )
    memory: tuple[float | None, list[dict[str, Any]], str] = (None, [], "")
    if "intra" in links:
        memory = memory_rate(comm, host, sizes, repeat, min_time)
        if memory[0]:
            links["intra"]["memory_GBps"] = round(memory[0] / 1e9, 4)
    on_root(comm, lambda: _report(rows, links, out, name, rpn, hosts, note, kernel_rows, memory))
    return rows + kernel_rows + memory[1]


def _report(
    rows: list[dict[str, Any]],
    links: dict[str, dict[str, float]],
    out: Path,
    name: str | None,
    rpn: int,
    hosts: list[str],
    note: str | None,
    kernel_rows: list[dict[str, Any]],
    memory: tuple[float | None, list[dict[str, Any]], str] = (None, [], ""),
) -> None:
    """Print the fit (and the contention) and write ``out`` atomically (rank 0).

    Raises:
        ConfigError: the file written would not load (a bug).
        FileError: ``out`` cannot be written (an older file there is kept).
    """
    try:
        from hpcdl.comm.mpi import library_version

        library = " ".join(library_version().split())
    except ImportError:  # pragma: no cover  (mpi4py is a dependency)
        library = "unknown MPI library"
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    nodes = sorted(set(hosts))
    r0 = rows[0]
    lines = []
    for link, values in links.items():
        peer = next(r["peer"] for r in rows if r["link"] == link)
        print(
            f"bench calibrate: {link}-node ping-pong, rank 0 <-> rank {peer}, fastest of {r0['repeat']} "
            "samples per size"
        )
        print(f"{'size':>10}{'one-way us':>12}{'model us':>11}{'residual us':>13}{'residual':>10}")
        for r in (r for r in rows if r["link"] == link):
            rel = r["residual_s"] / r["one_way_s"]
            line = (
                f"{r['size_bytes']:>10}{1e6 * r['one_way_s']:>12.3f}{1e6 * r['model_s']:>11.3f}"
                f"{1e6 * r['residual_s']:>13.3f}{100 * rel:>9.1f}%"
            )
            print(line)
            lines.append(f"{link}: {line}")
        print(f"{link}: alpha = {values['latency_us']:.4g} us, B = {values['bandwidth_GBps']:.4g} GB/s")
    shown = ", ".join(nodes[:4]) + (", ..." if len(nodes) > 4 else "")
    where = f"{len(hosts)} ranks on {len(nodes)} host(s) ({shown})"
    measured = " and ".join(f"{k}-node" for k in links)
    data: dict[str, Any] = {
        "name": name or out.stem,
        "source": (
            f"measured by python -m hpcdl.bench calibrate on {date}: {where}, {library}; {measured} "
            f"ping-pong from rank 0, one-way time = half a round trip, fastest of {r0['repeat']} samples "
            "per size; alpha = median time of the sizes up to 1 KiB, 1/B = relative least-squares slope"
        ),
        "ranks_per_node": rpn,
        **links,
        "topology": {"kind": "switch"},
    }
    comments = [
        f"written by `python -m hpcdl.bench calibrate` on {date}; load it with --network {out}",
        "fit per size: size, one-way us, model us, residual us, residual",
        *lines,
    ]
    if kernel_rows:
        data["compute"] = {"contention": _report_contention(kernel_rows, comments)}
    if "intra" in links:
        _report_memory(memory, comments)
    if rpn == 0:
        comments.append("ranks_per_node = 0: every rank was on one host, so all ranks are on one node")
    if note:
        comments.append(f"note: {note}")
        print(f"note: {note}")
    parse_network(data, out.stem, where=f"network file {out}")  # what we write must load
    write_text_atomic(out, network_toml(data, comments), what=_WHAT)
    load_network(out)
    print(f"network written to {out} (ranks_per_node = {rpn})")


def _report_memory(memory: tuple[float | None, list[dict[str, Any]], str], comments: list[str]) -> None:
    """Print the memory rate's fit per size (or why there is none), add it to ``comments``."""
    rate, rows, why = memory
    if rate is None:
        line = f"memory: not measured ({why}); without intra.memory_GBps the simulator's auto never picks shm"
        print(line)
        comments.append(line)
        return
    ranks = rows[0]["ranks"]
    print(
        f"bench calibrate: memory of rank 0's host, the allreduce shm in place on {ranks} ranks at once, "
        "fastest repetition per size"
    )
    comments.append(
        f"memory: the allreduce shm on {ranks} ranks at once; size, us, model us, residual us, residual"
    )
    print(f"{'size':>10}{'us':>12}{'model us':>11}{'residual us':>13}{'residual':>10}")
    for r in rows:
        line = (
            f"{r['size_bytes']:>10}{1e6 * r['time_s']:>12.3f}{1e6 * r['model_s']:>11.3f}"
            f"{1e6 * r['residual_s']:>13.3f}{100 * r['residual_s'] / r['time_s']:>9.1f}%"
        )
        print(line)
        comments.append(f"memory: {line}")
    fixed = 1e6 * rows[0]["fixed_s"]
    line = (
        f"memory: {rate / 1e9:.4g} GB/s read plus written per rank ({ranks} ranks at once), "
        f"a fixed {fixed:.3g} us per call"
    )
    print(line)
    comments.append(line)


def _report_contention(kernel_rows: list[dict[str, Any]], comments: list[str]) -> list[float]:
    """Print the kernels' slow-downs, add them to ``comments``; return ``compute.contention``."""
    host = max(r["ranks_at_once"] for r in kernel_rows)
    n = kernel_rows[0]["samples"]
    print(
        f"bench calibrate: compute contention on rank 0's host ({host} ranks): each kernel on rank 0 alone "
        f"and on k ranks at once, median of {n} samples per rank"
    )
    print(f"{'kernel':<8}{'ranks':>6}{'median ms':>11}{'min..max ms':>17}{'slow-down':>11}{'CPU share':>11}")
    comments.append(
        f"contention: kernel, ranks at once, median ms, min..max ms, slow-down, CPU share "
        f"({n} samples per rank)"
    )
    for r in kernel_rows:
        span = f"{1e3 * r['min_s']:.2f}..{1e3 * r['max_s']:.2f}"
        line = (
            f"{r['kernel']:<8}{r['ranks_at_once']:>6}{1e3 * r['median_s']:>11.3f}{span:>17}"
            f"{r['slowdown']:>11.3f}{r['cpu_share']:>11.3f}"
        )
        print(line)
        comments.append(f"contention: {line}")
    busy = min(r["cpu_share"] for r in kernel_rows)
    if busy < 0.95:
        note = (
            f"the ranks did not have their cores to themselves (CPU time {busy:.2f} of the wall time): "
            "the slow-downs are not contention alone; calibrate on an otherwise idle node"
        )
        print(f"note: {note}")
        comments.append(f"note: {note}")
    kernel = contention.FACTOR_KERNEL
    out = contention.factors(
        {r["ranks_at_once"]: r["slowdown"] for r in kernel_rows if r["kernel"] == kernel}, host
    )
    comments.append(
        f"compute.contention: the {kernel} kernel's slow-down (hpcdl's mlp32 training step, batch 128) "
        "by ranks on a node, linear between the counts measured, at least 1"
    )
    print(f"contention ({kernel} kernel, by ranks on a node): {out}")
    return out


def add_parser(sub: Any) -> None:
    """Register ``calibrate`` and its options on the ``bench`` subparsers."""
    p = sub.add_parser(
        "calibrate",
        help="measure ping-pong latency and bandwidth; write a network file for the simulator",
        description="Measure this system's ping-pong latency and bandwidth (under mpiexec, 2 ranks or more) "
        "and write them as a simulator network file.",
    )
    p.add_argument(
        "--out", type=Path, required=True, metavar="NET.toml", help="the network file to write (TOML)"
    )
    p.add_argument(
        "--sizes",
        nargs="+",
        type=parse_size,
        default=list(DEFAULT_SIZES),
        metavar="SIZE",
        help="message sizes in bytes: 8, 4K, 1M, ...; the smallest gives alpha (default: 8 to 16M)",
    )
    p.add_argument("--repeat", type=int, default=15, help="samples per size; the median is used")
    p.add_argument("--min-time", type=positive_float, default=0.005, help="seconds per sample, at least")
    p.add_argument("--name", default=None, help="the model's name in the file (default: the file's stem)")
    p.add_argument(
        "--contention-repeat",
        type=int,
        default=9,
        metavar="N",
        help="samples per kernel and rank count of the compute contention of rank 0's host "
        "(0: not measured, no [compute] written)",
    )


def run(args: Any) -> list[dict[str, Any]]:
    """Run ``bench calibrate`` with parsed ``args``; returns the rows."""
    if args.repeat < 1:
        raise ConfigError("--repeat must be a positive integer")
    if args.contention_repeat < 0:
        raise ConfigError(f"--contention-repeat must be >= 0 (got {args.contention_repeat}); 0: not measured")
    return calibrate(
        world(), args.out, args.sizes, args.repeat, args.min_time, args.name, args.contention_repeat
    )
