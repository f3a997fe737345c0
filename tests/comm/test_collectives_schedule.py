"""Serial tests of the collectives' machinery: chunking, the fold, CollRequest, and every
schedule run on N virtual ranks in one process (a loopback communicator, no threads)."""

from __future__ import annotations

from collections import defaultdict, deque
from typing import Any

import numpy as np
import pytest

import hpcdl.comm as hc
from hpcdl.comm.collectives import ALGORITHMS, CollRequest, chunk_counts, ring, tree
from hpcdl.comm.collectives.fold import new_rank, old_rank, split_pof2

P2P_ALGORITHMS = [a for a in ALGORITHMS if a != "mpi"]


def test_chunk_counts() -> None:
    assert chunk_counts(10, 3) == [4, 3, 3]
    assert chunk_counts(2, 3) == [1, 1, 0]
    assert chunk_counts(0, 4) == [0, 0, 0, 0]
    assert chunk_counts(8, 4) == [2, 2, 2, 2]
    assert chunk_counts(5, 1) == [5]


@pytest.mark.parametrize("size", range(1, 18))
def test_fold_maps_the_ranks_that_stay_onto_a_power_of_two(size: int) -> None:
    pof2, rem = split_pof2(size)
    assert pof2 & (pof2 - 1) == 0 and pof2 <= size < 2 * pof2 and pof2 + rem == size
    stay = [r for r in range(size) if new_rank(r, rem) >= 0]
    assert sorted(new_rank(r, rem) for r in stay) == list(range(pof2))
    assert all(old_rank(new_rank(r, rem), rem) == r for r in stay)
    assert [r for r in range(size) if r not in stay] == list(range(0, 2 * rem, 2))  # the even ones


# -- CollRequest on fake requests ---------------------------------------------------------------


class Countdown:
    """A request that completes after ``n`` calls of Test()."""

    def __init__(self, n: int) -> None:
        self.n = n

    def Test(self, status: Any = None) -> bool:  # noqa: N802
        self.n -= 1
        return self.n <= 0

    def Wait(self, status: Any = None) -> None:  # noqa: N802
        self.n = 0

    def __bool__(self) -> bool:
        return self.n > 0


def test_collrequest_advances_round_by_round() -> None:
    log: list[str] = []

    def schedule():
        log.append("post 1")
        yield [Countdown(2), Countdown(1)]
        log.append("reduce 1, post 2")
        yield [Countdown(2)]
        log.append("done")

    req = CollRequest(schedule(), "demo")
    assert log == ["post 1"] and req and not req.finished
    assert not req.Test() and log == ["post 1"]
    assert not req.Test() and log == ["post 1", "reduce 1, post 2"]
    assert req.Test() and log == ["post 1", "reduce 1, post 2", "done"]
    assert req.finished and not req and req.Test()
    assert "inactive" in repr(req)


def test_collrequest_calls_on_done_once_when_the_schedule_ends() -> None:
    done: list[str] = []

    def schedule():
        yield [Countdown(2)]
        yield [Countdown(2)]

    req = CollRequest(schedule(), "demo", on_done=lambda: done.append("released"))
    assert not req.Test() and done == []
    assert not req.Test() and done == []
    assert req.Test() and done == ["released"]
    assert req.Test() and done == ["released"]  # reported again: not released twice
    CollRequest(iter(()), on_done=lambda: done.append("empty"))  # no rounds: done at once
    assert done == ["released", "empty"]


def test_collrequest_stays_active_until_reported() -> None:
    """A schedule that ends at once (one rank, empty buffer) is still reported once, by waitany."""

    def empty():
        return
        yield

    reqs: list[Any] = [CollRequest(empty()), Countdown(3), CollRequest(empty())]
    assert reqs[0].finished and reqs[0]
    done = []
    while (i := hc.waitany(reqs)) is not None:
        done.append(i)
        reqs[i] = None
    assert sorted(done) == [0, 1, 2]


def test_collrequest_wait_and_errors() -> None:
    def failing():
        yield [Countdown(1)]
        raise ZeroDivisionError("in the reduction")

    req = CollRequest(failing())
    with pytest.raises(ZeroDivisionError):
        req.Wait()
    assert req.finished and req and "failed: ZeroDivisionError" in repr(req)
    with pytest.raises(ZeroDivisionError):  # a failed collective does not report success later
        req.Wait()
    with pytest.raises(ZeroDivisionError):
        req.Test()

    class Broken:  # a request whose completion fails (a truncated receive, say)
        def Test(self, status: Any = None) -> bool:  # noqa: N802
            raise OverflowError("message truncated")

        def Wait(self, status: Any = None) -> None:  # noqa: N802
            raise OverflowError("message truncated")

    closed = []

    def waits_on_broken():
        try:
            yield [Broken(), Done()]
            yield [Done()]
        finally:
            closed.append(True)

    for finish in ("Wait", "Test"):
        closed.clear()
        req = CollRequest(waits_on_broken(), on_done=lambda: closed.append("done"))
        with pytest.raises(OverflowError):
            getattr(req, finish)()
        assert req.finished and req and closed == [True]  # the schedule is closed, on_done not called
        with pytest.raises(OverflowError):
            req.Test()


# -- every schedule on N virtual ranks of a loopback communicator ------------------------------


class Done:
    def Test(self, status: Any = None) -> bool:  # noqa: N802
        return True

    def Wait(self, status: Any = None) -> None:  # noqa: N802
        pass


class Receive:
    def __init__(self, box: deque, buf: np.ndarray) -> None:
        self.box, self.buf, self.done = box, buf, False

    def Test(self, status: Any = None) -> bool:  # noqa: N802
        if not self.done and self.box:
            data = self.box.popleft()
            assert data.size == self.buf.size, (data.size, self.buf.size)
            self.buf[...] = data
            self.done = True
        return self.done

    def Wait(self, status: Any = None) -> None:  # noqa: N802
        assert self.Test(), "a receive would block forever: no matching send"


class Loopback:
    """Rank ``rank`` of ``size`` virtual ranks sharing ``boxes`` (eager sends, FIFO per tag)."""

    def __init__(self, rank: int, size: int, boxes: dict) -> None:
        self.rank, self.size, self.boxes = rank, size, boxes

    def Get_rank(self) -> int:  # noqa: N802
        return self.rank

    def Get_size(self) -> int:  # noqa: N802
        return self.size

    def Isend(self, buf: np.ndarray, dest: int, tag: int = 0) -> Done:  # noqa: N802
        self.boxes[self.rank, dest, tag].append(np.array(buf, copy=True))
        return Done()

    def Irecv(self, buf: np.ndarray, source: int, tag: int = 0) -> Receive:  # noqa: N802
        return Receive(self.boxes[source, self.rank, tag], buf)


def run_virtual(size: int, make) -> None:
    """Start ``make(comm)`` on each virtual rank, then Test() them in turn until all are done."""
    boxes: dict = defaultdict(deque)
    reqs = [CollRequest(make(Loopback(r, size, boxes))) for r in range(size)]
    for _ in range(10 * size + 10):
        if all([r.Test() for r in reqs]):
            assert not any(boxes.values()), "messages left unreceived"
            return
    raise AssertionError("the schedules did not finish: a deadlock")


@pytest.mark.parametrize("size", range(1, 10))
@pytest.mark.parametrize("algorithm", P2P_ALGORITHMS)
@pytest.mark.parametrize("n", [0, 1, 5, 23])
def test_allreduce_schedules_on_virtual_ranks(size: int, algorithm: str, n: int) -> None:
    xs = [((np.arange(n) + 3 * r) % 11).astype(np.float64) for r in range(size)]
    outs = [np.full(n, np.nan) for _ in range(size)]
    run_virtual(size, lambda c: ALGORITHMS[algorithm](c, xs[c.rank], outs[c.rank], hc.SUM, 0))
    for out in outs:
        assert np.array_equal(out, sum(xs))
    ins = [x.copy() for x in xs]  # in place, with MAX
    run_virtual(size, lambda c: ALGORITHMS[algorithm](c, ins[c.rank], ins[c.rank], hc.MAX, 0))
    for out in ins:
        assert np.array_equal(out, np.max(xs, axis=0))


@pytest.mark.parametrize("size", range(1, 10))
def test_ring_tree_schedules_on_virtual_ranks(size: int) -> None:
    n = 2 * size + 1
    xs = [np.arange(n, dtype=np.float32) * (r + 1) for r in range(size)]
    total = sum(xs)
    counts = chunk_counts(n, size)
    off = np.cumsum([0, *counts])
    outs = [np.zeros(counts[r], np.float32) for r in range(size)]
    run_virtual(size, lambda c: ring.reduce_scatter(c, xs[c.rank], outs[c.rank], hc.SUM, 5))
    for r in range(size):
        assert np.array_equal(outs[r], total[off[r] : off[r + 1]])
    gathered = [np.zeros(n, np.float32) for _ in range(size)]
    run_virtual(size, lambda c: ring.allgather(c, outs[c.rank], gathered[c.rank], 6))
    for g in gathered:
        assert np.array_equal(g, total)
    for root in range(size):
        res = np.zeros(n, np.float32)
        dsts = [res if r == root else None for r in range(size)]
        run_virtual(
            size, lambda c, root=root, dsts=dsts: tree.reduce(c, xs[c.rank], dsts[c.rank], hc.SUM, root, 7)
        )
        assert np.array_equal(res, total)
        bufs = [xs[r].copy() for r in range(size)]
        run_virtual(size, lambda c, root=root, bufs=bufs: tree.bcast(c, bufs[c.rank], root, 8))
        for b in bufs:
            assert np.array_equal(b, xs[root])


def test_workspace_reuses_and_bounds_its_buffers() -> None:
    from hpcdl.comm.collectives.buffers import Workspace

    ws = Workspace(keep=2)
    a, b = ws.lease(), ws.lease()
    x = a(np.zeros(3, np.float32), 1000)  # 4,000 bytes
    y = b(np.zeros(3, np.float64), 10, np.float32)
    assert x.dtype == np.float32 and x.size == 1000 and y.dtype == np.float32 and y.size == 10
    assert not np.shares_memory(x, y)
    a.release()
    assert ws.nbytes == 4000
    c = ws.lease()
    z = c(np.zeros(1, np.float64), 100)  # 800 bytes fit in the freed 4,000
    assert ws.nbytes == 0 and np.shares_memory(z, x)
    c.release(), b.release()
    for n in (10_000, 20_000):  # beyond keep=2 the smallest is dropped
        d = ws.lease()
        d(np.zeros(1, np.uint8), n)
        d.release()
    assert ws.nbytes == 20_000 + 10_000


def test_a_failed_schedule_keeps_its_buffers_out_of_the_pool() -> None:
    from hpcdl.comm.collectives.buffers import Workspace
    from hpcdl.comm.collectives.schedule import CollRequest

    ws = Workspace()
    lease = ws.lease()

    def failing():
        lease(np.zeros(1), 100)
        yield []
        raise ZeroDivisionError("in the reduction")

    req = CollRequest(failing(), on_done=lease.release)
    with pytest.raises(ZeroDivisionError):
        req.Test()
    assert ws.nbytes == 0  # a receive might still write there: not reused
