"""Conformance bodies for the communicator contract: each takes a communicator and asserts.

Run under mpiexec against ``hpcdl.comm.world()`` by ``test_mpi_conformance.py``, and (later)
on N virtual ranks of the simulator. The bodies use only the contract (``hpcdl.comm``),
are correct for any size >= 2 (3 included), and compute the expected values from closed
forms, never with the collective under test. Every rank calls every body, in order.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

import hpcdl.comm as hc
from hpcdl.comm import Communicator

DTYPES = (np.float32, np.float64)
LENGTHS = (0, 1, 7)


def _values(rank: int, n: int, dtype: type) -> np.ndarray:
    """``rank + i`` for ``i < n``: exact in float32 and float64."""
    return (rank + np.arange(n)).astype(dtype)


# -- point-to-point ---------------------------------------------------------------------


def check_rank_size(comm: Communicator) -> None:
    """Get_rank/Get_size agree with rank/size; ranks are distinct and cover [0, size)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    assert (comm.rank, comm.size) == (rank, size)
    assert size >= 2 and 0 <= rank < size
    assert sorted(comm.allgather(rank)) == list(range(size))


def check_send_recv_tags(comm: Communicator) -> None:
    """Messages are matched by tag, not arrival order; a ring of blocking receives works."""
    rank, size = comm.Get_rank(), comm.Get_size()
    if rank == 0:
        a, b = np.full(3, 7.0), np.full(5, 3.0)
        reqs = [comm.Isend(a, dest=1, tag=7), comm.Isend(b, dest=1, tag=3)]
        hc.waitall(reqs)
    elif rank == 1:
        b, a = np.zeros(5), np.zeros(3)
        comm.Recv(b, source=0, tag=3)
        comm.Recv(a, source=0, tag=7)
        assert np.array_equal(a, np.full(3, 7.0)) and np.array_equal(b, np.full(5, 3.0))
    # ring: rank r sends [r, r, r, r] with tag r to r + 1
    right, left = (rank + 1) % size, (rank - 1) % size
    out = np.full(4, rank, dtype=np.int64)
    req = comm.Isend(out, dest=right, tag=rank)
    got = np.empty(4, dtype=np.int64)
    comm.Recv(got, source=left, tag=left)
    req.Wait()
    assert np.array_equal(got, np.full(4, left))
    # blocking Send/Recv between a pair, ordered so that it cannot deadlock
    if rank == 0:
        comm.Send(np.arange(6, dtype=np.float32), dest=size - 1, tag=11)
    elif rank == size - 1:
        buf = np.zeros(6, dtype=np.float32)
        comm.Recv(buf, source=0, tag=11)
        assert np.array_equal(buf, np.arange(6, dtype=np.float32))


def check_any_source_any_tag(comm: Communicator) -> None:
    """Rank 0 receives one message from every other rank with ANY_SOURCE and ANY_TAG."""
    rank, size = comm.Get_rank(), comm.Get_size()
    if rank == 0:
        seen = {}
        for _ in range(size - 1):
            buf = np.zeros(2, dtype=np.int64)
            status = hc.Status()
            comm.Recv(buf, source=hc.ANY_SOURCE, tag=hc.ANY_TAG, status=status)
            src, tag = status.Get_source(), status.Get_tag()
            assert tag == 100 + src, (src, tag)
            assert np.array_equal(buf, [src, 2 * src])
            seen[src] = tag
        assert sorted(seen) == list(range(1, size))
    else:
        comm.Send(np.array([rank, 2 * rank], dtype=np.int64), dest=0, tag=100 + rank)


def check_status(comm: Communicator) -> None:
    """Status reports source, tag and byte count for Recv, Wait of an Irecv and Sendrecv."""
    rank, size = comm.Get_rank(), comm.Get_size()
    last = size - 1
    if rank == 0:
        req = comm.Isend(np.arange(5, dtype=np.float64), dest=last, tag=42)
        req2 = comm.Isend(np.arange(3, dtype=np.float32), dest=last, tag=43)
        hc.waitall([req, req2])
    elif rank == last:
        buf = np.zeros(8, dtype=np.float64)  # larger than the message
        status = hc.Status()
        comm.Recv(buf, source=0, tag=42, status=status)
        assert (status.Get_source(), status.Get_tag(), status.Get_count()) == (0, 42, 5 * 8)
        assert np.array_equal(buf[:5], np.arange(5)) and not buf[5:].any()
        buf32 = np.zeros(3, dtype=np.float32)
        status = hc.Status()
        comm.Irecv(buf32, source=hc.ANY_SOURCE, tag=hc.ANY_TAG).Wait(status)
        assert (status.Get_source(), status.Get_tag(), status.Get_count()) == (0, 43, 3 * 4)
    # The wildcard receive above must not meet the Sendrecv messages below (the last rank's
    # left neighbour would send one at once): a race the simulator found at 5 ranks.
    comm.Barrier()
    # Sendrecv status: from the left neighbour, with its tag
    right, left = (rank + 1) % size, (rank - 1) % size
    recv = np.zeros(left + 1, dtype=np.float64)
    status = hc.Status()
    comm.Sendrecv(
        np.ones(rank + 1),
        dest=right,
        sendtag=200 + rank,
        recvbuf=recv,
        source=hc.ANY_SOURCE,
        recvtag=hc.ANY_TAG,
        status=status,
    )
    assert status.Get_source() == left and status.Get_tag() == 200 + left
    assert status.Get_count() == 8 * (left + 1)


def check_sendrecv(comm: Communicator) -> None:
    """Sendrecv around a ring in both directions."""
    rank, size = comm.Get_rank(), comm.Get_size()
    right, left = (rank + 1) % size, (rank - 1) % size
    for dtype in DTYPES:
        recv = np.zeros(3, dtype=dtype)
        comm.Sendrecv(_values(rank, 3, dtype), dest=right, sendtag=5, recvbuf=recv, source=left, recvtag=5)
        assert np.array_equal(recv, _values(left, 3, dtype))
        comm.Sendrecv(_values(rank, 3, dtype), dest=left, recvbuf=recv, source=right)
        assert np.array_equal(recv, _values(right, 3, dtype))


def check_nonblocking_waitall_waitany(comm: Communicator) -> None:
    """All-to-all with Isend/Irecv completed by waitall, then by a waitany loop."""
    rank, size = comm.Get_rank(), comm.Get_size()
    peers = [p for p in range(size) if p != rank]
    # waitall
    bufs = {p: np.full(p + 2, -1.0) for p in peers}
    recvs = [comm.Irecv(bufs[p], source=p, tag=1) for p in peers]
    sends = [comm.Isend(np.full(rank + 2, float(rank)), dest=p, tag=1) for p in peers]
    hc.waitall(recvs + sends)
    for p in peers:
        assert np.array_equal(bufs[p], np.full(p + 2, float(p)))
    # waitany: every receive completes exactly once, then no request is active
    bufs = {p: np.zeros(3) for p in peers}
    reqs: list = [comm.Irecv(bufs[p], source=p, tag=2) for p in peers]
    sends = [comm.Isend(np.array([rank, p, 1.0]), dest=p, tag=2) for p in peers]
    done = []
    for _ in peers:
        i = hc.waitany(reqs)
        assert i is not None and reqs[i] is not None and i not in done
        done.append(i)
        reqs[i] = None
    assert sorted(done) == list(range(len(peers)))
    assert hc.waitany(reqs) is None
    hc.waitall(sends)
    for p in peers:
        assert np.array_equal(bufs[p], [p, rank, 1.0])
    hc.waitall([])


def check_iprobe(comm: Communicator) -> None:
    """Iprobe finds a pending message (with its status) and not one never sent."""
    rank = comm.Get_rank()
    assert comm.Iprobe(source=hc.ANY_SOURCE, tag=321) is False
    if rank == 1:
        comm.Send(np.arange(4, dtype=np.float32), dest=0, tag=9)
    elif rank == 0:
        status = hc.Status()
        while not comm.Iprobe(source=1, tag=9, status=status):
            pass
        assert (status.Get_source(), status.Get_tag(), status.Get_count()) == (1, 9, 16)
        buf = np.zeros(4, dtype=np.float32)
        comm.Recv(buf, source=1, tag=9)
        assert np.array_equal(buf, np.arange(4))
        assert comm.Iprobe(source=1, tag=9) is False
    comm.Barrier()
    assert comm.Iprobe(source=hc.ANY_SOURCE, tag=321) is False


# -- collectives on buffers -------------------------------------------------------------


def check_barrier(comm: Communicator) -> None:
    """Nothing rank 0 sends after a barrier is visible before it; a late rank 0 is waited for.

    The second part relies on the world's clock: wall time under MPI, virtual time in the
    simulator, where the sleep is measured as a compute segment.
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    for k in range(3):
        if rank != 0:
            assert not comm.Iprobe(source=0, tag=500 + k), f"message of round {k} before the barrier"
        comm.Barrier()
        if rank == 0:
            hc.waitall([comm.Isend(np.array([k]), dest=p, tag=500 + k) for p in range(1, size)])
        else:
            got = np.zeros(1, dtype=np.int64)
            comm.Recv(got, source=0, tag=500 + k)
            assert got[0] == k
    # Rank 0 arrives late (a compute segment): the others wait for it in the barrier.
    comm.Barrier()
    t0 = hc.wtime()
    if rank == 0:
        time.sleep(0.2)
    comm.Barrier()
    waited = hc.wtime() - t0
    late = comm.bcast(waited if rank == 0 else None, root=0)
    if rank != 0:
        assert waited >= 0.5 * late, (
            f"rank {rank} left the barrier after {waited:.3f} s, rank 0 came {late:.3f} s"
        )


def check_bcast(comm: Communicator) -> None:
    """Bcast from the first and the last rank, float32/float64, lengths 0, 1 and odd."""
    rank, size = comm.Get_rank(), comm.Get_size()
    for root in (0, size - 1):
        for dtype in DTYPES:
            for n in LENGTHS:
                buf = _values(root, n, dtype) if rank == root else np.full(n, -1, dtype=dtype)
                comm.Bcast(buf, root=root)
                assert np.array_equal(buf, _values(root, n, dtype))


def _expected(op_name: str, size: int, n: int, dtype: type) -> np.ndarray:
    """Closed forms of the reduction over ranks of ``rank + i``."""
    i = np.arange(n)
    if op_name == "SUM":
        return (size * (size - 1) // 2 + size * i).astype(dtype)
    if op_name == "MAX":
        return (size - 1 + i).astype(dtype)
    return i.astype(dtype)


OPS = ("SUM", "MAX", "MIN")


def check_reduce(comm: Communicator) -> None:
    """Reduce SUM/MAX/MIN to the first and last rank; non-roots may pass ``None``."""
    rank, size = comm.Get_rank(), comm.Get_size()
    for root in (0, size - 1):
        for op_name in OPS:
            for dtype in DTYPES:
                for n in LENGTHS:
                    recv = np.full(n, -1, dtype=dtype) if rank == root else None
                    comm.Reduce(_values(rank, n, dtype), recv, op=getattr(hc, op_name), root=root)
                    if rank == root:
                        assert np.array_equal(recv, _expected(op_name, size, n, dtype)), (op_name, n)


def check_allreduce(comm: Communicator) -> None:
    """Allreduce SUM/MAX/MIN, float32/float64, lengths 0, 1, odd; also IN_PLACE and 2-D."""
    rank, size = comm.Get_rank(), comm.Get_size()
    for op_name in OPS:
        op = getattr(hc, op_name)
        for dtype in DTYPES:
            for n in (*LENGTHS, 1001):
                send = _values(rank, n, dtype)
                recv = np.full(n, -1, dtype=dtype)
                comm.Allreduce(send, recv, op=op)
                expected = _expected(op_name, size, n, dtype)
                assert recv.dtype == dtype and np.array_equal(recv, expected), (op_name, dtype, n)
                assert np.array_equal(send, _values(rank, n, dtype))  # input untouched
                comm.Allreduce(hc.IN_PLACE, send, op=op)
                assert np.array_equal(send, expected), ("IN_PLACE", op_name, dtype, n)
    # default op is SUM; 2-D contiguous buffers
    mat = np.full((3, 5), float(rank + 1))
    out = np.empty_like(mat)
    comm.Allreduce(mat, out)
    assert np.array_equal(out, np.full((3, 5), size * (size + 1) / 2))


def check_iallreduce(comm: Communicator) -> None:
    """Two concurrent Iallreduce complete through Wait and through waitall."""
    rank, size = comm.Get_rank(), comm.Get_size()
    for dtype in DTYPES:
        a_out, b_out = np.zeros(7, dtype=dtype), np.zeros(1, dtype=dtype)
        a, b = _values(rank, 7, dtype), _values(rank, 1, dtype)
        reqs = [comm.Iallreduce(a, a_out, op=hc.SUM), comm.Iallreduce(b, b_out, op=hc.MAX)]
        hc.waitall(reqs)
        assert np.array_equal(a_out, _expected("SUM", size, 7, dtype))
        assert np.array_equal(b_out, _expected("MAX", size, 1, dtype))
        out = np.zeros(3, dtype=dtype)
        req = comm.Iallreduce(_values(rank, 3, dtype), out, op=hc.MIN)
        req.Wait()
        assert np.array_equal(out, _expected("MIN", size, 3, dtype))


def check_allgather(comm: Communicator) -> None:
    """Allgather places rank r's buffer at row r on every rank."""
    rank, size = comm.Get_rank(), comm.Get_size()
    for dtype in DTYPES:
        for n in (1, 3):
            recv = np.full((size, n), -1, dtype=dtype)
            comm.Allgather(_values(rank, n, dtype), recv)
            for r in range(size):
                assert np.array_equal(recv[r], _values(r, n, dtype))


def check_gather(comm: Communicator) -> None:
    """Gather to the first and last rank places rank r's buffer at row r."""
    rank, size = comm.Get_rank(), comm.Get_size()
    for root in (0, size - 1):
        recv = np.full((size, 2), -1.0) if rank == root else None
        comm.Gather(_values(rank, 2, np.float64), recv, root=root)
        if rank == root:
            for r in range(size):
                assert np.array_equal(recv[r], _values(r, 2, np.float64))


# -- collectives on Python objects ------------------------------------------------------


def check_object_collectives(comm: Communicator) -> None:
    """bcast, gather, allgather and allreduce of small Python objects."""
    rank, size = comm.Get_rank(), comm.Get_size()
    for root in (0, size - 1):
        obj = {"root": root, "data": [1, 2.5, "x"]} if rank == root else None
        assert comm.bcast(obj, root=root) == {"root": root, "data": [1, 2.5, "x"]}
        got = comm.gather((rank, f"r{rank}"), root=root)
        if rank == root:
            assert got == [(r, f"r{r}") for r in range(size)]
        else:
            assert got is None
    assert comm.allgather(rank * rank) == [r * r for r in range(size)]
    assert comm.allreduce(rank) == size * (size - 1) // 2
    assert comm.allreduce(rank + 1, op=hc.SUM) == size * (size + 1) // 2
    assert comm.allreduce(rank, op=hc.MAX) == size - 1
    assert comm.allreduce(-rank, op=hc.MIN) == -(size - 1)
    assert comm.allreduce(0.5 * rank) == 0.25 * size * (size - 1)


# -- communicators ----------------------------------------------------------------------


def check_split(comm: Communicator) -> None:
    """Split by parity; the key reverses the order; the sub-communicators work."""
    rank, size = comm.Get_rank(), comm.Get_size()
    color = rank % 2
    members = sorted((r for r in range(size) if r % 2 == color), reverse=True)  # key = -rank
    sub = comm.Split(color=color, key=-rank)
    try:
        assert sub.Get_size() == len(members)
        assert sub.Get_rank() == members.index(rank)
        assert sub.allgather(rank) == members
        out = np.zeros(1)
        sub.Allreduce(np.array([float(rank)]), out, op=hc.SUM)
        assert out[0] == sum(members)
    finally:
        sub.Free()
    # the same key everywhere keeps the parent's order
    sub = comm.Split(color=0, key=0)
    try:
        assert (sub.Get_rank(), sub.Get_size()) == (rank, size)
    finally:
        sub.Free()


def check_dup_free(comm: Communicator) -> None:
    """A Dup has the same ranks, and its messages never match the parent's."""
    rank, size = comm.Get_rank(), comm.Get_size()
    dup = comm.Dup()
    try:
        assert (dup.Get_rank(), dup.Get_size()) == (rank, size)
        if rank == 0:
            r1 = dup.Isend(np.array([1.0]), dest=1, tag=1)
            r2 = comm.Isend(np.array([2.0]), dest=1, tag=1)
            hc.waitall([r1, r2])
        elif rank == 1:
            a, b = np.zeros(1), np.zeros(1)
            comm.Recv(a, source=0, tag=1)  # parent first, though the dup's was sent first
            dup.Recv(b, source=0, tag=1)
            assert (a[0], b[0]) == (2.0, 1.0)
        assert dup.allreduce(1) == size
    finally:
        dup.Free()


def check_subcomm(comm: Communicator) -> None:
    """subcomm of [last, 0] (ranks follow the list), of one rank, and misuse errors."""
    rank, size = comm.Get_rank(), comm.Get_size()
    ends = [size - 1, 0]
    if rank in ends:
        sub = hc.subcomm(comm, ends)
        try:
            assert sub.Get_size() == 2 and sub.Get_rank() == ends.index(rank)
            assert sub.allgather(rank) == ends
            out = np.zeros(2, dtype=np.float32)
            sub.Allreduce(np.full(2, rank, dtype=np.float32), out, op=hc.SUM)
            assert np.array_equal(out, np.full(2, size - 1, dtype=np.float32))
        finally:
            sub.Free()
    alone = hc.subcomm(comm, [rank])
    try:
        assert (alone.Get_rank(), alone.Get_size()) == (0, 1)
        assert alone.allreduce(rank) == rank
    finally:
        alone.Free()
    other = (rank + 1) % size
    for bad in ([other], [rank, rank], [rank, size]):
        try:
            hc.subcomm(comm, bad)
        except ValueError:
            pass
        else:
            raise AssertionError(f"subcomm(comm, {bad}) on rank {rank} did not raise ValueError")
    comm.Barrier()


#: Every body, in the order the runners call them.
CHECKS: tuple[Callable[[Communicator], None], ...] = (
    check_rank_size,
    check_send_recv_tags,
    check_any_source_any_tag,
    check_status,
    check_sendrecv,
    check_nonblocking_waitall_waitany,
    check_iprobe,
    check_barrier,
    check_bcast,
    check_reduce,
    check_allreduce,
    check_iallreduce,
    check_allgather,
    check_gather,
    check_object_collectives,
    check_split,
    check_dup_free,
    check_subcomm,
)
