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
* a message posted at ``t`` becomes a flow of the network model (:mod:`hpcdl.sim.network`),
  sharing its channels with the flows under way; the network's next completion is one
  event of the heap, ordered before every rank's own events at its tick (rank -1), and
  re-queued whenever a new flow moves it (the old one goes stale). At a completion the
  sender's request completes (``t_sent``) and the message's *arrival* event is queued
  ``alpha`` later; the arrival matches it against the receiver's posted receives (MPI's
  order: the first posted receive that matches, messages from one source in the order
  sent), or queues it as unexpected. (A network object with its own ``send(src, dst,
  nbytes, t) -> (t_sent, t_arrival)`` is called instead, with both times fixed when the
  message is posted.)
* a rank that waits for something not yet there blocks; the arrival that completes its
  wait queues its resume. A rank that must stop does not go back to a scheduler: it takes
  the next events itself and switches straight to the next rank to run.
* a failed ``Test``/``Iprobe`` costs ``poll_cost``; in a pure polling loop (nothing
  charged since the rank's last failed poll) nothing can change before the next event,
  so the clock then jumps to that event's time (one iteration per event, not one per
  ``poll_cost``), but not past a completion already known (a send's, with a network
  object of fixed times; a flow's end is itself an event).

The run ends when every rank has returned, when one raises (the others are torn down and
the error reported with its rank), or in a **deadlock**: every unfinished rank blocked, or
only polling with nothing in flight for ``stall_s`` of virtual time. :class:`SimDeadlock`
then says which rank waits for what.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from greenlet import GreenletExit, getcurrent, greenlet

from hpcdl._ext.simcore import Core
from hpcdl.sim.errors import RankFailure, SimAbort, SimDeadlock, Stall
from hpcdl.sim.ticks import seconds, ticks

__all__ = ["Engine", "RankFailure", "SimAbort", "SimDeadlock", "SimResult", "simulate"]


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


class Engine(Core):
    """Virtual time, the event heap, message matching, and the greenlets of the ranks.

    The per-message work (clocks, heap, matching, waits, switching) is
    :class:`hpcdl._ext.simcore.Core`, in C; this class runs the ranks.

    Args:
        size: number of virtual ranks.
        network: the network model (:mod:`hpcdl.sim.network`: a ``NetCore`` whose flows the
            engine runs), or any object with ``send(src, dst, nbytes, t) -> (t_sent,
            t_arrival)`` and ``reset(size)``.
        compute: the compute model (:mod:`hpcdl.sim.compute`): ``segment(rank, seconds)
            -> ticks`` and ``layer_observer(rank, charge)``.
        poll_cost_s: virtual seconds a failed ``Test``/``Iprobe`` costs.
        stall_s: virtual seconds of polling with nothing in flight that count as a deadlock.
    """

    def __init__(
        self, size: int, network: Any, compute: Any, *, poll_cost_s: float = 1e-7, stall_s: float = 10.0
    ) -> None:
        # ticks are int64 picoseconds: a stall limit beyond ~100 days means "never"
        super().__init__(size, network, compute, ticks(poll_cost_s), min(ticks(stall_s), 2**62))
        #: the command line that started the simulation, up to the command's own arguments
        self.launcher = ""
        #: node memory being handed out (:meth:`SimComm.node_segments`): segments by rank, per call
        self.node_boards: dict[Any, dict[int, Any]] = {}

    def run(self, target: Callable[[int], Any], contexts: Sequence[contextvars.Context]) -> SimResult:
        """Run ``target(rank)`` on every virtual rank, each in its context; return when all end.

        Raises:
            RankFailure: a rank raised (the others were torn down).
            SimAbort: a rank called ``Abort``.
            SimDeadlock: nothing can progress.
        """
        t_wall = time.perf_counter()
        self.main = getcurrent()
        self.network.reset(self.size)
        for r in range(self.size):
            g = greenlet(self._body(r, target), parent=self.main)
            g.gr_context = contexts[r]
            g.switch()  # started from here: a shallow stack; it comes straight back
            self._start(r, g)
        failure: BaseException | None = None
        try:
            self._main_loop()
        except Stall as stall:
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
            results=self.results_list(),
            times_s=[seconds(t) for t in self.clocks()],
            messages=self.messages,
            events=self.events,
            wall_s=time.perf_counter() - t_wall,
            compute_wall_s=self.compute_wall,
        )

    def _body(self, r: int, target: Callable[[int], Any]) -> Callable[[], None]:
        def body() -> None:
            self.main.switch()  # back to run(): wait for the first resume event
            self._begin(r)
            try:
                result = target(r)
            except (GreenletExit, SimAbort, Stall):
                raise
            except BaseException as exc:
                raise RankFailure(r, exc) from exc
            self._returned(r, result)

        return body


def simulate(
    size: int,
    target: Callable[[], Any],
    *,
    network: Any = None,
    compute: Any = None,
    poll_cost_s: float = 1e-7,
    stall_s: float = 10.0,
    launcher: str = "",
) -> SimResult:
    """Run ``target()`` on ``size`` virtual ranks, each with :func:`hpcdl.comm.world` its own.

    Args:
        size: number of virtual ranks.
        target: what each rank runs (it finds its communicator with ``hpcdl.comm.world()``).
        network: a network model (default: :func:`hpcdl.sim.network.load_network` ``("shm-local")``).
        compute: a compute model (default: ``measured``, with the network's contention).
        poll_cost_s: virtual cost of a failed ``Test``/``Iprobe``.
        stall_s: virtual seconds of fruitless polling that count as a deadlock.
        launcher: the command line that starts this simulation, up to the command's own
            arguments (``python -m hpcdl.simulate -n 4 ... -m hpcdl.train``): what a
            command prints to say how to run it again (each rank's ``world().launcher()``);
            "" when the simulation was not started by a command.

    Returns:
        The :class:`SimResult`.

    Raises:
        RankFailure, SimAbort, SimDeadlock: see :meth:`Engine.run`.
    """
    from hpcdl.comm.context import set_world
    from hpcdl.nn.hooks import _observers
    from hpcdl.nn.init import shared_draws
    from hpcdl.sim.comm import SimWorld

    if network is None:
        from hpcdl.sim.network import load_network

        network = load_network("shm-local", size)
    if compute is None:
        from hpcdl.sim.compute import Contention, make_compute

        compute = make_compute("measured", contention=Contention.of_network(network, size))
    engine = Engine(size, network, compute, poll_cost_s=poll_cost_s, stall_s=stall_s)
    engine.launcher = launcher
    contexts = []
    for r in range(size):
        ctx = contextvars.copy_context()
        world = SimWorld(engine, r)
        ctx.run(set_world, world)
        obs = compute.layer_observer(r, lambda t, r=r: engine.charge(r, t))
        if obs is not None:
            ctx.run(_observers.set, (obs,))
        contexts.append(ctx)
    with shared_draws():  # the ranks' models are initialised alike: drawn once
        return engine.run(lambda r: target(), contexts)
