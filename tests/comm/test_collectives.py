"""hpcdl's own collectives against MPI's, as bodies that take a communicator.

Each ``check_*`` body runs on every rank of ``comm`` (any size, 1 included) and compares
with the communicator's own collectives (``Allreduce``, ``Reduce``, ``Bcast``, ``Allgather``
of the contract) or with closed forms, so the simulator can run the same bodies later.
Exact comparisons use integer-valued floats (any summation order gives the same sum);
random floats are compared with a tolerance, and must agree bit for bit across ranks.
Run under mpiexec with ``tests/run_mpi.sh N tests/comm/test_collectives.py``; without
mpiexec the bodies run on a world of one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import numpy as np
import pytest

import hpcdl.comm as hc
from hpcdl.comm import Communicator
from hpcdl.comm.collectives import (
    ALGORITHMS,
    AutoTable,
    Collectives,
    CollectivesFreedError,
    CollRequest,
    chunk_counts,
)
from hpcdl.errors import ConfigError

from .test_mpi_conformance import run_everywhere

DTYPES = (np.float32, np.float64)
OPS = ("SUM", "MAX", "MIN")


def lengths(size: int) -> list[int]:
    """0, 1, size - 1, size + 1, 1000 and 100003 (not divisible by most sizes), deduplicated."""
    return sorted({0, 1, max(size - 1, 0), size + 1, 1000, 100003})


def integer_values(rank: int, n: int, dtype: type) -> np.ndarray:
    """Small integers depending on rank and index: every sum of them is exact."""
    return ((np.arange(n) * 7 + rank * 13) % 101 - 50).astype(dtype)


def random_values(rank: int, n: int, dtype: type) -> np.ndarray:
    return np.random.default_rng([7, rank, n]).standard_normal(n).astype(dtype)


def mpi_allreduce(comm: Communicator, x: np.ndarray, op: str = "SUM") -> np.ndarray:
    out = np.empty_like(x)
    comm.Allreduce(x, out, op=getattr(hc, op))
    return out


def same_on_all_ranks(comm: Communicator, x: np.ndarray) -> bool:
    digests = comm.allgather(hashlib.sha256(np.ascontiguousarray(x).tobytes()).hexdigest())
    return len(set(digests)) == 1


# -- allreduce ---------------------------------------------------------------------------


def check_allreduce_exact(comm: Communicator) -> None:
    """Every algorithm, blocking and nonblocking, out of place and in place, equals MPI's."""
    rank, size = comm.Get_rank(), comm.Get_size()
    with Collectives(comm) as coll:
        for algorithm in ALGORITHMS:
            for n in lengths(size):
                for dtype in DTYPES:
                    x = integer_values(rank, n, dtype)
                    expected = mpi_allreduce(comm, x)
                    where = (algorithm, n, np.dtype(dtype).name)
                    out = np.full_like(x, np.nan)
                    coll.Allreduce(x, out, algorithm=algorithm)
                    assert np.array_equal(out, expected), where
                    assert np.array_equal(x, integer_values(rank, n, dtype)), (*where, "sendbuf changed")
                    buf = x.copy()
                    coll.Allreduce(buf, buf, algorithm=algorithm)
                    assert np.array_equal(buf, expected), (*where, "in place")
                    out = np.full_like(x, np.nan)
                    req = coll.Iallreduce(x, out, algorithm=algorithm)
                    assert isinstance(req, CollRequest)
                    req.Wait()
                    assert not req and req.Test(), where
                    assert np.array_equal(out, expected), (*where, "nonblocking")
                    buf = x.copy()
                    req = coll.Iallreduce(hc.IN_PLACE, buf, algorithm=algorithm)
                    while not req.Test():
                        pass
                    assert np.array_equal(buf, expected), (*where, "nonblocking in place, Test()")


def check_allreduce_random(comm: Communicator) -> None:
    """Random floats: close to MPI's sum, and the same bits on every rank (training needs it)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    with Collectives(comm) as coll:
        for algorithm in ALGORITHMS:
            for n in (size + 1, 1000, 100003):
                for dtype in DTYPES:
                    x = random_values(rank, n, dtype)
                    expected = mpi_allreduce(comm, x)
                    out = np.empty_like(x)
                    coll.Allreduce(x, out, algorithm=algorithm)
                    rtol = 1e-5 if dtype == np.float32 else 1e-12
                    np.testing.assert_allclose(out, expected, rtol=rtol, atol=rtol * size)
                    if algorithm != "mpi":
                        assert same_on_all_ranks(comm, out), (algorithm, n, np.dtype(dtype).name)


def check_allreduce_max_min(comm: Communicator) -> None:
    """MAX and MIN (and SUM) by every algorithm equal MPI's, for random floats (exact)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    with Collectives(comm) as coll:
        for algorithm in ALGORITHMS:
            for op in ("MAX", "MIN"):
                for n in (1, size + 1, 1000):
                    x = random_values(rank, n, np.float64)
                    out = np.empty_like(x)
                    coll.Allreduce(x, out, op=getattr(hc, op), algorithm=algorithm)
                    assert np.array_equal(out, mpi_allreduce(comm, x, op)), (algorithm, op, n)


def check_allreduce_shapes(comm: Communicator) -> None:
    """A 2-D array is reduced as a flat vector; the object's default algorithm is used."""
    rank = comm.Get_rank()
    for algorithm in ALGORITHMS:
        with Collectives(comm, algorithm=algorithm) as coll:
            assert coll.algorithm == algorithm
            x = integer_values(rank, 35, np.float32).reshape(5, 7)
            out = np.zeros_like(x)
            coll.Allreduce(x, out)
            assert np.array_equal(out, mpi_allreduce(comm, x)), algorithm


# -- reduce-scatter, allgather, reduce, bcast ------------------------------------------------


def check_reduce_scatter(comm: Communicator) -> None:
    """Rank r gets chunk r (chunk_counts) of MPI's Allreduce, out of place and in place."""
    rank, size = comm.Get_rank(), comm.Get_size()
    with Collectives(comm) as coll:
        for n in lengths(size):
            counts = chunk_counts(n, size)
            lo = sum(counts[:rank])
            assert sum(counts) == n and max(counts) - min(counts) <= 1
            for dtype in DTYPES:
                x = integer_values(rank, n, dtype)
                mine = mpi_allreduce(comm, x)[lo : lo + counts[rank]]
                out = np.full(counts[rank], np.nan, dtype=dtype)
                coll.Reduce_scatter(x, out)
                assert np.array_equal(out, mine), (n, np.dtype(dtype).name)
                buf = x.copy()
                coll.Ireduce_scatter(hc.IN_PLACE, buf).Wait()
                assert np.array_equal(buf[: counts[rank]], mine), (n, np.dtype(dtype).name, "in place")
            x = random_values(rank, n, np.float64)
            out = np.empty(counts[rank])
            coll.Reduce_scatter(x, out, op=hc.MAX)
            assert np.array_equal(out, mpi_allreduce(comm, x, "MAX")[lo : lo + counts[rank]])


def check_allgather(comm: Communicator) -> None:
    """Every rank's part lands in rank order: MPI's Allgather for equal parts, uneven ones too."""
    rank, size = comm.Get_rank(), comm.Get_size()
    with Collectives(comm) as coll:
        for dtype in DTYPES:
            for part in (0, 1, 1000):  # equal parts: compare with MPI
                mine = integer_values(rank, part, dtype)
                expected = np.empty(part * size, dtype=dtype)
                comm.Allgather(mine, expected)
                out = np.full(part * size, np.nan, dtype=dtype)
                coll.Allgather(mine, out)
                assert np.array_equal(out, expected), (part, np.dtype(dtype).name)
            for n in lengths(size):  # uneven parts: rank r holds elements [lo, hi) of arange(n)
                counts = chunk_counts(n, size)
                lo = sum(counts[:rank])
                out = np.full(n, np.nan, dtype=dtype)
                coll.Iallgather(np.arange(lo, lo + counts[rank], dtype=dtype), out).Wait()
                assert np.array_equal(out, np.arange(n, dtype=dtype)), (n, np.dtype(dtype).name)
                buf = np.full(n, np.nan, dtype=dtype)
                buf[lo : lo + counts[rank]] = np.arange(lo, lo + counts[rank])
                coll.Allgather(hc.IN_PLACE, buf)
                assert np.array_equal(buf, np.arange(n, dtype=dtype)), (n, np.dtype(dtype).name, "in place")


def check_reduce_every_root(comm: Communicator) -> None:
    """Binomial reduce to every root equals MPI's Reduce; in place on the root too."""
    rank, size = comm.Get_rank(), comm.Get_size()
    with Collectives(comm) as coll:
        for root in range(size):
            for n in (0, 1, size + 1, 100003):
                for dtype in DTYPES:
                    x = integer_values(rank, n, dtype)
                    expected = np.empty_like(x) if rank == root else None
                    comm.Reduce(x, expected, op=hc.SUM, root=root)
                    out = np.full_like(x, np.nan) if rank == root else None
                    coll.Reduce(x, out, root=root)
                    buf = x.copy()
                    coll.Ireduce(buf if rank == root else x, buf if rank == root else None, root=root).Wait()
                    if rank == root:
                        assert np.array_equal(out, expected), (root, n, np.dtype(dtype).name)
                        assert np.array_equal(buf, expected), (root, n, np.dtype(dtype).name, "in place")
            x = random_values(rank, 9, np.float64)
            out = np.empty(9) if rank == root else None
            coll.Reduce(x, out, op=hc.MIN, root=root)
            if rank == root:
                expected = np.empty(9)
                comm.Reduce(x, expected, op=hc.MIN, root=root)
                assert np.array_equal(out, expected)
            else:
                comm.Reduce(x, None, op=hc.MIN, root=root)


def check_bcast_every_root(comm: Communicator) -> None:
    """Binomial broadcast from every root equals MPI's Bcast."""
    rank, size = comm.Get_rank(), comm.Get_size()
    with Collectives(comm) as coll:
        for root in range(size):
            for n in (0, 1, size + 1, 100003):
                for dtype in DTYPES:
                    expected = random_values(root, n, dtype) if rank == root else np.zeros(n, dtype)
                    comm.Bcast(expected, root=root)
                    buf = random_values(root, n, dtype) if rank == root else np.full(n, np.nan, dtype)
                    coll.Bcast(buf, root=root)
                    assert np.array_equal(buf, expected), (root, n, np.dtype(dtype).name)
                    buf = random_values(root, n, dtype) if rank == root else np.full(n, np.nan, dtype)
                    coll.Ibcast(buf.reshape(-1, 1) if n else buf, root=root).Wait()
                    assert np.array_equal(buf, expected), (root, n, np.dtype(dtype).name, "nonblocking")


# -- several in flight, with MPI's requests ------------------------------------------------------


def _start_mixed(
    comm: Communicator, coll: Collectives
) -> tuple[list[hc.Request], list[tuple[np.ndarray, np.ndarray]], np.ndarray, np.ndarray]:
    """Start one allreduce per algorithm and length, a reduce, a bcast, and a ring of Isend/Irecv
    on ``comm`` itself (user traffic with tag 0, like the collectives' first tag)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    reqs: list[hc.Request] = []
    checks: list[tuple[np.ndarray, np.ndarray]] = []
    for k, algorithm in enumerate([*ALGORITHMS, *ALGORITHMS]):
        x = integer_values(rank + k, 1000 + 997 * k, np.float32)
        expected = mpi_allreduce(comm, x)
        reqs.append(coll.Iallreduce(x, x, algorithm=algorithm))
        checks.append((x, expected))
    got = np.full(5, -1.0)
    reqs.append(comm.Irecv(got, source=(rank - 1) % size, tag=0))
    bcast = np.arange(10.0) if rank == size - 1 else np.zeros(10)
    reqs.append(coll.Ibcast(bcast, root=size - 1))
    checks.append((bcast, np.arange(10.0)))
    sent = np.full(5, float(rank))
    reqs.append(comm.Isend(sent, dest=(rank + 1) % size, tag=0))
    checks.append((got, np.full(5, float((rank - 1) % size))))
    return reqs, checks, got, sent


def check_concurrent_waitall(comm: Communicator) -> None:
    """Nonblocking collectives in flight together, beside MPI requests, end with waitall."""
    with Collectives(comm) as coll:
        reqs, checks, _, _ = _start_mixed(comm, coll)
        hc.waitall(reqs)
        assert not any(reqs[i] for i in range(len(reqs))), reqs
        for k, (got, expected) in enumerate(checks):
            assert np.array_equal(got, expected), k
        hc.waitall(reqs)  # all inactive now: returns at once


def check_concurrent_waitany(comm: Communicator) -> None:
    """A waitany loop completes each request once, in whatever order; then none is active."""
    with Collectives(comm) as coll:
        reqs, checks, _, _ = _start_mixed(comm, coll)
        done = []
        while (i := hc.waitany(reqs)) is not None:
            done.append(i)
            reqs[i] = None
        assert sorted(done) == list(range(len(reqs))), done
        for k, (got, expected) in enumerate(checks):
            assert np.array_equal(got, expected), k


def check_concurrent_reverse_order(comm: Communicator) -> None:
    """Collectives started in one order may be completed in another (the last one first)."""
    rank = comm.Get_rank()
    with Collectives(comm) as coll:
        bufs = [integer_values(rank + k, 5000 + k, np.float64) for k in range(6)]
        expected = [mpi_allreduce(comm, b) for b in bufs]
        algorithms = [*ALGORITHMS][::-1] * 2
        reqs = [coll.Iallreduce(b, b, algorithm=a) for b, a in zip(bufs, algorithms)]
        for req in reversed(reqs):
            req.Wait()
        for k, (b, e) in enumerate(zip(bufs, expected)):
            assert np.array_equal(b, e), (k, algorithms[k])


def check_isolated_from_user_traffic(comm: Communicator) -> None:
    """A pending user receive on ``comm`` with ANY_SOURCE/ANY_TAG does not catch collective data."""
    rank, size = comm.Get_rank(), comm.Get_size()
    trap = np.full(3, -1.0)
    req = comm.Irecv(trap, source=hc.ANY_SOURCE, tag=hc.ANY_TAG)
    with Collectives(comm) as coll:
        x = integer_values(rank, 3, np.float64)
        out = np.empty(3)
        for algorithm in ALGORITHMS:
            coll.Allreduce(x, out, algorithm=algorithm)
            assert np.array_equal(out, mpi_allreduce(comm, x)), algorithm
    caught = req.Test()  # every collective message to this rank has arrived by now
    comm.Barrier()  # and no rank sends to the trap before all have tested it
    comm.Send(np.full(3, float(rank)), dest=(rank + 1) % size, tag=42)
    req.Wait()
    assert not caught, f"the user's receive caught collective traffic: {trap}"
    assert np.array_equal(trap, np.full(3, float((rank - 1) % size)))


# -- lifetime and misuse --------------------------------------------------------------------------


def check_use_after_free(comm: Communicator) -> None:
    """After free(), every operation raises CollectivesFreedError; a second free() does nothing."""
    coll = Collectives(comm)
    x = np.ones(4)
    req = coll.Iallreduce(x, x)
    if comm.Get_size() > 1:
        with pytest.raises(RuntimeError, match="in flight"):
            coll.free()
    req.Wait()
    coll.free()
    coll.free()
    assert "freed" in repr(coll)
    for call in (
        lambda: coll.Allreduce(x, x),
        lambda: coll.Iallreduce(x, x, algorithm="mpi"),
        lambda: coll.Allreduce(x, x, algorithm="mpi"),
        lambda: coll.Bcast(x, 0),
        lambda: coll.Reduce(x, x),
        lambda: coll.Allgather(hc.IN_PLACE, x),
        lambda: coll.Reduce_scatter(hc.IN_PLACE, x),
    ):
        with pytest.raises(CollectivesFreedError, match="freed"):
            call()


def check_bad_arguments(comm: Communicator) -> None:
    """Misuse raises on every rank before any message is sent (the sequence stays aligned)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    with Collectives(comm) as coll:
        x = np.ones(6)
        with pytest.raises(ConfigError, match="unknown allreduce algorithm 'tree'"):
            coll.Allreduce(x, x, algorithm="tree")
        with pytest.raises(ConfigError, match="ring, doubling, rabenseifner, mpi, shm or auto"):
            Collectives(comm, algorithm="fastest")
        with pytest.raises(TypeError, match=r"AutoTable.threshold\(nbytes\)"):
            Collectives(comm, "auto", 4000)  # type: ignore[arg-type]  (the old auto_threshold)
        with pytest.raises(ValueError, match="same size and dtype"):
            coll.Allreduce(x, np.ones(5))
        with pytest.raises(ValueError, match="same size and dtype"):
            coll.Iallreduce(x, np.ones(6, dtype=np.float32))
        with pytest.raises(ValueError, match="SUM, MAX or MIN"):
            coll.Allreduce(x, x, op="prod")
        with pytest.raises(ValueError, match="C-contiguous"):
            coll.Allreduce(np.ones((4, 4))[:, 0], np.ones(4))
        with pytest.raises(ValueError, match=r"root must be a rank in \[0, "):
            coll.Bcast(x, root=size)
        with pytest.raises(ValueError, match="chunk"):
            coll.Reduce_scatter(x, np.ones(7))
        with pytest.raises(TypeError, match="array"):
            coll.Bcast([1.0, 2.0])
        out = np.empty(6)
        coll.Allreduce(x + rank, out)  # still in step after the errors
        assert np.array_equal(out, mpi_allreduce(comm, x + rank))


def check_auto_runs_what_its_table_says(comm: Communicator) -> None:
    """A table forcing each algorithm, then one switching at 4,000 B: auto runs it, equal to MPI's."""
    rank, size = comm.Get_rank(), comm.Get_size()
    split = ((4000, "doubling"), (None, "rabenseifner"))
    tables = [(AutoTable(fallback=((None, name),)), lambda nbytes, name=name: name) for name in ALGORITHMS]
    tables.append(
        (
            AutoTable({size: split}, fallback=split),
            lambda nbytes: "doubling" if nbytes < 4000 else "rabenseifner",
        )
    )
    for table, expected_name in tables:
        with Collectives(comm, "auto", auto=table) as coll:
            for n in (0, 10, 999, 1000, 5000):  # float32: 0 B .. 20 KB, around the 4,000-byte bound
                x = integer_values(rank, n, np.float32)
                expected = mpi_allreduce(comm, x)
                got = np.full_like(x, np.nan)
                coll.Allreduce(x, got)
                np.testing.assert_array_equal(got, expected)
                got[:] = np.nan
                req = coll.Iallreduce(x, got)
                assert f"allreduce[{expected_name(x.nbytes)}]" in repr(req), (n, repr(req))
                req.Wait()
                np.testing.assert_array_equal(got, expected)
                assert table.choose(x.nbytes, size) == expected_name(x.nbytes)


# -- shm: node memory ---------------------------------------------------------------------------


def check_shm_equals_mpi(comm: Communicator) -> None:
    """``shm`` on node memory, blocking and nonblocking, in place and from another buffer, SUM
    (exact and random: the same bits on every rank), MAX and MIN: MPI's results."""
    rank, size = comm.Get_rank(), comm.Get_size()
    with Collectives(comm) as coll:
        for n in lengths(size):
            for dtype in DTYPES:
                buf = coll.node_empty(n, dtype)
                assert buf is not None and buf.shape == (n,) and buf.dtype == dtype
                x = integer_values(rank, n, dtype)
                expected = mpi_allreduce(comm, x)
                where = (n, np.dtype(dtype).name)
                buf[...] = x
                coll.Allreduce(buf, buf, algorithm="shm")
                assert np.array_equal(buf, expected), where
                buf[...] = np.nan
                req = coll.Iallreduce(x, buf, algorithm="shm")  # from ordinary memory
                assert "allreduce[shm]" in repr(req)
                while not req.Test():
                    pass
                assert np.array_equal(buf, expected), (*where, "nonblocking, out of place")
                assert np.array_equal(x, integer_values(rank, n, dtype)), (*where, "sendbuf changed")
                for op in ("MAX", "MIN"):
                    buf[...] = random_values(rank, n, dtype)
                    want = mpi_allreduce(comm, buf, op)
                    coll.Allreduce(hc.IN_PLACE, buf, op=getattr(hc, op), algorithm="shm")
                    assert np.array_equal(buf, want), (*where, op)
                buf[...] = random_values(rank, n, dtype)
                want = mpi_allreduce(comm, buf)
                coll.Iallreduce(buf, buf, algorithm="shm").Wait()
                rtol = 1e-5 if dtype == np.float32 else 1e-12
                np.testing.assert_allclose(buf, want, rtol=rtol, atol=rtol * size)
                assert same_on_all_ranks(comm, buf), where


def check_allreduce_scale(comm: Communicator) -> None:
    """``scale=`` gives the bits of the same algorithm's sum multiplied afterwards, for every
    algorithm (``shm`` on node memory), blocking and not, in both float dtypes."""
    rank, size = comm.Get_rank(), comm.Get_size()
    scale = 1.0 / (size * 3)  # not a power of two: rounding shows
    with Collectives(comm) as coll:
        for algorithm in (*ALGORITHMS, "shm"):
            for n in lengths(size):
                for dtype in DTYPES:
                    x = random_values(rank, n, dtype)
                    where = (algorithm, n, np.dtype(dtype).name)
                    a, b, c = (
                        coll.node_empty(n, dtype) if algorithm == "shm" else np.empty_like(x) for _ in "abc"
                    )
                    a[...] = b[...] = c[...] = x
                    coll.Allreduce(a, a, algorithm=algorithm)
                    a *= dtype(scale)
                    coll.Allreduce(b, b, algorithm=algorithm, scale=scale)
                    coll.Iallreduce(c, c, algorithm=algorithm, scale=scale).Wait()
                    assert np.array_equal(b, a), where
                    assert np.array_equal(c, a), (*where, "nonblocking")
                    assert same_on_all_ranks(comm, c), where
        with pytest.raises(ValueError, match="rounds the sum once"):
            coll.Iallreduce(x16 := np.zeros(4, np.float16), x16, narrow="float16", scale=0.5)


def check_shm_in_flight_with_others(comm: Communicator) -> None:
    """Several ``shm`` allreduces in flight beside the other algorithms, on parts of one node
    block and of another, completed in reverse order: each equals MPI's (their barriers stay
    apart by tag)."""
    rank = comm.Get_rank()
    with Collectives(comm) as coll:
        block = coll.node_empty(30000, np.float64)
        other = coll.node_empty(5000, np.float64)
        bufs = [
            block[:10000],
            block[10000:10007],
            block[10007:],
            other,
            *(np.empty(3000) for _ in ALGORITHMS),
        ]
        names = ["shm"] * 4 + [*ALGORITHMS]
        expected = []
        for k, b in enumerate(bufs):
            b[...] = integer_values(rank + k, b.size, np.float64)
            expected.append(mpi_allreduce(comm, b))
        reqs = [coll.Iallreduce(b, b, algorithm=a) for b, a in zip(bufs, names)]
        for req in reversed(reqs):
            req.Wait()
        for k, (b, e) in enumerate(zip(bufs, expected)):
            assert np.array_equal(b, e), (k, names[k])


def check_shm_needs_node_memory(comm: Communicator) -> None:
    """``shm`` by name on ordinary memory is a ValueError (on every rank, nothing started);
    ``auto`` that picks it runs, there, its table's ordinary-memory segment (MPI's own if the
    table has none), and ``shm`` on node memory."""
    rank = comm.Get_rank()
    table = AutoTable(fallback=((None, "shm"),))
    with Collectives(comm, "auto", auto=table) as coll:
        plain = integer_values(rank, 100, np.float32)
        with pytest.raises(ValueError, match="must come from Collectives.node_empty"):
            coll.Iallreduce(plain, plain, algorithm="shm")
        with pytest.raises(ValueError, match="must come from Collectives.node_empty"):
            coll.Allreduce(plain, plain, algorithm="shm")
        expected = mpi_allreduce(comm, plain)
        req = coll.Iallreduce(plain.copy(), out := np.empty_like(plain))
        assert "allreduce[mpi]" in repr(req), repr(req)
        req.Wait()
        assert np.array_equal(out, expected)
        out[...] = np.nan
        coll.Allreduce(plain, out)
        assert np.array_equal(out, expected)
        node = coll.node_empty(100, np.float32)
        node[...] = plain
        req = coll.Iallreduce(node, node)
        assert "allreduce[shm]" in repr(req), repr(req)
        req.Wait()
        assert np.array_equal(node, expected)
    if comm.Get_size() < 2:
        return  # one rank takes the fallback
    size = comm.Get_size()
    table = AutoTable({size: ((None, "shm"),)}, ordinary={size: ((None, "ring"),)})
    with Collectives(comm, "auto", auto=table) as coll:
        req = coll.Iallreduce(plain.copy(), out := np.empty_like(plain))
        assert "allreduce[ring]" in repr(req), repr(req)
        req.Wait()
        assert np.array_equal(out, expected)
        out[...] = np.nan
        coll.Allreduce(plain, out)  # blocking: the same pick
        assert np.array_equal(out, expected)
        node = coll.node_empty(100, np.float32)
        node[...] = plain
        assert "allreduce[shm]" in repr(req := coll.Iallreduce(node, node))
        req.Wait()
        assert np.array_equal(node, expected)


def check_shm_refuses_buffers_that_differ(comm: Communicator) -> None:
    """Ranks that pass another place (an odd rank one element further) or another block: every
    rank raises the same ValueError before any memory is touched, and the next allreduce runs."""
    from hpcdl.comm.collectives import shm

    rank, size = comm.Get_rank(), comm.Get_size()
    with Collectives(comm) as coll:
        blocks = [coll.node_empty(64, np.float64) for _ in range(2)]
        for block in blocks:
            block[...] = rank
        cases = [blocks[0][rank % 2 : rank % 2 + 8], blocks[rank % 2][:8]]
        for buf in cases if size > 1 else ():
            before = [b.copy() for b in blocks]
            with pytest.raises(ValueError, match="the ranks passed different buffers"):
                coll.Allreduce(buf, buf, algorithm="shm")
            assert all(np.array_equal(a, b) for a, b in zip(blocks, before))
        good = blocks[0][:8]
        coll.Allreduce(good, good, algorithm="shm")
        assert np.array_equal(good, np.full(8, float(sum(range(size)))))
        # the NumPy passes (no compiled pass): the same bits as the compiled one
        x = random_values(rank, 1001, np.float32)
        outs = []
        kernel = shm._fused
        for fused in (kernel, None):
            shm._fused = fused
            try:
                buf = coll.node_empty(1001, np.float32)
                buf[...] = x
                coll.Allreduce(buf, buf, algorithm="shm", scale=1 / 3)
                outs.append(buf.copy())
            finally:
                shm._fused = kernel
        assert outs[0].tobytes() == outs[1].tobytes()


def check_node_empty_with_operations_in_flight(comm: Communicator) -> None:
    """``node_empty`` while this object's allreduces are in flight, reached by the ranks at
    different points of their waits: it completes them first, so no rank blocks another."""
    rank = comm.Get_rank()
    with Collectives(comm) as coll:
        x = integer_values(rank, 5000, np.float64)
        expected = mpi_allreduce(comm, x)
        reqs = [coll.Iallreduce(x.copy(), out := np.empty_like(x), algorithm="ring"), coll.Iallreduce(x, x)]
        if rank == 0:
            node = coll.node_empty(10, np.float64)
            hc.waitall(reqs)
        else:
            hc.waitall(reqs)
            node = coll.node_empty(10, np.float64)
        assert node is not None and np.array_equal(out, expected) and np.array_equal(x, expected)


CHECKS: tuple[Callable[[Communicator], None], ...] = (
    check_allreduce_exact,
    check_allreduce_random,
    check_allreduce_max_min,
    check_allreduce_shapes,
    check_reduce_scatter,
    check_allgather,
    check_reduce_every_root,
    check_bcast_every_root,
    check_concurrent_waitall,
    check_concurrent_waitany,
    check_concurrent_reverse_order,
    check_isolated_from_user_traffic,
    check_use_after_free,
    check_bad_arguments,
    check_auto_runs_what_its_table_says,
    check_allreduce_scale,
    check_shm_equals_mpi,
    check_shm_in_flight_with_others,
    check_shm_needs_node_memory,
    check_shm_refuses_buffers_that_differ,
    check_node_empty_with_operations_in_flight,
)

world_of_one = pytest.mark.skipif(hc.world().Get_size() != 1, reason="world-of-one tests run without mpiexec")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("check", CHECKS, ids=[c.__name__ for c in CHECKS])
def test_collectives_mpi(check: Callable[[Communicator], None], comm: Communicator) -> None:
    run_everywhere(check, comm)


@world_of_one
@pytest.mark.parametrize("check", CHECKS, ids=[c.__name__ for c in CHECKS])
def test_collectives_world_of_one(check: Callable[[Communicator], None], comm: Communicator) -> None:
    check(comm)
