"""``auto`` tuned where it runs (:mod:`hpcdl.comm.collectives.tune`): the α-β model against the
simulator, and the cache's reuse, repair and refusal of entries that are not this machine's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import hpcdl.comm as hc
from hpcdl.comm.collectives import ALGORITHMS, Collectives
from hpcdl.comm.collectives.tune import (
    CACHE_FORMAT,
    analytic_table,
    analytic_time,
    cache_key,
    default_cache,
    tuned_table,
)
from hpcdl.comm.machine import describe
from hpcdl.sim.compute import make_compute
from hpcdl.sim.engine import simulate
from hpcdl.sim.network import load_network

ALPHA, BETA = 2e-6, 1e-9  # 2 us, 1 GB/s
SIZES = (4096, 65536)


@pytest.fixture
def net(tmp_path: Path) -> Path:
    """One rank per node on a switch: every pairwise exchange has the link to itself."""
    path = tmp_path / "line.toml"
    path.write_text(
        'source = "a test network"\nranks_per_node = 1\n'
        "[intra]\nlatency_us = 2.0\nbandwidth_GBps = 1.0\n"
        "[inter]\nlatency_us = 2.0\nbandwidth_GBps = 1.0\n"
        '[topology]\nkind = "switch"\n'
    )
    return path


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_the_alpha_beta_model_is_the_simulators_time(net: Path, n: int, algorithm: str) -> None:
    """Each algorithm's closed form against the simulated allreduce (compute free; Rabenseifner's
    blocks and the ring's chunks of equal size): equal for the ring and at powers of two. Folded
    (3, 5 ranks), the simulator is slower by the fold's incast, which the model leaves out: the
    ranks that were not folded send their first round to an odd rank still receiving its
    partner's vector, and the two share its link (at most a vector per round)."""
    nbytes = 4 * 120 * 1024  # elements divisible into n chunks and q blocks for every n here

    def body() -> float:
        comm = hc.world()
        x = np.ones(nbytes // 4, dtype=np.float32)
        with Collectives(comm, algorithm) as coll:
            comm.Barrier()
            t0 = hc.wtime()
            coll.Allreduce(x, x)
            return hc.wtime() - t0

    result = simulate(n, body, network=load_network(net, n), compute=make_compute("none"))
    want = analytic_time(algorithm, nbytes, n, ALPHA, BETA)
    got = max(result.results)
    if algorithm == "ring" or n & (n - 1) == 0:
        assert got == pytest.approx(want, rel=1e-6)
    else:
        rounds = (n.bit_length() - 1) * (2 if algorithm == "rabenseifner" else 1)
        assert want < got <= want + rounds * nbytes * BETA


GAMMA = 1 / 4e9  # 4 GB/s read plus written per rank


def _node(tmp_path: Path, memory: bool = True, per_node: int = 0) -> Path:
    """The ranks on nodes of ``per_node`` (0: all on one) sharing a 2 us, 1 GB/s link and, with
    ``memory``, reading plus writing node memory at 4 GB/s."""
    path = tmp_path / "node.toml"
    text = f"ranks_per_node = {per_node}\n[intra]\nlatency_us = 2.0\nbandwidth_GBps = 1.0\n"
    text += "memory_GBps = 4.0\n" if memory else ""
    text += "[inter]\nlatency_us = 2.0\nbandwidth_GBps = 1.0\n" if per_node else ""
    path.write_text(text)
    return path


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
def test_the_shm_model_is_the_simulators_time(tmp_path: Path, n: int) -> None:
    """``shm`` on one node: two dissemination barriers (the first's messages carry the place) and a
    pass of ``2 n`` bytes charged at the network's memory rate, exactly, at any rank count."""
    nbytes = 4 * 120 * 1024

    def body() -> float:
        comm = hc.world()
        with Collectives(comm, "shm") as coll:
            x = coll.node_empty(nbytes // 4, np.float32)
            x[...] = comm.Get_rank() + 1
            comm.Barrier()
            t0 = hc.wtime()
            coll.Allreduce(x, x)
            assert np.all(x == n * (n + 1) // 2)
            return hc.wtime() - t0

    result = simulate(n, body, network=load_network(_node(tmp_path), n), compute=make_compute("none"))
    assert max(result.results) == pytest.approx(analytic_time("shm", nbytes, n, ALPHA, BETA, GAMMA), rel=1e-9)


def test_with_a_memory_rate_every_algorithm_pays_for_its_reductions() -> None:
    """``gamma`` prices the message algorithms' reductions too (3 bytes moved per byte reduced),
    so that ``shm``'s pass is not weighed against free reductions; without it, none cost."""
    n = 1 << 20
    for algorithm, reduced in [("ring", n / 2), ("doubling", n), ("rabenseifner", n / 2), ("mpi", n / 2)]:
        plain = analytic_time(algorithm, n, 2, ALPHA, BETA)
        assert analytic_time(algorithm, n, 2, ALPHA, BETA, GAMMA) == pytest.approx(
            plain + 3 * reduced * GAMMA
        )
    # folded (3 ranks, q = 2): half a vector among the two, and the fold a whole vector more
    plain = analytic_time("rabenseifner", n, 3, ALPHA, BETA)
    assert analytic_time("rabenseifner", n, 3, ALPHA, BETA, GAMMA) == pytest.approx(plain + 4.5 * n * GAMMA)
    with pytest.raises(ValueError, match="only with gamma"):
        analytic_time("shm", n, 2, ALPHA, BETA)


def test_in_the_simulator_auto_prices_shm_where_the_network_gives_node_memory_a_rate(tmp_path: Path) -> None:
    """One node with a memory rate: ``shm`` is among the algorithms and wins the large sizes (here,
    at 4 ranks, its ``2 n γ`` against the ring's ``1.5 n β + 2.25 n γ``); without the rate, or
    over two nodes, ``auto`` does not price it."""
    sizes = (1024, 4 << 20)

    def body() -> dict:
        return tuned_table(hc.world(), sizes, cache="/nonexistent/never-written.json").table.to_dict()

    for memory, per_node, want in [(True, 0, "shm"), (False, 0, None), (True, 2, None)]:
        net = load_network(_node(tmp_path, memory, per_node), 4)
        got = simulate(4, body, network=net, compute=make_compute("none")).results[0]
        gamma = GAMMA if want else None
        algorithms = (*ALGORITHMS, "shm") if want else tuple(ALGORITHMS)
        assert got == analytic_table(sizes, 4, ALPHA, BETA, algorithms, gamma).to_dict()
        segments = got["ranks"]["4"]["segments"]
        assert (segments[-1]["algorithm"] == "shm") == (want == "shm")
        assert ("gamma_s_per_byte" in got["ranks"]["4"]["meta"]) == (want == "shm")


def test_the_analytic_table_takes_latency_bound_and_bandwidth_bound_sides() -> None:
    """Small messages: few rounds (doubling, or MPI's own, which is doubling there); large: the
    bandwidth-optimal ring or Rabenseifner (fewer rounds at 8 ranks: Rabenseifner)."""
    table = analytic_table((1024, 64 << 20), 8, ALPHA, BETA)
    assert table.choose(1024, 8) in ("doubling", "mpi")
    assert table.choose(64 << 20, 8) == "rabenseifner"
    assert table.meta[8]["source"] == "analytic"


def test_analytic_time_refuses_an_unknown_algorithm() -> None:
    with pytest.raises(ValueError, match="no α-β model"):
        analytic_time("tree", 1024, 4, ALPHA, BETA)


def test_in_the_simulator_auto_takes_the_networks_model_and_times_nothing(net: Path) -> None:
    def body() -> dict:
        tuning = tuned_table(hc.world(), SIZES, cache="/nonexistent/never-written.json")
        assert tuning.source == "analytic" and tuning.seconds == 0 and not tuning.timed
        return tuning.table.to_dict()

    result = simulate(4, body, network=load_network(net, 4), compute=make_compute("none"))
    assert result.results[0] == analytic_table(SIZES, 4, ALPHA, BETA).to_dict()
    assert all(r == result.results[0] for r in result.results)


# -- the cache (one process: its world of one times as N ranks would) ------------------------


def _entry(cache: Path) -> dict:
    data = json.loads(cache.read_text())
    assert data["format"] == CACHE_FORMAT
    (entry,) = data["entries"].values()
    return entry


def test_default_cache_is_under_xdg_cache_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache() == tmp_path / "hpcdl" / "auto-tables.json"
    monkeypatch.setenv("XDG_CACHE_HOME", "")
    assert default_cache() == Path.home() / ".cache" / "hpcdl" / "auto-tables.json"


def test_a_first_run_times_its_sizes_and_the_next_takes_them_from_the_cache(tmp_path: Path) -> None:
    comm = hc.world()
    cache = tmp_path / "sub" / "auto.json"  # its directory made on the way
    first = tuned_table(comm, SIZES, cache=cache, min_time=1e-4)
    assert first.source == "calibrated" and first.timed == SIZES and first.seconds > 0
    entry = _entry(cache)
    assert sorted(entry["times"]) == sorted(map(str, SIZES))
    assert all(sorted(t) == sorted(ALGORITHMS) for t in entry["times"].values())
    assert cache_key(entry["machine"]) in json.loads(cache.read_text())["entries"]
    again = tuned_table(comm, SIZES, cache=cache, min_time=1e-4)
    assert again.source == "cache" and not again.timed and again.seconds == 0
    assert again.table.segments == first.table.segments
    assert "calibrated" in again.lines[-1] and str(cache) in again.lines[-1]
    more = tuned_table(comm, (*SIZES, 1 << 20), cache=cache, min_time=1e-4)
    assert more.timed == (1 << 20,)  # only what the cache lacks
    always = tuned_table(comm, SIZES, mode="always", cache=cache, min_time=1e-4)
    assert always.timed == SIZES


def test_the_key_is_the_cpu_the_mpi_library_and_the_ranks(tmp_path: Path) -> None:
    comm = hc.world()
    cache = tmp_path / "auto.json"
    tuned_table(comm, SIZES, cache=cache, min_time=1e-4)
    machine = _entry(cache)["machine"]
    here = describe(comm, 1)
    assert machine == {k: here[k] for k in ("cpu", "mpi", "ranks", "ranks_per_node")}


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        ("{not json", "not JSON"),
        (json.dumps({"format": 99, "entries": {}}), "format 99"),
        (json.dumps({"entries": []}), 'no "entries"'),
    ],
)
def test_a_damaged_cache_is_ignored_with_one_line_and_rewritten(tmp_path: Path, damage, said: str) -> None:
    comm = hc.world()
    cache = tmp_path / "auto.json"
    cache.write_text(damage)
    tuning = tuned_table(comm, SIZES, cache=cache, min_time=1e-4)
    assert tuning.source == "calibrated"
    assert said in tuning.lines[0] and "ignored" in tuning.lines[0] and len(tuning.lines) == 2
    assert sorted(_entry(cache)["times"]) == sorted(map(str, SIZES))


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (lambda e: e["machine"].update(cpu="another CPU"), "another machine"),
        (lambda e: e.update(algorithms=["ring"]), "timed ring"),
        (lambda e: next(iter(e["times"].values())).update(ring=-1.0), "not a positive number"),
        (lambda e: e.update(algorithms=None), "no list of algorithms"),  # rank 0 must not raise: a hang
        (lambda e: e.update(date=3), "no date"),
    ],
)
def test_a_foreign_or_stale_entry_is_ignored_with_one_line(tmp_path: Path, change, said: str) -> None:
    comm = hc.world()
    cache = tmp_path / "auto.json"
    tuned_table(comm, SIZES, cache=cache, min_time=1e-4)
    data = json.loads(cache.read_text())
    (key,) = data["entries"]
    change(data["entries"][key])
    cache.write_text(json.dumps(data))
    tuning = tuned_table(comm, SIZES, cache=cache, min_time=1e-4)
    assert tuning.source == "calibrated" and tuning.timed == SIZES
    assert said in tuning.lines[0] and "ignored" in tuning.lines[0]
    assert _entry(cache)["machine"]["cpu"] == describe(comm, 1)["cpu"]  # replaced by this machine's
    assert tuned_table(comm, SIZES, cache=cache, min_time=1e-4).source == "cache"  # repaired


def test_a_cache_that_cannot_be_written_costs_a_line_not_the_run(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    tuning = tuned_table(hc.world(), SIZES, cache=blocker / "auto.json", min_time=1e-4)
    assert tuning.source == "calibrated"
    assert any("not cached" in line and "exchange.auto_cache" in line for line in tuning.lines)


def _store_many(cache: str, writer: int, count: int, start: Any) -> None:
    from hpcdl.comm.collectives import tune

    start.wait()  # both write at once
    for k in range(count):
        lines, _ = tune._store(Path(cache), f"writer={writer} | k={k}", {"times": {}})
        assert not lines


def test_jobs_calibrating_at_once_keep_each_others_entries(tmp_path: Path) -> None:
    """Two processes adding entries to one cache as fast as they can (two jobs on one machine):
    every entry of both is there at the end (each read-add-replace holds the lock)."""
    import multiprocessing

    cache, count = str(tmp_path / "auto.json"), 100
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Barrier(2)
    procs = [ctx.Process(target=_store_many, args=(cache, w, count, start)) for w in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    entries = json.loads(Path(cache).read_text())["entries"]
    assert sorted(entries) == sorted(f"writer={w} | k={k}" for w in range(2) for k in range(count))


def test_a_job_of_the_same_key_keeps_the_sizes_another_timed_meanwhile(tmp_path: Path) -> None:
    """Two jobs of one machine and rank count, each looking the entry up before the other stored
    it, each timing its own sizes: the entry ends with both's."""
    from hpcdl.comm.collectives import tune

    cache = tmp_path / "auto.json"
    machine = {k: "x" for k in tune.KEY_FIELDS}
    base = {"machine": machine, "algorithms": ["ring", "mpi"], "date": ""}
    tune._store(cache, "k", {**base, "times": {"4096": {"ring": 1e-5, "mpi": 2e-5}}})
    tune._store(cache, "k", {**base, "times": {"65536": {"ring": 3e-5, "mpi": 4e-5}}})
    (entry,) = json.loads(cache.read_text())["entries"].values()
    assert sorted(entry["times"]) == ["4096", "65536"]
    # an entry for other algorithms is replaced, not merged
    tune._store(cache, "k", {**base, "algorithms": ["ring"], "times": {"8": {"ring": 1e-6}}})
    (entry,) = json.loads(cache.read_text())["entries"].values()
    assert entry["times"] == {"8": {"ring": 1e-6}}


def test_a_file_system_without_flock_still_gets_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno
    import fcntl

    def no_flock(fd: Any, op: int) -> None:
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    tuning = tuned_table(hc.world(), SIZES, cache=tmp_path / "auto.json", min_time=1e-4)
    assert not any("not cached" in line for line in tuning.lines) and (tmp_path / "auto.json").exists()


def test_the_timed_winner_is_the_cached_fastest(tmp_path: Path) -> None:
    """The table is the cached times' fastest at each size: an entry that says doubling wins at
    4 KiB and the ring at 64 KiB gives exactly that table."""
    comm = hc.world()
    cache = tmp_path / "auto.json"
    tuned_table(comm, SIZES, cache=cache, min_time=1e-4)
    data = json.loads(cache.read_text())
    (entry,) = data["entries"].values()
    fast = {"4096": "doubling", "65536": "ring"}
    for size, times in entry["times"].items():
        for a in times:
            times[a] = 1e-3 if a == fast[size] else 2e-3
    cache.write_text(json.dumps(data))
    table = tuned_table(comm, SIZES, cache=cache).table
    assert table.segments[comm.Get_size()] == ((16384, "doubling"), (None, "ring"))  # sqrt(4096 * 65536)


def test_never_is_not_a_mode_to_call_it_with() -> None:
    with pytest.raises(ValueError, match="never"):
        tuned_table(hc.world(), SIZES, mode="never")


def test_bench_allreduces_summary_is_autos_worst_ratio_to_the_fastest() -> None:
    from hpcdl.bench.allreduce import auto_summary

    def row(size: int, algorithm: str, t: float) -> dict:
        return {"size_bytes": size, "algorithm": algorithm, "time_s": t, "auto_table": "calibrated",
                "calibration_s": 0.5}  # fmt: skip

    rows = [row(4096, "ring", 2.0), row(4096, "mpi", 1.0), row(4096, "auto", 3.0),
            row(65536, "ring", 1.0), row(65536, "mpi", 2.0), row(65536, "auto", 1.05),
            row(1 << 20, "ring", 1.0), row(1 << 20, "doubling", 0.8), row(1 << 20, "auto", 1.0)]  # fmt: skip
    line = auto_summary(rows)
    assert "worst 1.25x from 64K up (at 1M, where doubling is fastest)" in line
    assert "3.00x at any size" in line and "(0.50 s)" in line
    assert auto_summary([r for r in rows if r["algorithm"] != "auto"]) == ""


def test_sizes_are_timed_and_looked_up_as_whole_float32s(tmp_path: Path) -> None:
    tuning = tuned_table(hc.world(), (1000003, 6), cache=tmp_path / "auto.json", min_time=1e-4)
    assert tuning.timed == (4, 1000000)


def test_always_times_again_and_keeps_the_other_sizes(tmp_path: Path) -> None:
    comm, cache = hc.world(), tmp_path / "auto.json"
    tuned_table(comm, (4096, 65536), cache=cache, min_time=1e-4)
    assert tuned_table(comm, (4096,), mode="always", cache=cache, min_time=1e-4).timed == (4096,)
    assert sorted(_entry(cache)["times"]) == ["4096", "65536"]


def test_a_second_exchange_over_the_same_parameters_leaves_their_gradients_where_they_are() -> None:
    """The first exchange moves each p.grad into its buckets; a second one over the same parameters
    packs them from there instead of moving them again (its buckets would be the only ones filled)."""
    from hpcdl.models import build_model
    from hpcdl.parallel import BucketedExchange
    from hpcdl.rng import generator

    params = build_model("mlp", (16,), 4, rng=generator(0, "init"), depth=2, width=8).parameters()
    first = BucketedExchange(hc.world(), params, bucket_mb=0.0001, algorithm="ring")
    views = [p.grad for p in params]
    second = BucketedExchange(hc.world(), params, bucket_mb=0.0001, algorithm="ring")
    assert first.in_place and not second.in_place
    assert all(p.grad is v for p, v in zip(params, views))
    assert all(a is b for a, b in zip(second._grads, views))
    first.free()
    second.free()
