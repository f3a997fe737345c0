"""The virtual-time engine: deadlocks and stalls reported, errors ended, runs deterministic."""

from __future__ import annotations

import time

import numpy as np
import pytest

import hpcdl.comm as hc
from hpcdl.sim.engine import RankFailure, SimAbort, SimDeadlock, simulate
from hpcdl.sim.ticks import TICKS_PER_SECOND


class LineNet:
    """alpha + S/B per message, sender and receiver channels serialised (the model's core)."""

    def __init__(self, alpha_s: float = 1e-6, bandwidth: int = 10**9) -> None:
        self.alpha = round(alpha_s * TICKS_PER_SECOND)
        self.bandwidth = bandwidth

    def reset(self, n: int) -> None:
        self.send_free, self.recv_free = [0] * n, [0] * n

    def send(self, src: int, dst: int, nbytes: int, t: int) -> tuple[int, int]:
        start = max(t, self.send_free[src], self.recv_free[dst])
        end = start + nbytes * TICKS_PER_SECOND // self.bandwidth
        self.send_free[src] = self.recv_free[dst] = end
        return end, end + self.alpha

    def describe(self) -> dict:
        return {"name": "line"}


class NoCompute:
    def segment(self, rank: int, seconds: float) -> int:
        return 0

    def layer_observer(self, rank: int, charge) -> None:
        return None

    def describe(self) -> dict:
        return {"mode": "none"}


class Measured(NoCompute):
    def segment(self, rank: int, seconds: float) -> int:
        return round(seconds * TICKS_PER_SECOND)


def run(n: int, body, **kw):
    network, compute = kw.pop("network", LineNet()), kw.pop("compute", NoCompute())
    return simulate(n, body, network=network, compute=compute, **kw)


def test_each_rank_sees_its_own_world_and_clock() -> None:
    def body():
        comm = hc.world()
        return comm.Get_rank(), comm.Get_size(), hc.wtime()

    result = run(4, body)
    assert result.results == [(r, 4, 0.0) for r in range(4)]


def test_a_ping_pong_takes_two_latencies_and_two_transfers() -> None:
    def body():
        comm = hc.world()
        buf = np.zeros(1000, dtype=np.uint8)
        if comm.Get_rank() == 0:
            comm.Send(buf, dest=1, tag=3)
            comm.Recv(buf, source=1, tag=3)
        else:
            comm.Recv(buf, source=0, tag=3)
            comm.Send(buf, dest=0, tag=3)
        return hc.wtime()

    result = run(2, body)
    assert result.results[0] == pytest.approx(2 * (1e-6 + 1000 / 1e9), abs=0)
    assert result.messages == 2


def test_a_deadlock_names_what_each_rank_waits_for() -> None:
    def body():
        comm = hc.world()
        buf = np.zeros(1)
        comm.Recv(buf, source=1 - comm.Get_rank(), tag=5)

    with pytest.raises(SimDeadlock) as info:
        run(2, body)
    text = str(info.value)
    assert "every unfinished rank is blocked" in text
    assert "rank 0 at t=" in text and "a receive from rank 1, tag 5, on the world" in text
    assert "rank 1 at t=" in text and "a receive from rank 0, tag 5" in text


def test_polling_for_what_never_comes_is_a_stall() -> None:
    polls = [0]

    def body():
        comm = hc.world()
        if comm.Get_rank() == 0:
            while not comm.Iprobe(source=1, tag=7):
                polls[0] += 1

    with pytest.raises(SimDeadlock, match=r"only poll(.|\n)*rank 0 at t=.*Iprobe\(source=1, tag=7\)"):
        run(2, body, stall_s=5.0)
    assert polls[0] < 50_000  # the stall is reached in few steps, not 5 s / poll cost = 5e7


def test_a_failing_rank_ends_the_run_with_its_number() -> None:
    def body():
        comm = hc.world()
        if comm.Get_rank() == 2:
            raise KeyError("boom")
        comm.Recv(np.zeros(1), source=2)  # would wait forever

    with pytest.raises(RankFailure) as info:
        run(3, body)
    assert info.value.rank == 2 and isinstance(info.value.exc, KeyError)


def test_abort_ends_the_run_with_its_code() -> None:
    def body():
        comm = hc.world()
        if comm.Get_rank() == 1:
            comm.Abort(7)
        comm.Barrier()

    with pytest.raises(SimAbort) as info:
        run(3, body)
    assert (info.value.errorcode, info.value.rank) == (7, 1)


def test_equal_times_go_by_rank_and_wildcards_are_deterministic() -> None:
    """Every rank sends to rank 0 at time 0: ANY_SOURCE takes them in arrival order, then rank order."""

    def body():
        comm = hc.world()
        rank, size = comm.Get_rank(), comm.Get_size()
        if rank == 0:
            order, status = [], hc.Status()
            for _ in range(size - 1):
                comm.Recv(np.zeros(size), source=hc.ANY_SOURCE, tag=hc.ANY_TAG, status=status)
                order.append((status.Get_source(), hc.wtime()))
            return order
        comm.Send(np.zeros(size - rank), dest=0, tag=rank)  # later ranks send less
        return None

    first = run(6, body).results[0]
    assert first == run(6, body).results[0]
    # incast: the receiver's channel serialises; equal ready times are taken in rank order
    assert [s for s, _ in first] == [1, 2, 3, 4, 5]


def test_a_failed_test_jumps_to_the_next_event() -> None:
    """A busy Test loop ends at the message's arrival, after few iterations."""

    def body():
        comm = hc.world()
        if comm.Get_rank() == 0:
            req = comm.Irecv(np.zeros(1000, dtype=np.uint8), source=1)
            polls = 0
            while not req.Test():
                polls += 1
            return hc.wtime(), polls
        comm.Send(np.zeros(1000, dtype=np.uint8), dest=0)
        return None

    (t, polls) = run(2, body, poll_cost_s=1e-9).results[0]
    assert t == pytest.approx(1e-6 + 1000 / 1e9, abs=0)
    assert polls < 5


def test_measured_compute_moves_the_clock() -> None:
    def body():
        t0 = hc.wtime()
        time.sleep(0.05)
        return hc.wtime() - t0

    result = run(2, body, compute=Measured())
    assert all(dt >= 0.05 for dt in result.results)  # the sleep is charged (no bound above: load varies)


def test_nonblocking_collectives_of_hpcdl_run_in_the_simulator() -> None:
    from hpcdl.comm.collectives import Collectives

    def body():
        comm = hc.world()
        x = np.arange(100, dtype=np.float64) + comm.Get_rank()
        with Collectives(comm, "ring") as coll:
            reqs = [coll.Iallreduce(x.copy(), out := np.empty_like(x)) for _ in range(1)]
            hc.waitall(reqs)
        return out

    result = run(5, body)
    expected = sum(np.arange(100) + r for r in range(5))
    for out in result.results:
        np.testing.assert_array_equal(out, expected)


# -- regressions found in review ----------------------------------------------------------------


def _compute(seconds: float) -> None:
    """Charge ``seconds`` of compute to this rank, as a cost table does for a layer."""
    w = hc.world()
    w._engine.charge(w._world_rank, round(seconds * TICKS_PER_SECOND))


def test_compute_between_polls_overlaps_the_transfer() -> None:
    """Test() between layers must not jump the clock: 10 x 0.1 ms of compute hide a 1 ms message."""

    def body():
        comm = hc.world()
        buf = np.zeros(10**6, dtype=np.uint8)
        if comm.Get_rank() == 1:
            comm.Send(buf, dest=0, tag=1)
            return None
        req = comm.Irecv(buf, source=1, tag=1)
        for _ in range(10):
            _compute(1e-4)
            req.Test()
        t = hc.wtime()
        req.Wait()
        return t, hc.wtime()

    t_compute, t_done = run(2, body).results[0]
    assert t_compute == pytest.approx(1e-3 + 10 * 1e-7, abs=1e-12)  # 10 x (0.1 ms + one failed poll)
    assert t_done == pytest.approx(1e-6 + 1e-3, abs=1e-12)  # the arrival: compute hid the transfer


def test_a_polled_send_completes_when_its_nic_is_done() -> None:
    def body():
        comm = hc.world()
        if comm.Get_rank() == 0:
            req = comm.Isend(np.zeros(10**6, dtype=np.uint8), dest=1)
            while not req.Test():
                pass
            return hc.wtime()
        _compute(10e-3)
        comm.Recv(np.zeros(10**6, dtype=np.uint8), source=0)
        return None

    assert run(2, body, network=LineNet(alpha_s=1e-3)).results[0] == pytest.approx(1e-3, abs=2e-9)


def test_a_rank_that_polled_and_returned_is_not_a_stall() -> None:
    def body():
        comm = hc.world()
        buf = np.zeros(1, dtype=np.uint8)
        if comm.Get_rank() == 0:
            comm.Iprobe()
            return "done"
        if comm.Get_rank() == 1:
            req = comm.Irecv(buf, source=2)
            while not req.Test():
                pass
            return hc.wtime()
        _compute(2.0)
        comm.Send(buf, dest=1)
        return None

    assert run(3, body, stall_s=1.0).results[1] == pytest.approx(2.0 + 1e-6, abs=1e-8)


def test_waitany_takes_the_receive_done_before_a_long_send() -> None:
    def body():
        comm = hc.world()
        big = np.zeros(10**6, dtype=np.uint8)
        if comm.Get_rank() == 0:
            reqs = [comm.Isend(big, dest=1, tag=1), comm.Irecv(np.zeros(1, dtype=np.uint8), source=1, tag=2)]
            index = hc.waitany(reqs)
            t = hc.wtime()
            hc.waitall(reqs)
            return index, t
        comm.Send(np.zeros(1, dtype=np.uint8), dest=0, tag=2)
        comm.Recv(big, source=0, tag=1)
        return None

    index, t = run(2, body).results[0]
    assert index == 1 and t == pytest.approx(1e-6 + 1e-9, abs=1e-12)


def test_a_wtime_timeout_in_a_polling_loop_fires_on_time() -> None:
    def body():
        comm = hc.world()
        t0 = hc.wtime()
        while hc.wtime() - t0 < 0.5:
            comm.Iprobe()
        return hc.wtime()

    for t in run(2, body, stall_s=10.0).results:
        assert 0.5 <= t < 0.5 * (1 + 2 / 1024)


def test_truncation_is_reported_on_the_receiving_rank() -> None:
    def body():
        comm = hc.world()
        rank = comm.Get_rank()
        if rank == 0:
            comm.Recv(np.zeros(1, dtype=np.uint8), source=1)
        elif rank == 1:
            comm.Send(np.zeros(8, dtype=np.uint8), dest=0)
            comm.Recv(np.zeros(1, dtype=np.uint8), source=2)  # blocked: it takes the arrival itself
        else:
            _compute(1.0)
            comm.Send(np.zeros(1, dtype=np.uint8), dest=1)

    with pytest.raises(RankFailure, match="message truncated: 8 bytes from rank 1") as info:
        run(3, body)
    assert info.value.rank == 0


def test_a_read_only_receive_buffer_is_reported_on_the_receiving_rank() -> None:
    def body():
        comm = hc.world()
        if comm.Get_rank() == 0:
            buf = np.zeros(4, dtype=np.uint8)
            buf.flags.writeable = False
            comm.Recv(buf, source=1)
        else:
            comm.Send(np.ones(4, dtype=np.uint8), dest=0)

    with pytest.raises(RankFailure, match="read-only") as info:
        run(2, body)
    assert info.value.rank == 0


def test_a_stall_cannot_be_swallowed_by_the_ranks_code() -> None:
    def body():
        comm = hc.world()
        for _ in range(3):
            try:
                while not comm.Iprobe():
                    pass
            except Exception:  # noqa: BLE001  (a retry loop, as fault-tolerant code writes them)
                continue
        return "gave up"

    with pytest.raises(SimDeadlock, match="only poll"):
        run(2, body, stall_s=0.01)


def test_teardown_ends_ranks_that_call_the_communicator_in_finally() -> None:
    log = []

    def body():
        comm = hc.world()
        rank = comm.Get_rank()
        try:
            if rank == 0:
                _compute(1e-3)
                comm.Iprobe()  # the others run first, and block
                raise KeyError("boom")
            comm.Recv(np.zeros(1, dtype=np.uint8), source=0)
        finally:
            log.append(rank)
            if rank != 0:
                comm.Recv(np.zeros(1, dtype=np.uint8), source=3 - rank)  # never completes

    with pytest.raises(RankFailure):
        run(3, body)
    assert sorted(log) == [0, 1, 2]


def test_a_request_listed_twice_completes_once() -> None:
    def body():
        comm = hc.world()
        if comm.Get_rank() == 0:
            req = comm.Irecv(np.zeros(1, dtype=np.uint8), source=1)
            hc.waitall([req, req])
            return "ok"
        comm.Send(np.zeros(1, dtype=np.uint8), dest=0)
        return "ok"

    assert run(2, body).results == ["ok", "ok"]


def test_an_inactive_request_tests_true_with_an_empty_status() -> None:
    def body():
        comm = hc.world()
        if comm.Get_rank() == 0:
            req = comm.Irecv(np.zeros(1), source=1, tag=3)
            req.Wait()
            status = hc.Status()
            assert not req and req.Test(status)
            req.Wait(status)
            return status.Get_source() == hc.ANY_SOURCE, status.Get_tag() == hc.ANY_TAG, status.Get_count()
        comm.Send(np.zeros(1), dest=0, tag=3)
        return None

    assert run(2, body).results[0] == (True, True, 0)


def test_collrequest_wait_runs_its_rounds_through_the_world_hook() -> None:
    """``CollRequest.Wait`` on virtual ranks: simulated and foreign requests, completion, errors."""
    from hpcdl.comm.collectives.schedule import CollRequest

    class Countdown:  # not a simulated request: the rounds that hold one are polled
        def __init__(self, n: int) -> None:
            self.n = n

        def Test(self, status=None) -> bool:  # noqa: N802
            self.n -= 1
            return self.n <= 0

        def Wait(self, status=None) -> None:  # noqa: N802
            self.n = 0

    def body():
        comm = hc.world()
        rank, size = comm.Get_rank(), comm.Get_size()
        got = np.zeros(1)
        done = []

        def schedule():
            yield [Countdown(3)]
            yield [
                comm.Irecv(got, (rank - 1) % size, 5),
                comm.Isend(np.full(1, rank + 1.0), (rank + 1) % size, 5),
            ]
            yield [Countdown(2), comm.Isend(np.zeros(1), rank, 6), comm.Irecv(np.zeros(1), rank, 6)]

        req = CollRequest(schedule(), on_done=lambda: done.append(True))
        req.Wait()
        assert not req and req.finished and done == [True]

        def failing():
            yield [comm.Isend(np.zeros(1), rank, 7), comm.Irecv(np.zeros(1), rank, 7)]
            raise ZeroDivisionError("in a reduction")

        bad = CollRequest(failing(), on_done=lambda: done.append(False))
        with pytest.raises(ZeroDivisionError):
            bad.Wait()
        assert bad.finished and done == [True]
        return float(got[0])

    res = run(3, body)
    assert res.results == [3.0, 1.0, 2.0]


def test_subclassed_models_are_called_as_written() -> None:
    """A Network subclass redefining send() and a ComputeModel subclass redefining segment() are used."""
    from hpcdl.sim.compute import ComputeModel, make_compute
    from hpcdl.sim.network import Link, Network

    class SlowNet(Network):
        def send(self, src, dst, nbytes, t):
            return t, t + TICKS_PER_SECOND  # every message takes a second

    class Flat(ComputeModel):
        def segment(self, rank, measured_s):
            return TICKS_PER_SECOND // 1000  # every segment a millisecond

    assert Flat().charges_segments and make_compute("measured").charges_segments
    assert not make_compute("none").charges_segments

    def body():
        comm = hc.world()
        if comm.Get_rank() == 0:
            comm.Send(np.zeros(1), dest=1)
        else:
            comm.Recv(np.zeros(1), source=0)
        return hc.wtime()

    net = SlowNet("slow", inter=Link(1.0, 1.0))
    res = simulate(2, body, network=net, compute=Flat())
    # rank 1: a segment before Recv (1 ms), the message sent at rank 0's 1 ms arrives a second
    # later, then the segment before wtime() (1 ms)
    assert res.results[1] == pytest.approx(1.0 + 0.002, abs=1e-12)


def test_a_run_that_leaves_a_receive_posted_is_freed() -> None:
    """Requests, communicators and the engine form cycles the garbage collector must see."""
    import gc
    import weakref

    worlds = []

    def pending():
        comm = hc.world()
        worlds.append(weakref.ref(comm))
        comm.Irecv(np.empty(4), hc.ANY_SOURCE, 99)  # never matched, never waited on

    def deadlocked():
        comm = hc.world()
        worlds.append(weakref.ref(comm))
        if comm.Get_rank() == 0:
            comm.Recv(np.empty(4), 1, 7)  # never sent

    run(2, pending)
    with pytest.raises(SimDeadlock):
        run(2, deadlocked)
    gc.collect()
    assert len(worlds) == 4 and all(w() is None for w in worlds)


def test_buffers_of_python_objects_are_refused() -> None:
    objects = np.empty(2, dtype=object)

    def sends_objects():
        comm = hc.world()
        if comm.Get_rank() == 0:
            comm.Send(objects, dest=1)

    def receives_into_objects():
        comm = hc.world()
        if comm.Get_rank() == 0:
            comm.Recv(objects, source=1)
        else:
            comm.Send(np.zeros(2), dest=0)

    for body in (sends_objects, receives_into_objects):
        with pytest.raises(RankFailure, match="arrays of Python objects") as info:
            run(2, body)
        assert info.value.rank == 0


def test_engine_internals_refuse_what_would_corrupt_memory() -> None:
    from hpcdl.sim.comm import SimRequest
    from hpcdl.sim.engine import Engine

    with pytest.raises(TypeError, match="made by the simulated communicator"):
        SimRequest()
    eng = Engine(2, LineNet(), NoCompute())
    with pytest.raises(IndexError, match="rank 5 outside the 2 ranks"):
        eng.charge(5, 1)
    with pytest.raises(IndexError):
        eng.clock(-1)
    with pytest.raises(TypeError, match="own requests"):
        eng.wait(0, [None], 1, "waitall")


def test_a_failed_run_with_flows_in_flight_frees_its_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """A flow holds its send request, which holds the engine: the teardown must drop the flows."""
    import gc
    import weakref

    from hpcdl.sim import engine as engine_module
    from hpcdl.sim.compute import make_compute
    from hpcdl.sim.network import load_network

    made: list[weakref.ref] = []
    init = engine_module.Engine.__init__

    def recording(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        init(self, *args, **kwargs)
        made.append(weakref.ref(self))

    monkeypatch.setattr(engine_module.Engine, "__init__", recording)

    def body():
        comm = hc.world()
        if comm.Get_rank() == 0:
            comm.Isend(np.zeros(10**7, dtype=np.uint8), dest=1)  # 10 MB: still going when rank 0 fails
            raise RuntimeError("boom")
        comm.Recv(np.zeros(10, dtype=np.uint8), source=0, tag=5)

    with pytest.raises(RankFailure, match="boom"):
        simulate(2, body, network=load_network("ib-hdr", 2), compute=make_compute("none"))
    gc.collect()
    assert made and all(ref() is None for ref in made)
