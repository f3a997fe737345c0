# cython: boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False, language_level=3
"""The simulator's core in C: the event queue, clocks, matching, waits, and point-to-point calls.

:mod:`hpcdl.sim.engine` and :mod:`hpcdl.sim.comm` describe the model; this module is
where their per-message work runs. Everything here is the same algorithm the docstrings
there describe, typed: every message costs a few microseconds of wall time, most of it
the greenlet switch and the two copies (the send buffer when posted, into the receive
buffer when matched), so that 1,024 virtual ranks exchange >100,000 messages per second.

* :class:`Core`: the ranks' clocks (integer ticks), the event heap (a binary heap of C
  structs ordered by ``(time, rank, sequence)``), per-rank state, MPI matching (posted
  receives and unexpected messages per ``(context, destination)``), blocking waits and
  the switch from one rank's greenlet straight to the next one's.
* :class:`Request` and :class:`Message`: a nonblocking operation, a message in flight.
  Payloads are ``bytes``: a private copy of the send buffer, taken when the send is posted.
* :class:`CommBase`: a rank's view of a communicator, with the point-to-point half of
  DESIGN.md's contract (``Isend``, ``Irecv``, ``Send``, ``Recv``, ``Sendrecv``,
  ``Iprobe``, the world hooks ``waitall``/``waitany``/``wtime``);
  :class:`hpcdl.sim.comm.SimComm` adds the collectives. :class:`CollView` is the
  collective context of one, for hpcdl's collective schedules.
* :class:`NetCore`: the network model's flows (full-duplex NICs, shared-memory links, the
  fat tree's leaf links, shared max-min fairly); :class:`hpcdl.sim.network.Network`
  configures it. Other network models (any object with ``send``) work too, called from here.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.mem cimport PyMem_Free, PyMem_Malloc, PyMem_Realloc
from cpython.ref cimport Py_DECREF, Py_INCREF, Py_XDECREF, PyObject
from libc.stdint cimport int64_t
from libc.string cimport memcpy, memset
from posix.time cimport CLOCK_MONOTONIC, clock_gettime, timespec

cimport cython
cimport numpy as cnp

import numpy as np
from greenlet import GreenletExit, getcurrent, greenlet

from hpcdl.sim.errors import RankFailure, SimAbort, Stall

cnp.import_array()

cdef object _ndarray = np.ndarray
cdef object _GreenletExit = GreenletExit

cdef enum:  # event kinds
    RESUME = 0
    ARRIVE = 1
    NETWORK = 2  # the network's next completion (rank -1: before any rank's own event at that tick)
    DELIVER = 3  # a message the switch rank has processed: delivered as it is (no second processing)

cdef int64_t TICKS_PER_SECOND = 1000000000000  # hpcdl.sim.ticks.TICKS_PER_SECOND


cdef inline double _wall() noexcept nogil:
    """Wall seconds (CLOCK_MONOTONIC, as ``time.perf_counter`` on Linux)."""
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + 1e-9 * ts.tv_nsec


cdef inline double _seconds(int64_t t) noexcept:
    return t / <double>TICKS_PER_SECOND


# -- buffers ----------------------------------------------------------------------------------------

def check_array(buf, str what):
    """``buf`` if it is a C-contiguous NumPy array; else a clear ``TypeError``/``ValueError``."""
    if not isinstance(buf, np.ndarray):
        if hasattr(buf, "get") and hasattr(buf, "__cuda_array_interface__"):
            raise TypeError(f"{what}: the simulator takes NumPy arrays (copy CuPy arrays to the host)")
        raise TypeError(f"{what}: the simulator takes NumPy arrays as buffers (got {type(buf).__name__})")
    if not buf.flags.c_contiguous:
        raise ValueError(f"{what}: buffers must be C-contiguous")
    if buf.dtype.hasobject:
        raise TypeError(f"{what}: arrays of Python objects cannot be buffers (send them with the lower-case methods)")
    return buf


cdef inline bint _plain_array(object buf):
    """An exact ndarray, C-contiguous, of plain numbers: its bytes can be copied as they are.

    False is not an error: :func:`check_array` then says whether the buffer is usable.
    """
    return (
        type(buf) is _ndarray
        and cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>buf)
        and not cnp.PyArray_ISOBJECT(<cnp.ndarray>buf)
        and not cnp.PyArray_HASFIELDS(<cnp.ndarray>buf)  # a record might hold objects: checked in Python
    )


cdef bytes _snapshot(object buf, str what):
    """A private copy of a send buffer's bytes (``bytes`` are immutable: kept as they are).

    A NumPy array is read through the C API (no buffer export: that allocates per call).
    """
    cdef cnp.ndarray a
    if type(buf) is bytes:
        return <bytes>buf
    if not _plain_array(buf):
        check_array(buf, what)  # raises: not an array, not C-contiguous, or of objects
    a = <cnp.ndarray>buf
    return PyBytes_FromStringAndSize(<char*>cnp.PyArray_DATA(a), cnp.PyArray_NBYTES(a))


# -- requests and messages --------------------------------------------------------------------------

@cython.no_gc  # holds no reference cycles: not tracked by the cyclic GC
@cython.freelist(4096)  # allocated and freed once per message
cdef class Message:
    """A message in flight or unexpected: its context and destination (world rank), source rank in the communicator, tag, payload."""

    cdef readonly int64_t cid
    cdef readonly int dst
    cdef readonly int source
    cdef readonly int tag
    cdef readonly bytes payload
    cdef readonly int64_t nbytes


cdef inline Message _message(int64_t cid, int dst, int source, int tag, bytes payload):
    cdef Message m = Message.__new__(Message)
    m.cid = cid
    m.dst = dst
    m.source = source
    m.tag = tag
    m.payload = payload
    m.nbytes = PyBytes_GET_SIZE(payload)
    return m


@cython.freelist(4096)
cdef class Request:
    """A simulated nonblocking send or receive (mpi4py's request methods).

    ``t_done`` is its completion tick (None: not yet): a send's when the network's flow
    ends (known when posted only with a network object of its own ``send``), a
    receive's when matched.
    """

    cdef readonly CommBase comm
    cdef readonly int64_t cid  # a receive's context id; -1 for a send
    cdef readonly object buf  # a receive's buffer (None: an object receive)
    cdef readonly int source, tag
    cdef int64_t _t_done  # -1: not complete
    cdef int waiter  # the blocked rank waiting on it, -1 if none
    cdef int st_source, st_tag
    cdef int64_t st_count
    cdef bint has_status
    cdef readonly object obj  # an object receive's payload (bytes)
    cdef object error  # raised in the receiving rank when it completes the request
    cdef bint _active

    def __init__(self):
        raise TypeError("requests are made by the simulated communicator (Isend, Irecv, ...)")

    def __cinit__(self):
        self.cid = -1
        self._t_done = -1
        self.waiter = -1
        self._active = True

    @property
    def t_done(self):
        return None if self._t_done < 0 else self._t_done

    cdef void complete(self, Message msg, int64_t t):
        """Copy ``msg`` into the receive buffer (or keep its bytes) and complete at tick ``t``."""
        cdef cnp.ndarray a
        cdef int64_t room
        if self.buf is None:
            self.obj = msg.payload
        else:  # a C-contiguous ndarray (checked when posted)
            a = <cnp.ndarray>self.buf
            room = cnp.PyArray_NBYTES(a)
            if not cnp.PyArray_ISWRITEABLE(a):
                self.error = ValueError("receive buffer is read-only")
            elif msg.nbytes > room:  # MPI_ERR_TRUNCATE, reported to the receiver
                self.error = ValueError(
                    f"message truncated: {msg.nbytes} bytes from rank {msg.source} (tag {msg.tag}) "
                    f"into a buffer of {room} bytes"
                )
            else:
                memcpy(cnp.PyArray_DATA(a), PyBytes_AS_STRING(msg.payload), msg.nbytes)
        self.st_source, self.st_tag, self.st_count = msg.source, msg.tag, msg.nbytes
        self.has_status = True
        self._t_done = t

    def Test(self, status=None):  # noqa: N802
        """True when complete at this rank's current virtual time (a failed test costs ``poll_cost``)."""
        cdef Core eng = self.comm._engine
        cdef int r = self.comm._world_rank
        if not self._active:  # completed and reported before: MPI's inactive request
            self._empty(status)
            return True
        eng._account(r, False)
        eng._sync(r)
        if 0 <= self._t_done <= eng.now[r]:
            eng._progressed(r)
            self._finish(status)
            eng.seg_start[r] = _wall()
            return True
        eng._poll_failed(r, (describe_all, "Test", (self,)), self._t_done)
        eng.seg_start[r] = _wall()
        return False

    def Wait(self, status=None):  # noqa: N802
        """Block (in virtual time) until complete."""
        if not self._active:
            self._empty(status)
            return
        self.comm._engine._wait(self.comm._world_rank, (self,), 1, "Wait", True)
        self._finish(status)

    cdef _empty(self, status):
        """MPI's empty status (an inactive request's): any source, any tag, no bytes."""
        if status is not None:
            status._fill(self.comm._any_source, self.comm._any_tag, 0)

    cdef _finish(self, status):
        self._active = False
        if status is not None and self.has_status:
            status._fill(self.st_source, self.st_tag, self.st_count)
        if self.error is not None:
            err, self.error = self.error, None  # no cycle through its traceback (not GC-tracked)
            raise err

    def __bool__(self):
        return self._active

    def describe(self):
        if self.cid < 0:
            return "a send"
        src = "ANY_SOURCE" if self.source < 0 else str(self.source)
        tag = "ANY_TAG" if self.tag < 0 else str(self.tag)
        where = self.comm._engine.context_of(self.cid)
        return f"a receive from rank {src}, tag {tag}, on {_name(where)}"


def _name(context):
    return "the world" if context == 0 else f"communicator {context!r}"


def describe_all(kind, reqs):
    """What a wait on ``reqs`` waits for (built only for a deadlock report)."""
    pending = [q for q in reqs if q.t_done is None]
    first = pending[0].describe() if pending else "completed requests"
    return f"{kind} of {len(reqs)} requests, {len(pending)} pending, e.g. {first}"


def describe_probe(source, tag, where):
    return f"polling Iprobe(source={source}, tag={tag}) on {where}"


def _text(what):
    """A description given as a string, or as ``(function, *args)`` built only when needed."""
    if isinstance(what, tuple):
        return what[0](*what[1:])
    return str(what)


cdef class _Wait:
    """A blocked rank's wait: for ``remaining`` more of ``reqs`` to complete in operation ``what``.

    One per rank, reused: a rank waits for one thing at a time.
    """

    cdef object reqs  # a tuple or list of Request
    cdef int remaining
    cdef str what


# -- the event heap ---------------------------------------------------------------------------------

cdef list _queue(list table, int rank, int64_t cid, bint create):
    """``table[rank][cid]``: a rank's posted receives or unexpected messages on one context.

    None when there is none and not ``create``. Indexed lists, not a dict: no key object
    to build and hash on every message.
    """
    cdef list per = <list>table[rank]
    cdef list q
    if cid < len(per):
        q = <list>per[cid]
        if q is None and create:
            q = per[cid] = []
        return q
    if not create:
        return None
    per.extend([None] * (cid + 1 - len(per)))
    q = per[cid] = []
    return q


cdef struct Event:
    int64_t t
    int64_t seq
    int rank
    int kind
    int64_t token  # RESUME: the wait it ends (-1: any); stale when the rank's token moved on
    PyObject* msg  # ARRIVE: the Message (a reference owned by the heap)


cdef inline bint _before(Event* a, Event* b) noexcept nogil:
    if a.t != b.t:
        return a.t < b.t
    if a.rank != b.rank:
        return a.rank < b.rank
    return a.seq < b.seq


# -- the engine -------------------------------------------------------------------------------------

cdef class Core:
    """Virtual time, the event heap, message matching, and the greenlets of the ranks.

    :class:`hpcdl.sim.engine.Engine` is this with ``run``; see its docstring for the model.

    Args:
        size: number of virtual ranks.
        network: the network model: a :class:`NetCore` (its flows run in C, their
            completions are events of the heap), or any object with ``send(src, dst,
            nbytes, t) -> (t_sent, t_arrival)`` and ``reset(size)``.
        compute: the compute model: ``segment(rank, seconds) -> ticks`` (not called when
            its ``charges_segments`` is False), ``layer_observer(rank, charge)``.
        poll_cost: ticks a failed ``Test``/``Iprobe`` costs (at least 1).
        stall: ticks of polling with nothing in flight that count as a deadlock.
    """

    cdef readonly int size
    cdef readonly object network, compute
    cdef object _net_send, _segment
    cdef NetCore _net
    cdef int64_t net_t, net_token  # the network's scheduled event: its tick (-1: none) and token
    cdef bint _charges
    cdef readonly int64_t poll_cost, stall
    cdef int64_t* now
    cdef double* seg_start
    cdef int64_t* token
    cdef char* polling  # its last operation was a failed poll
    cdef char* poll_clean  # nothing charged since its last failed poll (a pure polling loop)
    cdef char* finished
    cdef list glets, blocked, waits, last_op, results
    cdef Event* heap
    cdef Py_ssize_t n_heap, cap_heap
    cdef int64_t seq
    cdef list posted, unexpected  # [world rank][context id] -> list of Request / Message (or None)
    cdef dict _context_ids
    cdef list _contexts
    cdef public int64_t in_flight, n_done, n_waiting, messages, events, t_progress
    cdef bint has_direct  # a resume taken straight from a delivery
    cdef bint _batch  # waking several ranks at once: no direct resume
    cdef int64_t direct_t
    cdef int direct_r
    cdef public bint closing  # tearing down: communicator calls end the calling rank
    cdef public double compute_wall  # wall seconds of the ranks' compute segments
    cdef public object main

    def __cinit__(self, int size, *args, **kwargs):
        if size < 1:
            raise ValueError(f"a simulation needs at least one rank (got {size})")
        self.size = size
        self.now = <int64_t*>PyMem_Malloc(size * sizeof(int64_t))
        self.seg_start = <double*>PyMem_Malloc(size * sizeof(double))
        self.token = <int64_t*>PyMem_Malloc(size * sizeof(int64_t))
        self.polling = <char*>PyMem_Malloc(size)
        self.poll_clean = <char*>PyMem_Malloc(size)
        self.finished = <char*>PyMem_Malloc(size)
        self.cap_heap = 4 * size + 16
        self.heap = <Event*>PyMem_Malloc(self.cap_heap * sizeof(Event))
        if (not self.now or not self.seg_start or not self.token or not self.polling
                or not self.poll_clean or not self.finished or not self.heap):
            raise MemoryError()
        memset(self.now, 0, size * sizeof(int64_t))
        memset(self.seg_start, 0, size * sizeof(double))
        memset(self.token, 0, size * sizeof(int64_t))
        memset(self.polling, 0, size)
        memset(self.poll_clean, 0, size)
        memset(self.finished, 0, size)
        self.n_heap = 0

    def __init__(self, int size, network, compute, int64_t poll_cost, int64_t stall):
        self.network = network
        self.compute = compute
        self.poll_cost = max(1, poll_cost)
        self.stall = stall
        # a NetCore's flows are run in C, unless a subclass defines send() (called as written)
        self._net = (
            network
            if isinstance(network, NetCore)
            and getattr(type(network), "send", None) is None
            and "send" not in getattr(network, "__dict__", ())
            else None
        )
        self._net_send = None if self._net is not None else network.send  # bound once
        self.net_t = -1
        self._segment = compute.segment
        self._charges = bool(getattr(compute, "charges_segments", True))
        self.glets = [None] * size
        self.blocked = [None] * size
        self.waits = [_Wait.__new__(_Wait) for _ in range(size)]
        self.last_op = ["start"] * size
        self.results = [None] * size
        self.posted = [[] for _ in range(size)]
        self.unexpected = [[] for _ in range(size)]
        self._context_ids = {}
        self._contexts = []

    def __dealloc__(self):
        cdef Py_ssize_t i
        if self.heap != NULL:
            for i in range(self.n_heap):
                if self.heap[i].msg != NULL:
                    Py_DECREF(<object>self.heap[i].msg)
        PyMem_Free(self.now)
        PyMem_Free(self.seg_start)
        PyMem_Free(self.token)
        PyMem_Free(self.polling)
        PyMem_Free(self.poll_clean)
        PyMem_Free(self.finished)
        PyMem_Free(self.heap)

    # -- for Python: clocks, contexts, state ---------------------------------------------------

    cdef int _check(self, int r) except -1:
        """Refuse a rank outside the run (the C arrays are not bounds-checked)."""
        if not 0 <= r < self.size:
            raise IndexError(f"rank {r} outside the {self.size} ranks of this simulation")
        return 0

    def clock(self, int r):
        """Rank ``r``'s virtual clock, ticks."""
        self._check(r)
        return self.now[r]

    def clocks(self):
        """Every rank's virtual clock, ticks."""
        return [self.now[r] for r in range(self.size)]

    def context_id(self, context):
        """A small integer for a communicator context (hashable), the same on every rank."""
        cid = self._context_ids.get(context)
        if cid is None:
            cid = self._context_ids[context] = len(self._contexts)
            self._contexts.append(context)
        return cid

    def context_of(self, int64_t cid):
        """The context of a context id."""
        return self._contexts[cid]

    # -- the heap --------------------------------------------------------------------------------

    cdef void _push(self, int64_t t, int rank, int kind, int64_t token, object msg) except *:
        cdef Py_ssize_t i, parent
        cdef Event ev
        if self.n_heap == self.cap_heap:
            grown = <Event*>PyMem_Realloc(self.heap, 2 * self.cap_heap * sizeof(Event))
            if grown == NULL:
                raise MemoryError()
            self.heap = grown
            self.cap_heap *= 2
        self.seq += 1
        ev.t, ev.seq, ev.rank, ev.kind, ev.token = t, self.seq, rank, kind, token
        if msg is None:
            ev.msg = NULL
        else:
            Py_INCREF(msg)
            ev.msg = <PyObject*>msg
        i = self.n_heap
        self.n_heap += 1
        while i > 0:  # sift up
            parent = (i - 1) >> 1
            if _before(&ev, &self.heap[parent]):
                self.heap[i] = self.heap[parent]
                i = parent
            else:
                break
        self.heap[i] = ev

    cdef Event _pop(self) noexcept:
        cdef Event top = self.heap[0]
        cdef Event last
        cdef Py_ssize_t i = 0, child, n
        self.n_heap -= 1
        n = self.n_heap
        if n > 0:
            last = self.heap[n]
            while True:  # sift down
                child = 2 * i + 1
                if child >= n:
                    break
                if child + 1 < n and _before(&self.heap[child + 1], &self.heap[child]):
                    child += 1
                if _before(&self.heap[child], &last):
                    self.heap[i] = self.heap[child]
                    i = child
                else:
                    break
            self.heap[i] = last
        return top

    # -- scheduling ------------------------------------------------------------------------------

    cdef int _next(self) except -2:
        """Take events until one resumes a rank; set its clock and return it (-1: none left).

        Arrivals are delivered on the way; resume events of waits already over are skipped.
        """
        cdef Event ev
        cdef int64_t t
        cdef int k
        while self.n_heap or self.has_direct:
            if self.has_direct:
                t, k = self.direct_t, self.direct_r
                self.has_direct = False
            else:
                ev = self._pop()
                self.events += 1
                if ev.kind == ARRIVE or ev.kind == DELIVER:
                    msg = <Message>ev.msg
                    Py_DECREF(msg)  # the heap's reference; ``msg`` holds one
                    if ev.kind == ARRIVE and self._net is not None and (<Message>msg).dst == self._net._proc_rank \
                            and ev.token != self._net._proc_rank:  # at the switch rank: processed first
                        self._push(self._net.process(ev.token, ev.t), ev.rank, DELIVER, -1, msg)
                        continue
                    self._deliver(ev.t, msg)
                    continue
                if ev.kind == NETWORK:
                    if ev.token == self.net_token:
                        self.net_t = -1
                        self._net_advance(ev.t)
                    continue
                if ev.token >= 0 and ev.token != self.token[ev.rank]:
                    continue  # the wait it would end is over
                t, k = ev.t, ev.rank
            if t > self.now[k]:
                self.now[k] = t
            return k
        return -1

    def _main_loop(self):
        """Take events until none is left (ranks run from here or switch among themselves)."""
        cdef int k
        while True:
            k = self._next()
            if k < 0:
                return
            self.glets[k].switch()  # returns when a rank ends, or one meets an empty heap

    def _start(self, int r, glet):
        """Register rank ``r``'s greenlet (started, back at its first switch) and queue its start."""
        self._check(r)
        self.glets[r] = glet
        self._push(0, r, RESUME, -1, None)

    def _begin(self, int r):
        """Rank ``r``'s first compute segment starts now."""
        self._check(r)
        self.seg_start[r] = _wall()

    def _returned(self, int r, result):
        """Rank ``r``'s code returned ``result``."""
        self._check(r)
        self._account(r, True)  # a rank that polled last is not polling any more
        self.results[r] = result
        self.finished[r] = 1
        self.last_op[r] = "returned"
        self.n_done += 1
        if self.now[r] > self.t_progress:
            self.t_progress = self.now[r]

    def _tear_down(self):
        """End every unfinished rank; from now on any communicator call ends its rank at once."""
        self.closing = True
        if self._net is not None:
            self._net.clear()  # flows in flight hold requests, which hold the engine
        for g in self.glets:
            while g is not None and not g.dead:
                try:
                    g.throw(_GreenletExit)
                except _GreenletExit:
                    pass
                except BaseException:  # a rank's cleanup failing while torn down: ignore
                    pass

    def results_list(self):
        return list(self.results)

    cdef void _account(self, int r, bint progress) except *:
        """Charge rank ``r``'s compute segment so far to its clock (on entering the engine)."""
        cdef double now = _wall()
        cdef double dt = now - self.seg_start[r]
        cdef int64_t charged
        self.seg_start[r] = now
        if dt > 0:
            self.compute_wall += dt
            if self._charges:
                charged = self._segment(r, dt)
                if charged:
                    self.now[r] += charged
                    self.poll_clean[r] = 0
        if progress and self.polling[r]:
            self.polling[r] = 0
            self.n_waiting -= 1

    def charge(self, int r, int64_t t):
        """Add ``t`` ticks to rank ``r``'s clock (a cost-table layer, a modelled copy)."""
        self._check(r)
        self.now[r] += t
        if t:
            self.poll_clean[r] = 0  # compute between two polls: no jump to the next event

    def unmeasured(self, int r, work):
        """Run ``work()`` on rank ``r`` outside its compute segments: the compute model charges
        the segment so far, and nothing for ``work`` (whose cost a model charges instead)."""
        cdef double t0
        self._check(r)
        self._account(r, False)
        t0 = _wall()
        try:
            return work()
        finally:
            self.seg_start[r] = _wall()
            self.compute_wall += self.seg_start[r] - t0  # the ranks' work, not the engine's

    cdef void _sync(self, int r) except *:
        """Return once rank ``r`` is the earliest thing that can happen (it may run others first)."""
        cdef Event* top
        cdef int64_t t
        if self.n_heap:
            top = &self.heap[0]
            t = self.now[r]
            if top.t < t or (top.t == t and top.rank <= r):  # arrivals to r at t come first
                self._push(t, r, RESUME, -1, None)
                self._stop(r)

    cdef void _stop(self, int r) except *:
        """Rank ``r`` cannot go on: take events until its own resume comes, switching to others."""
        cdef int k
        if self.closing:
            raise _GreenletExit
        k = self._next()
        if k < 0:
            self.main.switch()  # nothing left: run() reports the deadlock and tears r down
        elif k != r:
            self.glets[k].switch()  # comes back when someone takes r's resume event
        self.seg_start[r] = _wall()

    cdef void _enter(self, int r) except *:
        """Rank ``r`` calls the communicator: charge its compute, and wait for its turn."""
        if self.closing:
            raise _GreenletExit
        self._account(r, True)
        self._sync(r)

    # -- blocking and polling ----------------------------------------------------------------------

    cdef void _wait(self, int r, object reqs, int need, str what, bint charge) except *:
        """Block rank ``r`` until ``need`` of ``reqs`` (1: any; all) have completed."""
        cdef Request q
        cdef int64_t known = -1, now
        cdef int done = 0
        if charge:
            self._account(r, True)
        if need == 1:
            # done when the earliest known completion is not in the future (a send's may be, with
            # a network of fixed times; with flows a send's completion is an event: not known yet)
            for q in reqs:
                if q._t_done >= 0 and (known < 0 or q._t_done < known):
                    known = q._t_done
            if known < 0 or known > self.now[r]:
                self._block(r, reqs, 1, what, known)
                known = -1
                for q in reqs:
                    if q._t_done >= 0 and (known < 0 or q._t_done < known):
                        known = q._t_done
            if known > self.now[r]:
                self.now[r] = known
        else:
            for q in reqs:
                if q._t_done >= 0:
                    done += 1
            if done < need:
                self._block(r, reqs, need - done, what, -1)
            now = self.now[r]
            for q in reqs:
                if q._t_done > now:
                    now = q._t_done
            self.now[r] = now
        self._sync(r)
        self.seg_start[r] = _wall()

    def wait(self, int r, reqs, int need, str what, bint charge=False):
        """Block rank ``r`` until ``need`` of ``reqs`` have completed; its clock ends at the completion.

        ``need`` is 1 (any) or ``len(reqs)`` (all). ``what`` names the operation for a
        deadlock report (``"waitall"``, ...). ``charge``: called from the rank's code,
        whose compute segment is charged first.
        """
        self._check(r)
        reqs = list(reqs)
        if not all(type(q) is Request for q in reqs):
            raise TypeError("Core.wait takes the simulator's own requests only")
        self._wait(r, reqs, need, what, charge)

    cdef void _block(self, int r, object reqs, int remaining, str what, int64_t until) except *:
        """Stop rank ``r`` until ``remaining`` of ``reqs`` complete, or until tick ``until`` (if >= 0)."""
        cdef Request q
        cdef _Wait w = <_Wait>self.waits[r]
        w.reqs, w.remaining, w.what = reqs, remaining, what
        self.token[r] += 1
        self.blocked[r] = w
        self.n_waiting += 1
        for q in reqs:
            if q._t_done < 0:
                q.waiter = r
        if until >= 0:  # a completion already known (a send's, fixed times) ends the wait at the latest
            self._push(until, r, RESUME, self.token[r], None)
        self._stop(r)
        if self.blocked[r] is not None:  # resumed at ``until``, not by a completion
            self.blocked[r] = None
            w.reqs = None
            self.n_waiting -= 1
            for q in reqs:
                if q.waiter == r:
                    q.waiter = -1
        self.token[r] += 1  # a timer or wake-up of this wait still queued is stale now

    cdef void _poll_failed(self, int r, object what, int64_t known) except *:
        """A failed ``Test``/``Iprobe``: advance the clock; in a pure polling loop jump to the next event.

        Not past ``known`` (a completion already known: a send's under a network of fixed
        times; -1: none; a flow's end is an event of the heap, which bounds the jump). Raises
        :class:`~hpcdl.sim.errors.Stall` when the ranks only poll and nothing is in flight
        for ``stall`` ticks.
        """
        cdef int64_t t = self.now[r] + self.poll_cost
        cdef int64_t idle, step
        if self.polling[r] and self.poll_clean[r] and self.n_heap and self.heap[0].t > t:
            t = self.heap[0].t
            if known >= 0 and t > known:
                t = max(known, self.now[r] + self.poll_cost)
        self.poll_clean[r] = 1
        if not self.polling[r]:
            self.polling[r] = 1
            self.n_waiting += 1
        self.last_op[r] = what
        if self.in_flight == 0 and self.n_waiting + self.n_done >= self.size:
            idle = t - self.t_progress
            if idle > self.stall:
                raise Stall(self.deadlock_report(
                    f"the ranks only poll, and nothing was delivered for {_seconds(idle):.3g} virtual s"
                ))
            # nothing can ever arrive: reach the stall limit in ~10^4 polls, each step at most
            # 1/1024 of the idle time (a wtime() timeout in the loop fires that late at most)
            step = idle >> 10
            t += step if step > self.poll_cost else self.poll_cost
        self.now[r] = t

    cdef inline void _progressed(self, int r) noexcept:
        """Rank ``r`` did something other than a failed poll."""
        if self.polling[r]:
            self.polling[r] = 0
            self.n_waiting -= 1

    # -- messages --------------------------------------------------------------------------------

    cdef int _post_send(self, int r, Message msg, int dst, Request req) except -1:
        """Send ``msg`` from world rank ``r`` to ``dst`` now; ``req`` completes when the sender's NIC is done."""
        cdef int64_t t_sent, t_arrival
        if self._net is not None:
            if not self._net.post(r, dst, msg.nbytes, self.now[r], msg, req, &t_sent, &t_arrival):
                self.in_flight += 1
                self._net_reschedule()  # its times come with the network's completions
                return 0
        else:
            t_sent, t_arrival = self._net_send(r, dst, msg.nbytes, self.now[r])
        self.in_flight += 1
        req._t_done = t_sent
        self._push(t_arrival, dst, ARRIVE, r, msg)  # ARRIVE's token: the sender's world rank
        return 0

    cdef void _net_reschedule(self) except *:
        """Keep one live event at the network's next completion (an earlier one goes stale)."""
        cdef int64_t t = self._net.next_time()
        if t != self.net_t:
            self.net_token += 1
            self.net_t = t
            if t >= 0:
                self._push(t, -1, NETWORK, self.net_token, None)

    cdef void _net_advance(self, int64_t t) except *:
        """The network's completions at ``t``: senders' requests complete, messages start to arrive."""
        cdef Py_ssize_t i, n = self._net.advance(t)
        cdef Ended e
        cdef Request req
        try:
            for i in range(n):
                self._net._take(i, &e)
                self._push(e.t_arrival, e.dst, ARRIVE, e.src, <Message>e.msg)
            self._batch = True  # several wakes at once: each through the heap, in (time, rank) order
            for i in range(n):
                self._net._take(i, &e)
                req = <Request>e.req
                req._t_done = e.t_sent
                if req.waiter >= 0:
                    self._wake(req)
        finally:
            self._batch = False
            for i in range(n):
                self._net._take(i, &e)
                Py_DECREF(<object>e.msg)
                Py_DECREF(<object>e.req)
            self._net._taken()
        self._net_reschedule()

    cdef void _deliver(self, int64_t t, Message msg) except *:
        """An arrival event: match ``msg`` with the first posted receive that takes it, or keep it."""
        cdef list posted, queue
        cdef Request req
        cdef Py_ssize_t i
        self.in_flight -= 1
        self.messages += 1
        self.t_progress = t
        posted = _queue(self.posted, msg.dst, msg.cid, False)
        if posted:
            for i in range(len(posted)):
                req = <Request>posted[i]
                if (req.source < 0 or req.source == msg.source) and (req.tag < 0 or req.tag == msg.tag):
                    del posted[i]
                    req.complete(msg, t)
                    if req.waiter >= 0:
                        self._wake(req)
                    return
        _queue(self.unexpected, msg.dst, msg.cid, True).append(msg)

    cdef void _wake(self, Request req) except *:
        """``req`` completed: resume its waiter if nothing else of its wait is missing."""
        cdef int r = req.waiter
        cdef _Wait w
        cdef Request q
        cdef int64_t t
        if r < 0:
            return
        req.waiter = -1
        w = <_Wait>self.blocked[r]
        w.remaining -= 1
        if w.remaining <= 0:
            self.blocked[r] = None
            self.n_waiting -= 1
            for q in w.reqs:
                q.waiter = -1
            w.reqs = None
            t = req._t_done
            if t < self.now[r]:
                t = self.now[r]
            if not self.has_direct and not self._batch and (
                not self.n_heap or t < self.heap[0].t or (t == self.heap[0].t and r < self.heap[0].rank)
            ):
                self.has_direct, self.direct_t, self.direct_r = True, t, r  # next anyway: skip the heap
            else:
                self._push(t, r, RESUME, self.token[r], None)

    cdef Message _take_unexpected(self, int rank, int64_t cid, int source, int tag, bint remove):
        """The first unexpected message to ``rank`` on ``cid`` matching ``source``/``tag`` (-1: any), or None."""
        cdef list queue = _queue(self.unexpected, rank, cid, False)
        cdef Message msg
        cdef Py_ssize_t i
        if queue:
            for i in range(len(queue)):
                msg = <Message>queue[i]
                if (source < 0 or source == msg.source) and (tag < 0 or tag == msg.tag):
                    if remove:
                        del queue[i]
                    return msg
        return None

    # -- reports ---------------------------------------------------------------------------------

    def deadlock_report(self, why):
        """One line per unfinished rank: what it waits for (operation, source, tag)."""
        lines = [f"simulation stalled: {why}"]
        for r in range(self.size):
            if self.finished[r]:
                continue
            w = self.blocked[r]
            if w is not None:
                state = describe_all((<_Wait>w).what, (<_Wait>w).reqs)
            else:
                state = _text(self.last_op[r])
            lines.append(f"  rank {r} at t={_seconds(self.now[r]):.9f} s: {state}")
        return "\n".join(lines)


# -- communicators ----------------------------------------------------------------------------------

cdef class CommBase:
    """One virtual rank's view of a simulated communicator: its point-to-point half.

    Args:
        engine: the engine (a :class:`Core`).
        world_rank: the owning virtual rank.
        context: this communicator's context (hashable, the same on every member); its
            collectives use ``(context, "coll")``.
        group: the world ranks of the members, by rank in this communicator.
    """

    cdef readonly Core _engine
    cdef readonly int _world_rank, _rank, _size
    cdef readonly object _context
    cdef readonly tuple _group
    cdef readonly int64_t _cid, _ccid  # context ids of the point-to-point and the collective context
    cdef readonly object _any_source, _any_tag, _in_place, _sum, _max, _min
    cdef dict __dict__  # SimComm's own attributes

    def __init__(self, Core engine, int world_rank, context, group):
        import hpcdl.comm as hc

        self._engine = engine
        self._world_rank = world_rank
        self._context = context
        self._group = tuple(group)
        self._rank = self._group.index(world_rank)
        self._size = len(self._group)
        self._cid = engine.context_id(context)
        self._ccid = engine.context_id((context, "coll"))
        self._any_source, self._any_tag, self._in_place = hc.ANY_SOURCE, hc.ANY_TAG, hc.IN_PLACE
        self._sum, self._max, self._min = hc.SUM, hc.MAX, hc.MIN

    @property
    def rank(self):
        return self._rank

    @property
    def size(self):
        return self._size

    def Get_rank(self):  # noqa: N802
        return self._rank

    def Get_size(self):  # noqa: N802
        return self._size

    # -- world hooks (hpcdl.comm) ----------------------------------------------------------------

    def wtime(self):
        """This rank's virtual clock, in seconds (its compute so far charged first)."""
        self._engine._account(self._world_rank, False)
        return _seconds(self._engine.now[self._world_rank])

    def waitall(self, reqs):
        """Block until every request completes, if all are simulated ones; False otherwise."""
        return self._waitall(reqs)

    def run_rounds(self, gen, pending):
        """World hook: wait for each round of a collective schedule, advance it, until it ends.

        What :meth:`hpcdl.comm.collectives.schedule.CollRequest.Wait` does round by round,
        in C. ``gen`` is the schedule (a generator yielding each round's requests),
        ``pending`` the current round's requests. Returns when ``gen`` is exhausted; its
        exceptions propagate.
        """
        while True:
            if not self._waitall(pending):  # not only simulated requests: poll them
                from hpcdl.comm.context import _waitall_polling

                _waitall_polling(pending)
            try:
                pending = next(gen)
            except StopIteration:
                return

    cdef bint _waitall(self, reqs) except -1:
        cdef list active = []
        cdef Request q
        cdef Py_ssize_t i, j, n
        for x in reqs:
            if x is not None and x:
                if type(x) is not Request:
                    return False
                active.append(x)
        n = len(active)
        if n:
            if n > 1:  # a request listed twice completes once
                for i in range(n - 1, 0, -1):
                    for j in range(i):
                        if active[j] is active[i]:
                            del active[i]
                            break
                n = len(active)
            self._engine._wait(self._world_rank, active, n, "waitall", True)
            for q in active:
                q._finish(None)
        return True

    def waitany(self, reqs, status=None):
        """Block until one request completes, if all are simulated ones.

        Returns:
            ``(True, index)`` (``index`` None when no request is active), or ``(False, None)``
            when some request is not a simulated one (the caller polls instead).
        """
        cdef Core eng = self._engine
        cdef int r = self._world_rank
        cdef Request q
        active = [i for i, x in enumerate(reqs) if x is not None and x]
        if not all(type(reqs[i]) is Request for i in active):
            return False, None
        if not active:
            return True, None
        qs = list({id(reqs[i]): reqs[i] for i in active}.values())
        eng._wait(r, qs, 1, "waitany", True)
        now = eng.now[r]
        _, index = min(
            ((<Request>reqs[i])._t_done, i) for i in active
            if 0 <= (<Request>reqs[i])._t_done <= now
        )
        (<Request>reqs[index])._finish(status)
        return True, index

    # -- point-to-point --------------------------------------------------------------------------

    cdef int _peer(self, int peer, str what) except -1:
        if not 0 <= peer < self._size:
            raise ValueError(f"{what} {peer} out of range for a communicator of {self._size} ranks")
        return peer

    cdef Request _isend(self, object buf, int dest, int tag, int64_t cid):
        """Post a send of ``buf`` (an array, copied; or ``bytes``, kept) from the rank's code."""
        cdef Core eng = self._engine
        cdef Request req
        eng._enter(self._world_rank)
        req = self._post_send(_snapshot(buf, "Isend"), dest, tag, cid)  # the copy is the engine's work
        eng.seg_start[self._world_rank] = _wall()
        return req

    cdef Request _post_send(self, bytes payload, int dest, int tag, int64_t cid):
        """Post a send now (the rank has entered the engine)."""
        cdef int dst
        cdef Request req
        if not 0 <= dest < self._size:
            self._peer(dest, "dest")
        dst = self._group[dest]
        req = Request.__new__(Request)
        req.comm = self
        self._engine._post_send(self._world_rank, _message(cid, dst, self._rank, tag, payload), dst, req)
        return req

    cdef Request _irecv(self, object buf, object source, object tag, int64_t cid):
        cdef Core eng = self._engine
        cdef Request req
        eng._enter(self._world_rank)
        req = self._post_recv(buf, source, tag, cid)
        eng.seg_start[self._world_rank] = _wall()
        return req

    cdef Request _post_recv(self, object buf, object source, object tag, int64_t cid):
        """Post a receive now (the rank has entered the engine): match an unexpected message, or wait."""
        cdef Core eng = self._engine
        cdef int src, tg
        cdef Request req
        cdef Message msg
        if buf is not None and not _plain_array(buf):
            check_array(buf, "Irecv")  # raises
        if source is self._any_source or source == -1:
            src = -1
        else:
            src = self._peer(source, "source")
        tg = -1 if tag is self._any_tag or tag == -1 else tag
        req = Request.__new__(Request)
        req.comm, req.cid, req.buf, req.source, req.tag = self, cid, buf, src, tg
        msg = eng._take_unexpected(self._world_rank, cid, src, tg, True)
        if msg is not None:
            req.complete(msg, eng.now[self._world_rank])
            return req
        _queue(eng.posted, self._world_rank, cid, True).append(req)
        return req

    def Isend(self, buf, int dest, int tag=0):  # noqa: N802
        return self._isend(buf, dest, tag, self._cid)

    def Irecv(self, buf, source=-1, tag=-1):  # noqa: N802
        if buf is None:
            check_array(buf, "Irecv")  # raises: None is for the lower-case (object) methods
        return self._irecv(buf, source, tag, self._cid)

    def Send(self, buf, int dest, int tag=0):  # noqa: N802
        self.Isend(buf, dest, tag).Wait()

    def Recv(self, buf, source=-1, tag=-1, status=None):  # noqa: N802
        self.Irecv(buf, source, tag).Wait(status)

    def Sendrecv(self, sendbuf, int dest, int sendtag=0, recvbuf=None, source=-1, recvtag=-1, status=None):  # noqa: N802
        cdef Core eng = self._engine
        cdef int r = self._world_rank
        cdef Request rreq, sreq
        if not _plain_array(recvbuf):
            check_array(recvbuf, "Sendrecv recvbuf")
        eng._enter(r)
        payload = _snapshot(sendbuf, "Sendrecv sendbuf")  # copied inside the engine: not the rank's compute
        rreq = self._post_recv(recvbuf, source, recvtag, self._cid)
        sreq = self._post_send(payload, dest, sendtag, self._cid)
        reqs = (rreq, sreq)
        eng._wait(r, reqs, 2, "Sendrecv", False)
        sreq._active = False
        rreq._finish(status)

    def Iprobe(self, source=-1, tag=-1, status=None):  # noqa: N802
        cdef Core eng = self._engine
        cdef int r = self._world_rank
        cdef int src = -1 if source is self._any_source or source == -1 else source
        cdef int tg = -1 if tag is self._any_tag or tag == -1 else tag
        cdef Message msg
        eng._account(r, False)
        eng._sync(r)
        msg = eng._take_unexpected(r, self._cid, src, tg, False)
        if msg is None:
            eng._poll_failed(r, (describe_probe, source, tag, _name(self._context)), -1)
            eng.seg_start[r] = _wall()
            return False
        eng._progressed(r)
        eng.seg_start[r] = _wall()
        if status is not None:
            status._fill(msg.source, msg.tag, msg.nbytes)
        return True

    # -- the collective context ------------------------------------------------------------------

    def _csend(self, obj, int dest, int tag=0):
        """Send ``obj`` (an array: copied; bytes: as is) on the collective context."""
        return self._isend(obj, dest, tag, self._ccid)

    def _crecv(self, buf, source, int tag=0):
        return self._irecv(buf, source, tag, self._ccid)

    def _collective_view(self):
        """The collective context, with the point-to-point methods hpcdl's schedules call."""
        cdef CollView v = CollView.__new__(CollView)
        v._comm = self
        return v


cdef class CollView:
    """The collective context of a communicator: ``Get_rank``, ``Get_size``, ``Isend``, ``Irecv``."""

    cdef CommBase _comm

    def __init__(self):
        raise TypeError("a collective view is made by its communicator (_collective_view)")

    def Get_rank(self):  # noqa: N802
        return self._comm._rank

    def Get_size(self):  # noqa: N802
        return self._comm._size

    def Isend(self, buf, int dest, int tag=0):  # noqa: N802
        return self._comm._isend(buf, dest, tag, self._comm._ccid)

    def Irecv(self, buf, source, int tag=0):  # noqa: N802
        return self._comm._irecv(buf, source, tag, self._comm._ccid)


# -- the network model: flows sharing their channels (max-min fair) ---------------------------------

cdef inline int64_t _ceil_div(int64_t a, int64_t b) noexcept:
    """``ceil(a / b)`` for ``a >= 0, b > 0`` (C division truncates: ``-(-a // b)`` would not do)."""
    return (a + b - 1) // b


cdef extern from *:
    """
    typedef __int128 hpcdl_i128;
    /* ceil(a / b) for a >= 0, b > 0, in 128 bits (remaining work is bytes * 10^12) */
    static inline int64_t hpcdl_ceil128(__int128 a, int64_t b) {
        return (int64_t)((a + b - 1) / b);
    }
    """
    ctypedef long long i128 "hpcdl_i128"
    int64_t _ceil128 "hpcdl_ceil128"(i128 a, int64_t b) noexcept nogil


cdef enum:  # a flow's state
    F_FREE = 0
    F_QUEUED = 1  # behind an earlier message of the same (source, destination) pair
    F_ACTIVE = 2  # on its channels, sharing them


cdef struct Flow:
    int64_t src, dst, alpha, key
    int nres
    int res[4]  # its channels: send side, receive side, a fat tree's uplink and downlink
    int64_t nxt[4]  # the next and previous flow on each channel (flow * 4 + slot; -1: none)
    int64_t prv[4]
    i128 rem  # work left: bytes * TICKS_PER_SECOND (a channel of B bytes/s does B per tick)
    int64_t num, den  # its rate, num / den bytes per second (num 0: not rated yet)
    int64_t new_num, new_den  # the rate of the sharing being computed
    int64_t t_last  # the tick ``rem`` was brought up to date
    int64_t t_end  # when it ends at its rate (-1: not rated)
    int64_t version  # a completion event of another version is stale
    int64_t ev_version  # the version of its last completion event pushed (-1: none)
    int64_t pair_next  # the next message of its pair, queued behind it (-1: none)
    int64_t mark, fixed  # epochs: in the component being shared out; rate fixed in it
    int state
    PyObject* msg  # owned references, handed to the caller when the flow ends
    PyObject* req


cdef struct Completion:
    int64_t t
    int64_t seq
    int64_t fid
    int64_t version


cdef struct Ended:
    PyObject* msg  # owned references
    PyObject* req
    int64_t t_sent, t_arrival, src, dst


cdef inline bint _earlier(Completion* a, Completion* b) noexcept nogil:
    if a.t != b.t:
        return a.t < b.t
    return a.seq < b.seq


cdef class NetCore:
    """The flow-level network of :class:`hpcdl.sim.network.Network` (see there for the model).

    Channels: each NIC's send and receive side (per rank, or per node), each rank's
    shared-memory send and receive side, and in a fat tree each leaf's uplink and
    downlink. A message is a *flow* over its channels from when it is posted (or when the
    previous message of its pair ends) until its bytes are through; the flows on a channel
    share its bandwidth max-min fairly, recomputed over the connected flows whenever one
    starts or ends. Rates are whole bytes per second and the work left is kept in exact
    128-bit integers, so a run is reproducible bit for bit and a flow alone on its
    channels takes ``ceil(S / B)`` ticks exactly, as before.

    A switch rank (``[switch]``, :mod:`hpcdl.sim.switch`) in switch mode has a send and a
    receive port per peer rank instead of a NIC (channels after the others); in either
    mode each message it receives is processed by a FIFO server (one, or one per source
    rank) before delivery: :meth:`process`, called in arrival order by the engine when the
    arrival event is taken, and by :meth:`schedule`.

    The engine (:class:`Core`) posts messages (:meth:`post`), asks for the next completion
    (:meth:`next_time`) and lets the network reach it (:meth:`advance`), which hands back
    the messages that ended. :meth:`schedule` does the same for a list of messages, without
    an engine (the tests' and the analyses' entry).
    """

    cdef int64_t* _cap  # capacity of each channel, bytes per second
    cdef int64_t* _head  # first flow on each channel (flow * 4 + slot; -1: none)
    cdef int64_t* _count  # flows on each channel
    cdef int64_t* _rmark  # epoch: in the component being shared out
    cdef int64_t* _rcap  # capacity not yet given out while sharing
    cdef int64_t* _rn  # flows on the channel whose rate is not fixed yet
    cdef Py_ssize_t _nchan
    cdef int64_t _n_nics, _n_ranks, _n_leaves
    cdef int64_t _rpn, _npl
    cdef int64_t _intra_alpha, _intra_bps, _inter_alpha, _inter_bps, _uplink_bps, _leaf_alpha
    cdef bint _nic_node, _fat_tree
    cdef Flow* _flows
    cdef Py_ssize_t _cap_flows, _n_used
    cdef int64_t _free_head  # a free list threaded through pair_next
    cdef Completion* _heap
    cdef Py_ssize_t _n_heap, _cap_heap
    cdef int64_t _seq, _epoch
    cdef dict _pairs  # (src * n_ranks + dst) -> the last flow of the pair still going
    cdef Ended* _ended
    cdef Py_ssize_t _n_ended, _cap_ended
    cdef int64_t* _stack  # scratch for the component search: channels, then flows
    cdef int64_t* _comp_flows
    cdef int64_t* _comp_res
    cdef int64_t* _seeds  # channels whose flows are to be shared out again
    cdef int64_t* _due  # flows ending at the tick being reached
    cdef Py_ssize_t _cap_comp, _n_res
    cdef Py_ssize_t _n_active  # flows on their channels (the heap is compacted against it)
    # the switch rank ([switch] of the network file; -1: none)
    cdef int64_t _sw_rank  # the rank whose messages go through a port per peer (switch mode; -1: none)
    cdef int64_t _port_base  # its send port for peer p: channel _port_base + p; receive port: + n_ranks + p
    cdef int64_t _port_bps
    cdef readonly int64_t _proc_rank  # the rank that processes each message it receives (-1: none)
    cdef int64_t _proc_cost  # ticks per message received, > 0
    cdef bint _proc_parallel  # a server per source rank (port), else one server
    cdef int64_t* _busy  # each server's tick free again

    def __cinit__(self, *args, **kwargs):
        self._free_head = -1
        self._pairs = {}
        self._sw_rank = self._proc_rank = -1

    def __dealloc__(self):
        self._drop_flows()
        PyMem_Free(self._cap)
        PyMem_Free(self._head)
        PyMem_Free(self._count)
        PyMem_Free(self._rmark)
        PyMem_Free(self._rcap)
        PyMem_Free(self._rn)
        PyMem_Free(self._flows)
        PyMem_Free(self._heap)
        PyMem_Free(self._ended)
        PyMem_Free(self._stack)
        PyMem_Free(self._comp_flows)
        PyMem_Free(self._comp_res)
        PyMem_Free(self._seeds)
        PyMem_Free(self._due)
        PyMem_Free(self._busy)

    cdef void _drop_flows(self) noexcept:
        """Release every flow's references (and those of ended flows not taken)."""
        cdef Py_ssize_t i
        for i in range(self._n_used):
            if self._flows[i].state != F_FREE:
                Py_XDECREF(self._flows[i].msg)
                Py_XDECREF(self._flows[i].req)
                self._flows[i].msg = self._flows[i].req = NULL
                self._flows[i].state = F_FREE
        for i in range(self._n_ended):
            Py_XDECREF(self._ended[i].msg)
            Py_XDECREF(self._ended[i].req)
        self._n_ended = 0

    def _configure(self, int64_t ranks_per_node, intra, inter, bint nic_node, bint fat_tree,
                   int64_t nodes_per_leaf, int64_t uplink_bps, int64_t leaf_alpha, int64_t nranks,
                   int64_t switch_rank=-1, bint switch_ports=False, int64_t port_bps=1,
                   int64_t per_packet=0, bint parallel=False):
        """Set the parameters and fresh, idle channels for ``nranks`` ranks (``intra``/``inter``: Links or None).

        ``switch_rank`` (-1: none) pays ``per_packet`` ticks per message it receives (one
        server, or one per source rank when ``parallel``); with ``switch_ports`` its messages
        use a port per peer of ``port_bps`` (and the inter-node latency) instead of a NIC.
        """
        cdef int64_t nodes, i, base
        self._rpn = ranks_per_node
        self._npl = nodes_per_leaf
        self._nic_node, self._fat_tree = nic_node, fat_tree
        self._intra_alpha = intra.alpha if intra is not None else 0
        self._intra_bps = intra.bps if intra is not None else 1
        self._inter_alpha = inter.alpha if inter is not None else 0
        self._inter_bps = inter.bps if inter is not None else 1
        self._uplink_bps = max(1, uplink_bps)
        self._leaf_alpha = leaf_alpha
        nodes = 1 if ranks_per_node == 0 else _ceil_div(nranks, ranks_per_node)
        self._n_ranks = nranks
        self._n_nics = nodes if nic_node else nranks
        self._n_leaves = _ceil_div(nodes, nodes_per_leaf) if fat_tree else 0
        self._nchan = 2 * self._n_nics + 2 * nranks + 2 * self._n_leaves
        self._port_base = self._nchan
        self._sw_rank = switch_rank if switch_ports and 0 <= switch_rank < nranks else -1
        self._port_bps = max(1, port_bps)
        if self._sw_rank >= 0:
            self._nchan += 2 * nranks
        self._proc_rank = switch_rank if per_packet > 0 and 0 <= switch_rank < nranks else -1
        self._proc_cost = per_packet
        self._proc_parallel = parallel
        self._busy = <int64_t*>PyMem_Realloc(self._busy, (nranks + 1) * sizeof(int64_t))
        if self._busy == NULL:
            raise MemoryError()
        n = self._nchan + 1
        self._cap = <int64_t*>PyMem_Realloc(self._cap, n * sizeof(int64_t))
        self._head = <int64_t*>PyMem_Realloc(self._head, n * sizeof(int64_t))
        self._count = <int64_t*>PyMem_Realloc(self._count, n * sizeof(int64_t))
        self._rmark = <int64_t*>PyMem_Realloc(self._rmark, n * sizeof(int64_t))
        self._rcap = <int64_t*>PyMem_Realloc(self._rcap, n * sizeof(int64_t))
        self._rn = <int64_t*>PyMem_Realloc(self._rn, n * sizeof(int64_t))
        if not (self._cap and self._head and self._count and self._rmark and self._rcap and self._rn):
            raise MemoryError()
        self.clear()
        for i in range(2 * self._n_nics):
            self._cap[i] = self._inter_bps
        base = 2 * self._n_nics
        for i in range(2 * nranks):
            self._cap[base + i] = self._intra_bps
        base += 2 * nranks
        for i in range(2 * self._n_leaves):
            self._cap[base + i] = self._uplink_bps
        if self._sw_rank >= 0:
            for i in range(2 * nranks):
                self._cap[self._port_base + i] = self._port_bps
        self._cap[self._nchan] = 1

    def clear(self):
        """Idle channels: every flow and completion dropped (their messages and requests released).

        The engine calls it when a run is torn down: a flow holds its send request, whose
        communicator holds the engine, a cycle the garbage collector cannot see through C.
        """
        cdef Py_ssize_t i
        self._drop_flows()
        self._n_used = 0
        self._free_head = -1
        self._n_heap = 0
        self._n_active = 0
        self._pairs = {}
        self._seq = self._epoch = 0
        if self._head != NULL:
            for i in range(self._nchan + 1):
                self._head[i] = -1
                self._count[i] = 0
                self._rmark[i] = 0
        if self._busy != NULL:
            for i in range(self._n_ranks + 1):
                self._busy[i] = 0

    # -- flows ----------------------------------------------------------------------------------

    cdef int64_t _new_flow(self) except -1:
        cdef int64_t fid
        cdef Flow* grown
        if self._free_head >= 0:
            fid = self._free_head
            self._free_head = self._flows[fid].pair_next
            return fid
        if self._n_used == self._cap_flows:
            self._cap_flows = 2 * self._cap_flows + 64
            grown = <Flow*>PyMem_Realloc(self._flows, self._cap_flows * sizeof(Flow))
            if grown == NULL:
                raise MemoryError()
            self._flows = grown
        fid = self._n_used
        self._n_used += 1
        self._flows[fid].version = 0
        self._flows[fid].mark = self._flows[fid].fixed = 0
        return fid

    cdef void _free_flow(self, int64_t fid) noexcept:
        self._flows[fid].state = F_FREE
        self._flows[fid].pair_next = self._free_head
        self._free_head = fid

    cdef int _route(self, Flow* f) except -1:
        """The channels and latency of a message from ``f.src`` to ``f.dst`` (not a self-message)."""
        cdef int64_t s, d, ls, ld, base
        if not (0 <= f.src < self._n_ranks and 0 <= f.dst < self._n_ranks):
            raise ValueError(
                f"message {f.src} -> {f.dst} outside the ranks 0..{self._n_ranks - 1} of this network: "
                "call reset(nranks) first"
            )
        if self._sw_rank >= 0 and (f.src == self._sw_rank or f.dst == self._sw_rank):
            # the switch rank: a port per peer at line rate, the peer's NIC on the other side
            f.nres = 2
            if f.src == self._sw_rank:
                f.res[0] = <int>(self._port_base + f.dst)
                f.res[1] = <int>(self._n_nics + self._nic(f.dst))
            else:
                f.res[0] = <int>self._nic(f.src)
                f.res[1] = <int>(self._port_base + self._n_ranks + f.src)
            f.alpha = self._inter_alpha
            return 0
        if self._rpn == 0 or (self._rpn > 1 and f.src // self._rpn == f.dst // self._rpn):
            base = 2 * self._n_nics
            f.nres = 2
            f.res[0] = <int>(base + f.src)
            f.res[1] = <int>(base + self._n_ranks + f.dst)
            f.alpha = self._intra_alpha
            return 0
        if self._nic_node:
            s, d = f.src // self._rpn, f.dst // self._rpn
        else:
            s, d = f.src, f.dst
        f.nres = 2
        f.res[0] = <int>s
        f.res[1] = <int>(self._n_nics + d)
        f.alpha = self._inter_alpha
        if self._fat_tree:
            ls, ld = f.src // self._rpn // self._npl, f.dst // self._rpn // self._npl
            if ls != ld:
                base = 2 * self._n_nics + 2 * self._n_ranks  # each leaf's uplink, then downlink
                f.nres = 4
                f.res[2] = <int>(base + ls)
                f.res[3] = <int>(base + self._n_leaves + ld)
                f.alpha += self._leaf_alpha
        return 0

    cdef inline int64_t _nic(self, int64_t r) noexcept:
        """The NIC of rank ``r``: its own, or its node's."""
        if not self._nic_node:
            return r
        return 0 if self._rpn == 0 else r // self._rpn

    cdef int64_t process(self, int64_t src, int64_t t) noexcept:
        """The tick the switch rank has processed a message from ``src`` that arrived at ``t``.

        Called in the order the messages arrive (ties: in the order they were handed over):
        each server is a FIFO queue, ``done = max(t, free) + cost``.
        """
        cdef int64_t s = src if self._proc_parallel else self._n_ranks
        if self._busy[s] > t:
            t = self._busy[s]
        t += self._proc_cost
        self._busy[s] = t
        return t

    cdef void _attach(self, int64_t fid, int64_t t) noexcept:
        """Put flow ``fid`` on its channels at tick ``t``."""
        cdef Flow* f = &self._flows[fid]
        cdef int k, c
        cdef int64_t h
        f.state = F_ACTIVE
        f.t_last = t
        f.num, f.den = 0, 1
        f.t_end = -1
        self._n_active += 1
        for k in range(f.nres):
            c = f.res[k]
            h = self._head[c]
            f.prv[k] = -1
            f.nxt[k] = h
            if h >= 0:
                self._flows[h >> 2].prv[h & 3] = fid * 4 + k
            self._head[c] = fid * 4 + k
            self._count[c] += 1

    cdef void _detach(self, int64_t fid) noexcept:
        """Take flow ``fid`` off its channels."""
        cdef Flow* f = &self._flows[fid]
        cdef int k
        cdef int64_t p, n
        self._n_active -= 1
        for k in range(f.nres):
            p, n = f.prv[k], f.nxt[k]
            if p >= 0:
                self._flows[p >> 2].nxt[p & 3] = n
            else:
                self._head[f.res[k]] = n
            if n >= 0:
                self._flows[n >> 2].prv[n & 3] = p
            self._count[f.res[k]] -= 1

    cdef int post(self, int64_t src, int64_t dst, int64_t nbytes, int64_t t, object msg, object req,
                  int64_t* t_sent, int64_t* t_arrival) except -1:
        """A message of ``nbytes`` from world rank ``src`` to ``dst``, ready at tick ``t``.

        Returns 1 when its times are known at once (``t_sent``, ``t_arrival`` set): a
        self-message, or an empty one whose pair is idle. Otherwise 0: it ends in a later
        :meth:`advance`, which hands ``msg`` and ``req`` back. Every completion due at or
        before ``t`` must have been taken by :meth:`advance` first.
        """
        cdef Flow probe
        cdef Flow* f
        cdef int64_t fid, key
        cdef int k
        cdef object tail
        if src == dst:
            t_sent[0] = t_arrival[0] = t
            return 1
        probe.src, probe.dst = src, dst
        self._route(&probe)
        key = src * self._n_ranks + dst
        tail = self._pairs.get(key)
        if tail is None and nbytes == 0:
            t_sent[0], t_arrival[0] = t, t + probe.alpha
            return 1
        if 0 <= self.next_time() <= t:
            raise RuntimeError("NetCore.post: a completion due by the message's time was not taken first")
        fid = self._new_flow()
        f = &self._flows[fid]
        f.src, f.dst, f.alpha, f.nres = src, dst, probe.alpha, probe.nres
        f.res = probe.res
        f.key = key
        f.rem = <i128>nbytes * <i128>TICKS_PER_SECOND
        f.pair_next = -1
        f.version += 1  # never reset: a stale completion of the slot's last flow must stay stale
        f.ev_version = -1
        f.t_end = -1
        f.num, f.den = 0, 1
        Py_INCREF(msg)
        Py_INCREF(req)
        f.msg, f.req = <PyObject*>msg, <PyObject*>req
        self._pairs[key] = fid
        if tail is not None:
            f.state = F_QUEUED
            self._flows[<int64_t>tail].pair_next = fid
            return 0
        self._attach(fid, t)
        self._grow_comp(8 * self._n_used + 2 * self._nchan + 8)
        for k in range(f.nres):
            self._seeds[k] = f.res[k]
        self._share(f.nres, t)
        return 0

    # -- sharing ----------------------------------------------------------------------------------

    cdef int _grow_comp(self, Py_ssize_t need) except -1:
        cdef Py_ssize_t cap
        if need <= self._cap_comp:
            return 0
        cap = max(need, 2 * self._cap_comp + 64)
        self._stack = <int64_t*>PyMem_Realloc(self._stack, cap * sizeof(int64_t))
        self._comp_flows = <int64_t*>PyMem_Realloc(self._comp_flows, cap * sizeof(int64_t))
        self._comp_res = <int64_t*>PyMem_Realloc(self._comp_res, cap * sizeof(int64_t))
        self._seeds = <int64_t*>PyMem_Realloc(self._seeds, cap * sizeof(int64_t))
        self._due = <int64_t*>PyMem_Realloc(self._due, cap * sizeof(int64_t))
        if not (self._stack and self._comp_flows and self._comp_res and self._seeds and self._due):
            raise MemoryError()
        self._cap_comp = cap
        return 0

    cdef Py_ssize_t _group(self, int64_t c0, int64_t epoch) except -1:
        """The flows connected to channel ``c0`` (marked with ``epoch``) into ``_comp_flows``, their channels into ``_comp_res``.

        Returns the number of flows; ``_n_res`` the number of channels.
        """
        cdef Py_ssize_t nf = 0, nr = 0, sp = 1
        cdef int64_t c, h, fid
        cdef int k
        cdef Flow* f
        self._stack[0] = c0
        while sp:
            sp -= 1
            c = self._stack[sp]
            if self._rmark[c] == epoch:
                continue
            self._rmark[c] = epoch
            self._comp_res[nr] = c
            nr += 1
            h = self._head[c]
            while h >= 0:
                fid = h >> 2
                f = &self._flows[fid]
                if f.mark != epoch:
                    f.mark = epoch
                    self._comp_flows[nf] = fid
                    nf += 1
                    for k in range(f.nres):
                        if self._rmark[f.res[k]] != epoch:
                            self._stack[sp] = f.res[k]
                            sp += 1
                h = f.nxt[h & 3]
        self._n_res = nr
        return nf

    cdef int _share(self, Py_ssize_t seed_n, int64_t t) except -1:
        """Share out again, max-min fairly at tick ``t``, the flows connected to the channels ``_seeds[:seed_n]``.

        Each connected group is shared out on its own (progressive filling). A flow whose
        rate changes is brought up to date at ``t``; each group's earliest end gets a
        completion event (one per group, not one per flow: the group is searched again at
        that completion, for every flow ending then).
        """
        cdef Py_ssize_t nf, nr, i, fixed, s
        cdef int64_t epoch, c, h, fid, share, best, num, den, first
        cdef i128 lhs, rhs
        cdef int k, q
        cdef Flow* f
        self._epoch += 1
        epoch = self._epoch
        for s in range(seed_n):
            if self._rmark[self._seeds[s]] == epoch:
                continue  # in a group already shared out
            nf = self._group(self._seeds[s], epoch)
            nr = self._n_res
            if nf == 0:
                continue
            for i in range(nr):
                c = self._comp_res[i]
                self._rcap[c] = self._cap[c]
                self._rn[c] = self._count[c]
            fixed = 0
            while fixed < nf:  # progressive filling: the tightest channel fixes its flows' rates
                best = -1
                for i in range(nr):
                    c = self._comp_res[i]
                    if self._rn[c] > 0:  # the smallest share; equal shares: the lowest channel number
                        if best < 0:
                            best = c
                        else:
                            lhs = <i128>self._rcap[c] * self._rn[best]
                            rhs = <i128>self._rcap[best] * self._rn[c]
                            if lhs < rhs or (lhs == rhs and c < best):
                                best = c
                if best < 0:
                    break
                # the share is rcap / rn exactly; the other channels give up its ceiling (a flow is
                # never given more than a channel has left)
                num, den = self._rcap[best], self._rn[best]
                if num < 1:
                    num = 1
                share = _ceil_div(num, den)
                h = self._head[best]
                while h >= 0:
                    fid = h >> 2
                    f = &self._flows[fid]
                    if f.fixed != epoch:
                        f.fixed = epoch
                        f.new_num, f.new_den = num, den
                        fixed += 1
                        for k in range(f.nres):
                            q = f.res[k]
                            if q != best:
                                self._rcap[q] -= share
                                self._rn[q] -= 1
                    h = f.nxt[h & 3]
                self._rn[best] = 0
            first = -1
            for i in range(nf):
                fid = self._comp_flows[i]
                f = &self._flows[fid]
                if <i128>f.new_num * f.den != <i128>f.num * f.new_den:  # a new rate: a new end
                    if f.num > 0:  # the work done at the old rate, rounded down
                        f.rem -= (<i128>f.num * (t - f.t_last)) // f.den
                    f.t_last = t
                    f.num, f.den = f.new_num, f.new_den
                    f.t_end = t + _ceil128(f.rem * f.den, f.num)
                    f.version += 1
                if first < 0 or f.t_end < self._flows[first].t_end:
                    first = fid
            f = &self._flows[first]
            if f.ev_version != f.version:
                self._push(f.t_end, first, f.version)
                f.ev_version = f.version
        return 0

    # -- completions ------------------------------------------------------------------------------

    cdef int _push(self, int64_t t, int64_t fid, int64_t version) except -1:
        cdef Py_ssize_t i, parent
        cdef Completion ev
        cdef Completion* grown
        if self._n_heap > 4 * self._n_active + 1024:
            self._compact()
        if self._n_heap == self._cap_heap:
            self._cap_heap = 2 * self._cap_heap + 64
            grown = <Completion*>PyMem_Realloc(self._heap, self._cap_heap * sizeof(Completion))
            if grown == NULL:
                raise MemoryError()
            self._heap = grown
        self._seq += 1
        ev.t, ev.seq, ev.fid, ev.version = t, self._seq, fid, version
        self._sift_up(ev)
        return 0

    cdef void _compact(self) noexcept:
        """Drop the stale completions and rebuild the heap (they pile up when rates rise)."""
        cdef Py_ssize_t i, n = 0
        cdef Completion ev
        cdef Completion* heap = self._heap
        for i in range(self._n_heap):
            ev = heap[i]
            if self._flows[ev.fid].state == F_ACTIVE and self._flows[ev.fid].version == ev.version:
                heap[n] = ev
                n += 1
        self._n_heap = 0
        for i in range(n):  # sift each up again: the order (t, seq) is unchanged
            ev = heap[i]
            self._sift_up(ev)

    cdef void _sift_up(self, Completion ev) noexcept:
        cdef Py_ssize_t i = self._n_heap, parent
        self._n_heap += 1
        while i > 0:
            parent = (i - 1) >> 1
            if _earlier(&ev, &self._heap[parent]):
                self._heap[i] = self._heap[parent]
                i = parent
            else:
                break
        self._heap[i] = ev

    cdef void _pop(self) noexcept:
        cdef Completion last
        cdef Py_ssize_t i = 0, child, n
        self._n_heap -= 1
        n = self._n_heap
        if n > 0:
            last = self._heap[n]
            while True:
                child = 2 * i + 1
                if child >= n:
                    break
                if child + 1 < n and _earlier(&self._heap[child + 1], &self._heap[child]):
                    child += 1
                if _earlier(&self._heap[child], &last):
                    self._heap[i] = self._heap[child]
                    i = child
                else:
                    break
            self._heap[i] = last

    cdef int64_t next_time(self) noexcept:
        """The tick of the next completion (-1: none); stale events are dropped on the way."""
        cdef Completion* top
        while self._n_heap:
            top = &self._heap[0]
            if self._flows[top.fid].state == F_ACTIVE and self._flows[top.fid].version == top.version:
                return top.t
            self._pop()
        return -1

    cdef int _end(self, int64_t fid, int64_t t) except -1:
        """Flow ``fid`` ended at ``t``: hand it over, start the next of its pair."""
        cdef Flow* f = &self._flows[fid]
        cdef Ended* e
        cdef Ended* grown
        cdef int64_t nxt
        if self._n_ended == self._cap_ended:
            self._cap_ended = 2 * self._cap_ended + 64
            grown = <Ended*>PyMem_Realloc(self._ended, self._cap_ended * sizeof(Ended))
            if grown == NULL:
                raise MemoryError()
            self._ended = grown
        e = &self._ended[self._n_ended]
        self._n_ended += 1
        e.msg, e.req = f.msg, f.req  # the references move
        f.msg = f.req = NULL
        e.t_sent, e.t_arrival, e.src, e.dst = t, t + f.alpha, f.src, f.dst
        nxt = f.pair_next
        if nxt >= 0:
            self._attach(nxt, t)
        else:
            del self._pairs[f.key]
        self._free_flow(fid)
        return 0

    cdef Py_ssize_t advance(self, int64_t t) except -1:
        """Reach tick ``t``, the next completion: end every flow due then, and share out again.

        A completion event stands for its group: the group is searched for every flow
        ending at ``t``. Returns how many messages ended; :meth:`_take` hands each over.
        Empty messages started behind them (the next of a pair) end at ``t`` too.
        """
        cdef Py_ssize_t ndue, nseeds, i, nf
        cdef int64_t fid, nxt, epoch
        cdef int k
        cdef Flow* f
        if self._n_ended:
            raise RuntimeError("NetCore.advance: the messages that ended last time were not taken")
        while self.next_time() == t:
            self._grow_comp(8 * self._n_used + 2 * self._nchan + 8)
            self._epoch += 1
            epoch = self._epoch
            ndue = 0
            while self.next_time() == t:  # the groups with a completion at t: their flows due then
                fid = self._heap[0].fid
                self._pop()
                if self._flows[fid].mark == epoch:
                    continue  # its group was searched
                nf = self._group(self._flows[fid].res[0], epoch)
                for i in range(nf):
                    if self._flows[self._comp_flows[i]].t_end == t:
                        self._due[ndue] = self._comp_flows[i]
                        ndue += 1
            nseeds = 0
            for i in range(ndue):
                fid = self._due[i]
                f = &self._flows[fid]
                self._detach(fid)
                for k in range(f.nres):
                    self._seeds[nseeds] = f.res[k]
                    nseeds += 1
                nxt = f.pair_next
                self._end(fid, t)
                if nxt >= 0:  # on its channels now: rated by the sharing below
                    f = &self._flows[nxt]
                    for k in range(f.nres):
                        self._seeds[nseeds] = f.res[k]
                        nseeds += 1
            self._share(nseeds, t)
        return self._n_ended

    cdef void _take(self, Py_ssize_t i, Ended* out) noexcept:
        out[0] = self._ended[i]

    cdef void _taken(self) noexcept:
        self._n_ended = 0

    # -- without an engine ------------------------------------------------------------------------

    def schedule(self, messages):
        """The times of a list of messages, ``(src, dst, nbytes, t_ready)`` each, on idle channels.

        Messages are posted in order of ``t_ready`` (ties: in the order given); a
        completion at a tick comes before a message posted at that tick, as in the
        engine. Returns ``[(t_sent, t_arrival), ...]`` in the order given; afterwards the
        channels are idle again. A message to the switch rank (``[switch]`` with a per-packet
        cost) arrives when it has been processed, as the engine delivers it.
        """
        cdef int64_t t_sent, t_arr, nt
        cdef Py_ssize_t i, k, n, m
        cdef Ended e
        if self._n_heap or self._pairs:
            raise RuntimeError("NetCore.schedule needs idle channels (call reset(nranks))")
        msgs = [(int(t), i, int(s), int(d), int(b)) for i, (s, d, b, t) in enumerate(messages)]
        for t, i, s, d, b in msgs:
            if b < 0 or not (0 <= s < self._n_ranks and 0 <= d < self._n_ranks):
                raise ValueError(
                    f"message {i}: {s} -> {d} of {b} bytes: sizes must be >= 0 and ranks in "
                    f"0..{self._n_ranks - 1} (call reset(nranks) first)"
                )
        msgs.sort()
        out = [None] * len(msgs)
        srcs = [0] * len(msgs)
        for t, i, s, d, b in msgs:
            srcs[i] = s
        arrived = []  # (t_arrival, handed over, index) of the messages the switch rank processes
        n = len(msgs)
        k = 0
        while True:
            nt = self.next_time()
            if k < n and (nt < 0 or msgs[k][0] < nt):
                t, i, s, d, b = msgs[k]
                k += 1
                if self.post(s, d, b, t, i, None, &t_sent, &t_arr):
                    out[i] = (t_sent, t_arr)
                    if d == self._proc_rank and s != d:
                        arrived.append((t_arr, len(arrived), i))
                continue
            if nt < 0:
                break
            m = self.advance(nt)
            for i in range(m):
                e = self._ended[i]
                out[<object>e.msg] = (e.t_sent, e.t_arrival)
                if e.dst == self._proc_rank:
                    arrived.append((e.t_arrival, len(arrived), <object>e.msg))
                Py_DECREF(<object>e.msg)
                Py_DECREF(<object>e.req)
            self._taken()
        arrived.sort()
        for i in range(self._n_ranks + 1):  # idle servers
            self._busy[i] = 0
        for t, _, i in arrived:
            out[i] = (out[i][0], self.process(srcs[i], t))
        for i in range(self._n_ranks + 1):
            self._busy[i] = 0
        return out
