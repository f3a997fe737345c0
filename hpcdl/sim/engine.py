"""The virtual-time engine: N virtual ranks as greenlets in one process, in deterministic time order.

Each virtual rank is a greenlet running the same code a real rank runs, with its own
``contextvars`` context in which :func:`hpcdl.comm.world` is its simulated communicator
(:mod:`hpcdl.sim.comm`). Its code runs for real; between two communicator calls (a
*compute segment*) the wall time it took is turned into virtual time by the compute model.
Time is integer ticks (:mod:`hpcdl.sim.ticks`).

The engine is a conservative, sequential discrete-event simulator:

* every rank has a clock ``now[r]``; a rank may act on shared state (post a send, match a
  receive, test a request, probe) only when it is the earliest thing that can happen,
  ``(now[r], r)`` not after the next event ``(time, rank, seq)`` of the heap; otherwise it
  queues a *resume* event for itself and yields. Events at equal times are taken in the
  order (time, rank, sequence number): the run is deterministic.
* a message posted at ``t`` is given ``(t_sent, t_arrival)`` by the network model; its
  *arrival* event matches it against the receiver's posted receives (MPI's order:
  the first posted receive that matches, messages from one source in the order sent), or
  queues it as unexpected;
* a rank that waits for something not yet there blocks; the arrival that completes its
  wait queues its resume. A rank that must stop does not go back to a scheduler: it takes
  the next events itself and switches straight to the next rank to run.
* a failed ``Test``/``Iprobe`` costs ``poll_cost``; in a pure polling loop (nothing
  charged since the rank's last failed poll) nothing can change before the next event,
  so the clock then jumps to that event's time (one iteration per event, not one per
  ``poll_cost``), but not past a completion already known (a send's).

The run ends when every rank has returned, when one raises (the others are torn down and
the error reported with its rank), or in a **deadlock**: every unfinished rank blocked, or
only polling with nothing in flight for ``stall_s`` of virtual time. :class:`SimDeadlock`
then says which rank waits for what.
"""

from __future__ import annotations

import contextvars
import heapq
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from greenlet import GreenletExit, getcurrent, greenlet

from hpcdl.errors import HpcdlError
from hpcdl.sim.ticks import seconds, ticks

__all__ = ["Engine", "RankFailure", "SimAbort", "SimDeadlock", "SimResult", "simulate"]

_RESUME, _ARRIVE = 0, 1  # event kinds


class SimDeadlock(HpcdlError, RuntimeError):
    """Every unfinished virtual rank waits and nothing is in flight; the message says who waits for what."""


class _Stall(BaseException):
    """Raised inside a rank at a polling stall; :meth:`Engine.run` turns it into :class:`SimDeadlock`.

    A ``BaseException``, so that a rank's ``except Exception`` cannot swallow it.
    """


class SimAbort(BaseException):
    """Raised in a virtual rank by ``Abort``: ends the whole simulation with ``errorcode``."""

    def __init__(self, errorcode: int, rank: int) -> None:
        super().__init__(f"rank {rank} called Abort({errorcode})")
        self.errorcode = errorcode
        self.rank = rank


class RankFailure(RuntimeError):
    """A virtual rank raised: ``rank`` and the original exception (``__cause__``)."""

    def __init__(self, rank: int, exc: BaseException) -> None:
        super().__init__(f"virtual rank {rank} raised {type(exc).__name__}: {exc}")
        self.rank = rank
        self.exc = exc


@dataclass
class SimResult:
    """What :func:`simulate` returns.

    Attributes:
        results: each rank's return value, by world rank.
        times_s: each rank's virtual clock when it returned (seconds).
        messages: point-to-point messages delivered (collectives' included).
        events: events taken from the heap.
        wall_s: wall-clock seconds the simulation took.
        compute_wall_s: wall seconds spent in the ranks' compute segments; the rest of
            ``wall_s`` is the engine's (matching, copying, scheduling).
    """

    results: list[Any]
    times_s: list[float]
    messages: int
    events: int
    wall_s: float
    compute_wall_s: float = 0.0

    @property
    def makespan_s(self) -> float:
        """The latest rank's virtual time."""
        return max(self.times_s, default=0.0)


@dataclass
class _Rank:
    """The engine's view of one virtual rank."""

    rank: int
    glet: Any = None
    seg_start: float = 0.0  # perf_counter when its current compute segment began
    blocked: Any = None  # what it waits for (a _Wait), None when running or runnable
    polling: bool = False  # its last operation was a failed poll
    poll_clean: bool = False  # nothing charged since its last failed poll (a pure polling loop)
    token: int = 0  # its current wait; resume events of older waits are stale
    finished: bool = False
    result: Any = None
    last_op: Any = "start"  # a string or (function, *args): see _text
    observers: tuple[Any, ...] = field(default_factory=tuple)


class _Wait:
    """A blocked rank's wait: for ``remaining`` more of ``reqs`` to complete; ``what`` says what it is."""

    __slots__ = ("remaining", "reqs", "what")

    def __init__(self, reqs: Sequence[Any], remaining: int, what: Any) -> None:
        self.reqs = reqs
        self.remaining = remaining
        self.what = what

    def describe(self) -> str:
        """What the rank waits for (see :func:`_text`)."""
        return _text(self.what)


def _text(what: Any) -> str:
    """A description given as a string, or as ``(function, *args)`` built only when needed."""
    if isinstance(what, tuple):
        return what[0](*what[1:])
    return str(what)


class Engine:
    """Virtual time, the event heap, message matching, and the greenlets of the ranks.

    Args:
        size: number of virtual ranks.
        network: the network model (:mod:`hpcdl.sim.network`): ``send(src, dst, nbytes, t)
            -> (t_sent, t_arrival)``, ``reset(size)``.
        compute: the compute model (:mod:`hpcdl.sim.compute`): ``segment(rank, seconds)
            -> ticks`` and ``layer_observer(rank, charge)``.
        poll_cost_s: virtual seconds a failed ``Test``/``Iprobe`` costs.
        stall_s: virtual seconds of polling with nothing in flight that count as a deadlock.
    """

    def __init__(
        self, size: int, network: Any, compute: Any, *, poll_cost_s: float = 1e-7, stall_s: float = 10.0
    ) -> None:
        if size < 1:
            raise ValueError(f"a simulation needs at least one rank (got {size})")
        self.size = size
        self.network = network
        self.compute = compute
        self.poll_cost = max(1, ticks(poll_cost_s))
        self.stall = ticks(stall_s)
        self.now = [0] * size
        self.heap: list[tuple[int, int, int, int, Any]] = []
        self.seq = 0
        self.ranks = [_Rank(r) for r in range(size)]
        # matching: (context, world destination) -> posted receives / unexpected messages
        self.posted: dict[tuple[Any, int], list[Any]] = {}
        self.unexpected: dict[tuple[Any, int], list[Any]] = {}
        self.in_flight = 0  # arrivals queued
        self.n_done = 0
        self.n_waiting = 0  # blocked or polling, among unfinished ranks
        self.messages = 0
        self.events = 0
        self.t_progress = 0  # virtual time of the last delivery or completion
        self.direct: tuple[int, int] | None = None  # a resume taken straight from a delivery
        self.closing = False  # tearing down: communicator calls end the calling rank
        self.compute_wall = 0.0  # wall seconds of the ranks' compute segments (the rest is the engine's)
        self.main: Any = None
        self._net_send = network.send  # bound once: called for every message
        self._clock = time.perf_counter
        self._segment = compute.segment  # bound once: called on every communicator call

    # -- the run ------------------------------------------------------------------------------

    def run(self, target: Callable[[int], Any], contexts: Sequence[contextvars.Context]) -> SimResult:
        """Run ``target(rank)`` on every virtual rank, each in its context; return when all end.

        Raises:
            RankFailure: a rank raised (the others were torn down).
            SimAbort: a rank called ``Abort``.
            SimDeadlock: nothing can progress.
        """
        t_wall = self._clock()
        self.main = getcurrent()
        self.network.reset(self.size)
        for r in range(self.size):
            g = greenlet(self._body(r, target), parent=self.main)
            g.gr_context = contexts[r]
            self.ranks[r].glet = g
            g.switch()  # started from here: a shallow stack; it comes straight back
            self._push(0, r, _RESUME, None)
        failure: BaseException | None = None
        try:
            self._main_loop()
        except _Stall as stall:
            failure = SimDeadlock(str(stall))
        except BaseException as exc:  # noqa: BLE001  (a rank's error surfaces here; re-raised below)
            failure = exc
        finally:
            self._tear_down()
        if failure is not None:
            raise failure
        if self.n_done < self.size:
            raise SimDeadlock(
                self.deadlock_report("every unfinished rank is blocked and nothing is in flight")
            )
        return SimResult(
            results=[rk.result for rk in self.ranks],
            times_s=[seconds(t) for t in self.now],
            messages=self.messages,
            events=self.events,
            wall_s=self._clock() - t_wall,
            compute_wall_s=self.compute_wall,
        )

    def _body(self, r: int, target: Callable[[int], Any]) -> Callable[[], None]:
        def body() -> None:
            self.main.switch()  # back to run(): wait for the first resume event
            rk = self.ranks[r]
            rk.seg_start = self._clock()
            try:
                rk.result = target(r)
            except (GreenletExit, SimAbort, _Stall):
                raise
            except BaseException as exc:
                raise RankFailure(r, exc) from exc
            self.account(r, True)  # a rank that polled last is not polling any more
            rk.finished = True
            rk.last_op = "returned"
            self.n_done += 1
            self.t_progress = max(self.t_progress, self.now[r])

        return body

    def _main_loop(self) -> None:
        """Take events until none is left (ranks run from here or switch among themselves)."""
        while (k := self._next()) is not None:
            self.ranks[k].glet.switch()  # returns when a rank ends, or one meets an empty heap

    def _next(self) -> int | None:
        """Take events until one resumes a rank; set its clock and return it (None: none left).

        Arrivals are delivered on the way; resume events of waits already over are skipped.
        """
        heap = self.heap
        while heap or self.direct is not None:
            if self.direct is not None:
                t, k = self.direct
                self.direct = None
            else:
                t, k, _, kind, obj = heapq.heappop(heap)
                self.events += 1
                if kind == _ARRIVE:
                    self._deliver(t, obj)
                    continue
                if obj is not None and obj != self.ranks[k].token:
                    continue  # the wait it would end is over
            if t > self.now[k]:
                self.now[k] = t
            return k
        return None

    def _tear_down(self) -> None:
        """End every unfinished rank; from now on any communicator call ends its rank at once."""
        self.closing = True
        for rk in self.ranks:
            g = rk.glet
            while g is not None and not g.dead:
                try:
                    g.throw(GreenletExit)
                except GreenletExit:
                    pass
                except BaseException:  # noqa: BLE001  (a rank's cleanup failing while torn down: ignore)
                    pass

    # -- scheduling ---------------------------------------------------------------------------

    def _push(self, t: int, rank: int, kind: int, obj: Any) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, rank, self.seq, kind, obj))

    def account(self, r: int, progress: bool = False) -> None:
        """Charge rank ``r``'s compute segment so far to its clock (call on entering the engine).

        ``progress``: the call is not a poll (a rank that was polling is no longer).
        """
        rk = self.ranks[r]
        now = self._clock()
        dt = now - rk.seg_start
        rk.seg_start = now
        if dt > 0:
            self.compute_wall += dt
            charged = self._segment(r, dt)
            if charged:
                self.now[r] += charged
                rk.poll_clean = False
        if progress and rk.polling:
            rk.polling = False
            self.n_waiting -= 1

    def leave(self, r: int) -> None:
        """Rank ``r`` returns to its code: its next compute segment starts now.

        The engine's own work for the call (matching, copying a payload, scheduling) is
        not the rank's compute, so it is not charged to its clock.
        """
        self.ranks[r].seg_start = self._clock()

    def charge(self, r: int, t: int) -> None:
        """Add ``t`` ticks to rank ``r``'s clock (a cost-table layer, a modelled copy)."""
        self.now[r] += t
        if t:
            self.ranks[r].poll_clean = False  # compute between two polls: no jump to the next event

    def sync(self, r: int) -> None:
        """Return once rank ``r`` is the earliest thing that can happen (it may run others first)."""
        heap = self.heap
        if heap:
            top = heap[0]
            t = self.now[r]
            if top[0] < t or (top[0] == t and top[1] <= r):  # arrivals to r at t come first
                self._push(t, r, _RESUME, None)
                self._stop(r)

    def _stop(self, r: int) -> None:
        """Rank ``r`` cannot go on: take events until its own resume comes, switching to others."""
        if self.closing:
            raise GreenletExit
        k = self._next()
        if k is None:
            self.main.switch()  # nothing left: run() reports the deadlock and tears r down
        elif k != r:
            self.ranks[k].glet.switch()  # comes back when someone takes r's resume event
        self.ranks[r].seg_start = self._clock()

    # -- blocking and polling -------------------------------------------------------------------

    def wait(self, r: int, reqs: Sequence[Any], need: int, what: Any, charge: bool = False) -> None:
        """Block rank ``r`` until ``need`` of ``reqs`` have completed; its clock ends at the completion.

        Requests have ``t_done`` (None until complete; completion times of sends are known
        when posted, of receives when matched) and ``waiter``. ``need`` is 1 (any) or
        ``len(reqs)`` (all). ``what`` describes the wait for a deadlock report: a string,
        or ``(function, *args)`` giving one (built only then). ``charge``: called from the
        rank's code, whose compute segment is charged first (as :meth:`enter` does).
        """
        if charge:
            self.account(r, True)
        rk = self.ranks[r]
        if need == 1:
            # done when the earliest known completion is not in the future (a send's may be)
            known = min((q.t_done for q in reqs if q.t_done is not None), default=None)
            if known is None or known > self.now[r]:
                self._block(rk, reqs, 1, what, known)
            t = min(q.t_done for q in reqs if q.t_done is not None)
            if t > self.now[r]:
                self.now[r] = t
        else:
            done = 0
            for q in reqs:
                if q.t_done is not None:
                    done += 1
            if done < need:
                self._block(rk, reqs, need - done, what, None)
            now = self.now[r]
            for q in reqs:
                if q.t_done > now:
                    now = q.t_done
            self.now[r] = now
        self.sync(r)
        self.ranks[r].seg_start = self._clock()  # leave(r), inline

    def _block(self, rk: _Rank, reqs: Sequence[Any], remaining: int, what: Any, until: int | None) -> None:
        """Stop rank ``rk`` until ``remaining`` of ``reqs`` complete, or until tick ``until`` (if given)."""
        r = rk.rank
        rk.token += 1
        rk.blocked = _Wait(reqs, remaining, what)
        self.n_waiting += 1
        for q in reqs:
            if q.t_done is None:
                q.waiter = r
        if until is not None:  # a completion already known (a send's) ends the wait at the latest
            self.seq += 1
            heapq.heappush(self.heap, (until, r, self.seq, _RESUME, rk.token))
        self._stop(r)
        if rk.blocked is not None:  # resumed at ``until``, not by a completion
            rk.blocked = None
            self.n_waiting -= 1
            for q in reqs:
                if q.waiter == r:
                    q.waiter = None
        rk.token += 1  # a timer or wake-up of this wait still queued is stale now

    def enter(self, r: int) -> None:
        """Rank ``r`` calls the communicator: charge its compute, and wait for its turn."""
        if self.closing:
            raise GreenletExit
        self.account(r, True)
        self.sync(r)

    def poll_failed(self, r: int, what: Any, known: int | None = None) -> None:
        """A failed ``Test``/``Iprobe`` of rank ``r``: advance its clock, and detect a stall.

        A failed poll costs ``poll_cost``. When the rank polled before and computed nothing
        since (a pure polling loop), nothing can change before the next event, so its clock
        jumps there, but not past ``known`` (a completion time already known: a send's).
        """
        rk = self.ranks[r]
        t = self.now[r] + self.poll_cost
        if rk.polling and rk.poll_clean and self.heap and self.heap[0][0] > t:
            t = self.heap[0][0]
            if known is not None and t > known:
                t = max(known, self.now[r] + self.poll_cost)
        rk.poll_clean = True
        if not rk.polling:
            rk.polling = True
            self.n_waiting += 1
        rk.last_op = what
        if self.in_flight == 0 and self.n_waiting + self.n_done >= self.size:
            idle = t - self.t_progress
            if idle > self.stall:
                raise _Stall(
                    self.deadlock_report(
                        f"the ranks only poll, and nothing was delivered for {seconds(idle):.3g} virtual s"
                    )
                )
            # nothing can ever arrive: reach the stall limit in ~10^4 polls, each step at most
            # 1/1024 of the idle time (a wtime() timeout in the loop fires that late at most)
            t += max(self.poll_cost, idle >> 10)
        self.now[r] = t

    def progressed(self, r: int) -> None:
        """Rank ``r`` did something other than a failed poll."""
        rk = self.ranks[r]
        if rk.polling:
            rk.polling = False
            self.n_waiting -= 1

    # -- messages -------------------------------------------------------------------------------

    def post_send(self, r: int, msg: Any, dst: int) -> int:
        """Send ``msg`` (``nbytes``, its key) from world rank ``r`` to ``dst`` now; returns ``t_sent``."""
        t_sent, t_arrival = self._net_send(r, dst, msg.nbytes, self.now[r])
        self.in_flight += 1
        self.seq += 1
        heapq.heappush(self.heap, (t_arrival, dst, self.seq, _ARRIVE, msg))
        return t_sent

    def _deliver(self, t: int, msg: Any) -> None:
        """An arrival event: match ``msg`` with the first posted receive that takes it, or keep it."""
        self.in_flight -= 1
        self.messages += 1
        self.t_progress = t
        key = msg.key
        posted = self.posted.get(key)
        if posted:
            source, tag = msg.source, msg.tag
            for i, req in enumerate(posted):
                if (req.source < 0 or req.source == source) and (req.tag < 0 or req.tag == tag):
                    del posted[i]
                    req.complete(msg, t)
                    if req.waiter is not None:
                        self._wake(req)
                    return
        queue = self.unexpected.get(key)
        if queue is None:
            self.unexpected[key] = [msg]
        else:
            queue.append(msg)

    def probe_unexpected(self, key: Any, matches: Callable[[Any], bool]) -> Any:
        """The first unexpected message of ``key`` that ``matches``, left in place; or None."""
        for msg in self.unexpected.get(key, ()):
            if matches(msg):
                return msg
        return None

    def _wake(self, req: Any) -> None:
        """``req`` completed: resume its waiter if nothing else of its wait is missing."""
        r = req.waiter
        if r is None:
            return
        req.waiter = None
        rk = self.ranks[r]
        w = rk.blocked
        w.remaining -= 1
        if w.remaining <= 0:
            rk.blocked = None
            self.n_waiting -= 1
            for q in w.reqs:
                q.waiter = None
            t = req.t_done
            if t < self.now[r]:
                t = self.now[r]
            heap = self.heap
            if self.direct is None and (not heap or t < heap[0][0] or (t == heap[0][0] and r < heap[0][1])):
                self.direct = (t, r)  # the next thing to run anyway: skip the heap
            else:
                self.seq += 1
                heapq.heappush(heap, (t, r, self.seq, _RESUME, rk.token))

    # -- reports --------------------------------------------------------------------------------

    def deadlock_report(self, why: str) -> str:
        """One line per unfinished rank: what it waits for (operation, source, tag)."""
        lines = [f"simulation stalled: {why}"]
        for rk in self.ranks:
            if rk.finished:
                continue
            state = rk.blocked.describe() if rk.blocked is not None else _text(rk.last_op)
            lines.append(f"  rank {rk.rank} at t={seconds(self.now[rk.rank]):.9f} s: {state}")
        return "\n".join(lines)


def simulate(
    size: int,
    target: Callable[[], Any],
    *,
    network: Any = None,
    compute: Any = None,
    poll_cost_s: float = 1e-7,
    stall_s: float = 10.0,
) -> SimResult:
    """Run ``target()`` on ``size`` virtual ranks, each with :func:`hpcdl.comm.world` its own.

    Args:
        size: number of virtual ranks.
        target: what each rank runs (it finds its communicator with ``hpcdl.comm.world()``).
        network: a network model (default: :func:`hpcdl.sim.network.load_network` ``("shm-local")``).
        compute: a compute model (default: ``measured``).
        poll_cost_s: virtual cost of a failed ``Test``/``Iprobe``.
        stall_s: virtual seconds of fruitless polling that count as a deadlock.

    Returns:
        The :class:`SimResult`.

    Raises:
        RankFailure, SimAbort, SimDeadlock: see :meth:`Engine.run`.
    """
    from hpcdl.comm.context import set_world
    from hpcdl.nn.hooks import _observers
    from hpcdl.sim.comm import SimWorld

    if network is None:
        from hpcdl.sim.network import load_network

        network = load_network("shm-local", size)
    if compute is None:
        from hpcdl.sim.compute import make_compute

        compute = make_compute("measured")
    engine = Engine(size, network, compute, poll_cost_s=poll_cost_s, stall_s=stall_s)
    contexts = []
    for r in range(size):
        ctx = contextvars.copy_context()
        world = SimWorld(engine, r)
        ctx.run(set_world, world)
        obs = compute.layer_observer(r, lambda t, r=r: engine.charge(r, t))
        if obs is not None:
            ctx.run(_observers.set, (obs,))
        contexts.append(ctx)
    return engine.run(lambda r: target(), contexts)
