# cython: boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False, language_level=3
# distutils: define_macros=_GNU_SOURCE=1
"""A worker's side of the switch protocol in C: ``hpcdl.switch.worker.WorkerState`` on a UDP socket.

:class:`WorkerLoop` holds ``WorkerState``'s per-slot state (use, chunk in flight, deadline,
retransmissions of it, the datagram kept for them) in C arrays and applies the same rules,
datagram for datagram: for the same inputs and clock it sends the same bytes, with the same
``use`` numbers, backoff and counters (``results``, ``retransmissions``, ``ignored``,
``malformed`` in ``protocol.Malformed`` order).

Two ways to drive it:

* **driven** (tests, like ``WorkerState``): :meth:`WorkerLoop.start_exponent`,
  :meth:`~WorkerLoop.start_quantised`, :meth:`~WorkerLoop.receive` and :meth:`~WorkerLoop.tick`
  take the caller's clock ``now`` (seconds) and return the datagrams to send;
* **fast**: :meth:`~WorkerLoop.attach` a connected, non-blocking UDP socket's fd, queue a
  reduction (:meth:`~WorkerLoop.queue_exponent`, :meth:`~WorkerLoop.queue_quantised`) and call
  :meth:`~WorkerLoop.progress`, which runs without the GIL and without Python per datagram:
  ``sendmmsg`` what is queued (runs of equal-size datagrams as one UDP GSO message), ``recvmmsg``
  results in batches, take them, send the slots' next chunks, retransmit what is due, and
  ``ppoll`` until the next datagram or deadline when nothing arrived. In this path the loop's
  clock is its own (``CLOCK_MONOTONIC``, seconds); do not mix it with the driven calls.

The fast path injects seeded faults (``loss``, ``duplicate``, ``reorder``, each direction) as
``transport.FaultyLink`` does — a lost datagram is not sent (or not taken), a duplicated one
twice, a reordered one held back behind the next one in the same direction and released when
nothing follows (before the loop waits) — from its own generator (xoshiro256** seeded by
splitmix64 from ``seed``): the fault stream is seeded and reproducible, but not
``FaultyLink``'s numpy stream. ``start(grad)`` (a float vector quantised in the loop) is not
built: the switch exchange quantises with its own packing kernel and uses ``start_exponent`` and
``start_quantised``.
"""

import sys

import numpy as np

from libc.errno cimport EAGAIN, EINTR, errno
from libc.math cimport INFINITY, ldexp
from libc.stdint cimport int16_t, int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free
from libc.string cimport memcpy

from wire cimport *

if sys.byteorder != "little":  # payloads are copied as host int32: the protocol is little-endian
    raise ImportError("hpcdl._ext.workerloop assumes a little-endian host")

__all__ = ["DONE", "INTERRUPTED", "IO_COUNTERS", "TIME", "WorkerLoop"]

# worker.py, restated for C (tests check they agree; the protocol's constants are in wire.pxd)
cdef enum:
    MAX_BACKOFF = 6
    IDLE = 0
    EXPONENT = 1
    DATA = 2
    NOTHING = -1
    EXPONENT_CHUNK = -2
# the socket loop's counters (``WorkerLoop.io``, named by IO_COUNTERS)
cdef enum:
    SENT = 0
    SENT_BYTES = 1
    LOST_OUT = 2
    DUPLICATED_OUT = 3
    REORDERED_OUT = 4
    LOST_IN = 5
    DUPLICATED_IN = 6
    REORDERED_IN = 7
    RECEIVED = 8
    RECV_CALLS = 9
    SEND_CALLS = 10
    SEND_FAILED = 11
    REFUSED = 12
    GSO_MESSAGES = 13
    N_IO = 14

#: :meth:`WorkerLoop.progress`'s answers: the reduction is done; the time given (or the loop's
#: slice, :data:`SLICE_S`) ran out; a signal interrupted the wait (Python should handle it)
DONE, TIME, INTERRUPTED = 0, 1, 2
#: the longest :meth:`WorkerLoop.progress` runs before returning, so that Python sees signals
SLICE_S = 0.05
cdef enum:
    S_DONE = 0
    S_TIME = 1
    S_INTERRUPTED = 2
cdef double _SLICE_S = SLICE_S
#: the names of ``WorkerLoop.io``: datagrams and bytes the state machine sent (new and
#: retransmitted, before injected faults); the injected faults (FaultyLink's names); datagrams
#: received; ``recvmmsg`` calls that returned datagrams and ``sendmmsg`` calls; datagrams the
#: kernel did not send (a full buffer, a refused GSO message); ICMP refusals (no switch at the
#: address); messages of several datagrams sent with UDP GSO
IO_COUNTERS = ("datagrams_sent", "bytes_sent", "lost_out", "duplicated_out", "reordered_out", "lost_in",
               "duplicated_in", "reordered_in", "received", "recv_calls", "send_calls", "send_failed",
               "refused", "gso_messages")


cdef inline double _now_s() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9


cdef inline uint64_t _splitmix64(uint64_t* x) noexcept nogil:
    x[0] += 0x9E3779B97F4A7C15ULL
    cdef uint64_t z = x[0]
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL
    return z ^ (z >> 31)


cdef inline uint64_t _rotl(uint64_t x, int k) noexcept nogil:
    return (x << k) | (x >> (64 - k))


cdef inline double _uniform(uint64_t* s) noexcept nogil:
    """xoshiro256** (Blackman and Vigna): a double uniform in [0, 1)."""
    cdef uint64_t result = _rotl(s[1] * 5, 7) * 9
    cdef uint64_t t = s[1] << 17
    s[2] ^= s[0]
    s[3] ^= s[1]
    s[1] ^= s[2]
    s[0] ^= s[3]
    s[2] ^= t
    s[3] = _rotl(s[3], 45)
    return (result >> 11) * (1.0 / 9007199254740992.0)


cdef class WorkerLoop:
    """One worker of a job: ``WorkerState``'s reductions through the switch's slots, in C.

    Args:
        job: the job id (u32).
        worker: this worker's id, 0 .. workers-1.
        workers: W.
        slots: the switch's slots.
        payload: payload bytes per datagram (``switch.payload``).
        timeout_s: seconds after which a chunk without result is sent again (backed off as
            ``WorkerState``'s: ``timeout_s * 2**min(k, 6)`` after the k-th retransmission).
        window: chunks in flight, the slots 0 .. window-1 used (default: all).
        batch: datagrams per ``recvmmsg`` in :meth:`progress`.
        gso: send runs of equal-size datagrams as one UDP GSO message (``UDP_SEGMENT``); turned
            off by itself if the kernel refuses it.
        loss, duplicate, reorder: injected fault rates of the fast path, each direction (module
            docstring); the driven calls are never faulted.
        seed: the fault stream's seed (u64; one per worker).

    Attributes:
        results: results taken, of every reduction.
        retransmissions: datagrams sent again after a timeout.
        ignored: results that were stale, duplicated or not for a chunk in flight.
        malformed: drops by reason, indexed by ``protocol.Malformed`` (int64 array).
        max_exponent: the maximum of the last exponent round.
        io: the fast path's counters (int64 array named by :data:`IO_COUNTERS`).
    """

    cdef readonly uint32_t job
    cdef readonly int worker, workers, slots, window, payload, elements, batch, fd
    cdef readonly double timeout, loss, duplicate, reorder
    cdef readonly bint gso
    cdef readonly long long results, retransmissions, ignored, early
    cdef readonly int fast
    cdef readonly int max_exponent
    cdef readonly object malformed, io
    cdef int _phase
    cdef int64_t _length, _chunks, _done_chunks
    cdef bint _has_length
    cdef object _values, _result
    cdef const int32_t* _vp
    cdef int32_t* _rp
    cdef int64_t* _mal
    cdef int64_t* _io
    # per slot
    cdef uint32_t* _use
    cdef int64_t* _chunk
    cdef double* _deadline
    cdef int64_t* _attempts
    cdef uint8_t* _hurried
    cdef int64_t* _sent
    cdef int64_t _sends
    cdef int* _size
    cdef uint8_t* _bufs
    cdef int _dgsize, _insize
    # datagrams to send (copies, as the driven path's bytes are)
    cdef uint8_t* _stage
    cdef int* _stage_size
    cdef int _nstaged, _stage_cap
    # socket buffers
    cdef uint8_t* _inbuf
    cdef mmsghdr* _inmsg
    cdef iovec* _iniov
    cdef mmsghdr* _outmsg
    cdef iovec* _outiov
    cdef uint8_t* _cmsg
    cdef int _cmsg_space, _seg_limit
    # faults
    cdef bint _faulty
    cdef uint64_t _rng[4]
    cdef uint8_t* _held_out
    cdef uint8_t* _held_in
    cdef int _held_out_n, _held_out_size, _held_in_n, _held_in_size

    def __cinit__(self):
        self._use = NULL
        self._chunk = NULL
        self._deadline = NULL
        self._attempts = NULL
        self._hurried = NULL
        self._sent = NULL
        self._size = NULL
        self._bufs = self._stage = self._inbuf = self._cmsg = self._held_out = self._held_in = NULL
        self._stage_size = NULL
        self._inmsg = self._outmsg = NULL
        self._iniov = self._outiov = NULL
        self.fd = -1

    def __init__(self, long long job, int worker, int workers, int slots, int payload, double timeout_s,
                 window=None, *, int batch=64, bint gso=True, double loss=0.0, double duplicate=0.0,
                 double reorder=0.0, unsigned long long seed=0, int fast=0):
        cdef int w = slots if window is None else window
        if fast < 0:
            raise ValueError(f"fast must be 0 (off) or positive (got {fast})")
        if not 0 <= job <= 0xFFFFFFFF:
            raise ValueError(f"job must be a u32 (got {job})")
        if not 1 <= workers < ALL_WORKERS:
            raise ValueError(f"workers must be in 1 .. {ALL_WORKERS - 1} (got {workers})")
        if not 0 <= worker < workers:
            raise ValueError(f"worker must be in 0 .. {workers - 1} (got {worker})")
        if not 1 <= slots <= 0xFFFF:
            raise ValueError(f"slots must be in 1 .. 65535 (got {slots})")
        if not 1 <= w <= slots:
            raise ValueError(f"window must be in 1 .. slots = {slots} (got {w})")
        if payload < 4 or payload % 4 or payload // 4 > 0xFFFF:
            raise ValueError(f"payload must be a positive multiple of 4 bytes (got {payload})")
        if not timeout_s > 0:
            raise ValueError(f"timeout must be positive (got {timeout_s} s)")
        if not 1 <= batch <= 1024:
            raise ValueError(f"batch must be in 1 .. 1024 datagrams (got {batch})")
        for name, rate in (("loss", loss), ("duplicate", duplicate), ("reorder", reorder)):
            if not 0.0 <= rate < 1.0:
                raise ValueError(f"switch.{name} must be in [0, 1) (got {rate})")
        self.job, self.worker, self.workers, self.slots, self.window = job, worker, workers, slots, w
        self.payload, self.elements, self.batch, self.timeout = payload, payload // 4, batch, timeout_s
        self.gso = gso
        self.loss, self.duplicate, self.reorder = loss, duplicate, reorder
        self._faulty = loss > 0 or duplicate > 0 or reorder > 0
        cdef uint64_t x = seed
        cdef int i
        for i in range(4):
            self._rng[i] = _splitmix64(&x)
        self.results = self.retransmissions = self.ignored = self.early = 0
        self.fast = fast
        self.max_exponent = ZERO_EXPONENT
        self.malformed = np.zeros(N_MALFORMED, np.int64)
        self.io = np.zeros(N_IO, np.int64)
        cdef int64_t[::1] m = self.malformed
        cdef int64_t[::1] io = self.io
        self._mal, self._io = &m[0], &io[0]
        self._phase = IDLE
        self._length = self._chunks = self._done_chunks = 0
        self._has_length = False
        self._values = np.zeros(0, np.int32)
        self._result = np.zeros(0, np.int32)
        self._vp, self._rp = NULL, NULL
        self._dgsize = HEADER_SIZE + payload
        self._insize = self._dgsize + 4  # one byte more than any valid datagram (MSG_TRUNC tells the rest)
        self._stage_cap = 4 * w + 2 * batch + 8  # any one call's datagrams (a window twice, and what is held)
        self._seg_limit = max(1, min(64, 65000 // self._dgsize))  # the kernel's limits: 64 segments, 64 KiB
        self._cmsg_space = CMSG_SPACE(sizeof(uint16_t))
        self._use = <uint32_t*>calloc(w, sizeof(uint32_t))
        self._chunk = <int64_t*>calloc(w, sizeof(int64_t))
        self._deadline = <double*>calloc(w, sizeof(double))
        self._attempts = <int64_t*>calloc(w, sizeof(int64_t))
        self._hurried = <uint8_t*>calloc(w, sizeof(uint8_t))
        self._sent = <int64_t*>calloc(w, sizeof(int64_t))
        self._sends = 0
        self._size = <int*>calloc(w, sizeof(int))
        self._bufs = <uint8_t*>calloc(w, self._dgsize)
        self._stage = <uint8_t*>calloc(self._stage_cap, self._dgsize)
        self._stage_size = <int*>calloc(self._stage_cap, sizeof(int))
        self._inbuf = <uint8_t*>calloc(batch, self._insize)
        self._inmsg = <mmsghdr*>calloc(batch, sizeof(mmsghdr))
        self._iniov = <iovec*>calloc(batch, sizeof(iovec))
        self._outmsg = <mmsghdr*>calloc(self._stage_cap, sizeof(mmsghdr))
        self._outiov = <iovec*>calloc(self._stage_cap, sizeof(iovec))
        self._cmsg = <uint8_t*>calloc(self._stage_cap, self._cmsg_space)
        self._held_out = <uint8_t*>calloc(1, self._insize)
        self._held_in = <uint8_t*>calloc(1, self._insize)
        if (self._use == NULL or self._chunk == NULL or self._deadline == NULL or self._attempts == NULL
                or self._hurried == NULL or self._sent == NULL or self._size == NULL or self._bufs == NULL or self._stage == NULL or self._stage_size == NULL
                or self._inbuf == NULL or self._inmsg == NULL or self._iniov == NULL or self._outmsg == NULL
                or self._outiov == NULL or self._cmsg == NULL or self._held_out == NULL
                or self._held_in == NULL):
            raise MemoryError("cannot allocate the worker loop's buffers")
        for i in range(w):
            self._chunk[i] = NOTHING
            self._deadline[i] = INFINITY
        for i in range(batch):
            self._iniov[i].iov_base = self._inbuf + i * self._insize
            self._iniov[i].iov_len = self._insize
            self._inmsg[i].msg_hdr.msg_iov = &self._iniov[i]
            self._inmsg[i].msg_hdr.msg_iovlen = 1
        self._nstaged = self._held_out_n = self._held_in_n = 0

    def __dealloc__(self):
        free(self._use)
        free(self._chunk)
        free(self._deadline)
        free(self._attempts)
        free(self._hurried)
        free(self._sent)
        free(self._size)
        free(self._bufs)
        free(self._stage)
        free(self._stage_size)
        free(self._inbuf)
        free(self._inmsg)
        free(self._iniov)
        free(self._outmsg)
        free(self._outiov)
        free(self._cmsg)
        free(self._held_out)
        free(self._held_in)

    # ---- what WorkerState exposes ------------------------------------------------------------

    @property
    def done(self) -> bool:
        """The last reduction is complete (or none was started)."""
        return self._phase == IDLE

    @property
    def result(self) -> np.ndarray:
        """The last reduction's int32 sum (complete when :attr:`done`; the queued vector itself
        for :meth:`queue_quantised`, whose results are written in place)."""
        return self._result

    @property
    def use(self) -> np.ndarray:
        """Each slot's next use number (a copy)."""
        return np.array(<uint32_t[:self.window]>self._use, np.uint32)

    @property
    def injected(self) -> dict:
        """The faults injected so far, by ``FaultyLink``'s names."""
        return {name: int(self.io[i]) for i, name in enumerate(IO_COUNTERS) if i in range(LOST_OUT, RECEIVED)}

    @property
    def datagrams_sent(self) -> int:
        """Datagrams the state machine sent (new and retransmitted; before injected faults)."""
        return int(self.io[SENT])

    @property
    def bytes_sent(self) -> int:
        """Their bytes."""
        return int(self.io[SENT_BYTES])

    def counters(self) -> dict:
        """The counters by name: results, retransmissions, ignored, ``malformed_<reason>`` and
        :data:`IO_COUNTERS`."""
        reasons = ("short", "length", "magic", "version", "flags", "job", "worker", "slot", "count", "offset")
        named = {"results": self.results, "retransmissions": self.retransmissions, "early": self.early,
                 "ignored": self.ignored}
        named.update({f"malformed_{name}": int(self.malformed[i]) for i, name in enumerate(reasons)})
        named.update({name: int(self.io[i]) for i, name in enumerate(IO_COUNTERS)})
        return named

    def next_deadline(self) -> float:
        """When :meth:`tick` next has something to send (``inf`` when nothing is in flight)."""
        return self._next_deadline()

    def outstanding(self) -> tuple:
        """The chunks in flight (their indices; ``-2`` the exponent round) and the chunks of the
        reduction not sent yet, for a message when the switch stops answering."""
        flying = sorted(int(self._chunk[s]) for s in range(self.window) if self._chunk[s] != NOTHING)
        if self._phase != DATA:
            return flying, 0
        return flying, int(self._chunks - self._done_chunks - len(flying))

    # ---- the driven path (the caller's clock) ------------------------------------------------

    def start_exponent(self, int exponent, double now) -> list:
        """Begin an exponent round alone (``WorkerState.start_exponent``).

        Returns:
            The exponent round's datagram.
        """
        self._start_exponent(exponent, now)
        return self._take()

    def start_quantised(self, values, double now) -> list:
        """Begin reducing an int32 vector already scaled (``WorkerState.start_quantised``).

        Returns:
            The first ``window`` chunks' datagrams.
        """
        self._begin(len(values), None)
        self._set_values(np.ascontiguousarray(values, np.int32))
        self._first_chunks(now)
        return self._take()

    def receive(self, data, double now) -> list:
        """Take a datagram from the switch; return the datagrams to send next (``WorkerState.receive``)."""
        cdef const uint8_t[::1] view = memoryview(data).cast("B")
        cdef Py_ssize_t size = view.shape[0]
        cdef uint8_t zero = 0
        cdef const uint8_t* d = &view[0] if size else &zero
        with nogil:
            self._receive(d, size, now)
        return self._take()

    def tick(self, double now) -> list:
        """The retransmissions due at ``now`` (``WorkerState.tick``)."""
        with nogil:
            self._tick(now)
        return self._take()

    # ---- the fast path (the loop's own clock) ------------------------------------------------

    def attach(self, int fd) -> None:
        """Run :meth:`progress` on ``fd``: a connected, non-blocking UDP socket (the caller owns
        it and closes it after the loop's last use); ``-1`` detaches."""
        if fd < -1:
            raise ValueError(f"not a file descriptor: {fd}")
        self.fd = fd

    def queue_exponent(self, int exponent) -> None:
        """Begin an exponent round on the attached socket (sent now; :meth:`progress` finishes it)."""
        self._need_socket()
        self._start_exponent(exponent, _now_s())
        with nogil:
            self._flush()

    def queue_quantised(self, values) -> None:
        """Begin reducing ``values`` (a contiguous, writable 1-D int32 array) on the attached
        socket; the sums are written into ``values`` itself (it is :attr:`result`)."""
        self._need_socket()
        if not (isinstance(values, np.ndarray) and values.dtype == np.int32 and values.ndim == 1
                and values.flags.c_contiguous and values.flags.writeable):
            raise ValueError("queue_quantised sums a contiguous, writable 1-D int32 vector in place")
        self._begin(len(values), values)
        self._set_values(values)
        self._first_chunks(_now_s())
        with nogil:
            self._flush()

    def progress(self, double max_wait_s) -> int:
        """Send, receive and retransmit on the attached socket, without the GIL.

        Returns when the reduction is done, when ``max_wait_s`` (at most :data:`SLICE_S`) has
        passed, or when a signal interrupts the wait; at least one batch of what has arrived is
        taken first. ``max_wait_s = 0`` takes what is there and returns.

        Returns:
            :data:`DONE`, :data:`TIME` or :data:`INTERRUPTED`.

        Raises:
            OSError: the socket failed (other than EAGAIN, EINTR and ECONNREFUSED, which is a
                lost datagram).
        """
        self._need_socket()
        cdef int err = 0, status
        with nogil:
            status = self._progress(max_wait_s, &err)
        if err:
            raise OSError(err, f"the switch socket failed (errno {err})")
        return status

    # ---- internals ---------------------------------------------------------------------------

    def _need_socket(self):
        if self.fd < 0:
            raise RuntimeError("attach() a connected UDP socket before the fast path")

    cdef void _begin(self, Py_ssize_t length, object result) except *:
        if self._phase != IDLE:
            raise RuntimeError("a reduction is in flight: feed receive() and tick() until done")
        if length >= 2**32:
            raise ValueError(f"a reduction holds at most 2**32 - 1 elements (got {length})")
        self._result = np.zeros(length, np.int32) if result is None else result
        cdef int32_t[::1] r
        if length:
            r = self._result
            self._rp = &r[0]
        else:
            self._rp = NULL
        self._length = length
        self._has_length = True
        self._chunks = (length + self.elements - 1) // self.elements
        self._done_chunks = 0
        self._phase = DATA

    cdef void _set_values(self, object values) except *:
        self._values = values
        cdef const int32_t[::1] v
        if len(values):
            v = values
            self._vp = &v[0]
        else:
            self._vp = NULL

    cdef void _start_exponent(self, int exponent, double now) except *:
        if not -0x8000 <= exponent <= 0x7FFF:
            raise ValueError(f"an exponent travels as an i16 (got {exponent})")
        self._begin(0, None)
        self._phase = EXPONENT
        self._encode(0, EXPONENT_ROUND, 0, 0, exponent)
        self._arm(0, EXPONENT_CHUNK, now)

    cdef void _first_chunks(self, double now) noexcept nogil:
        cdef int s
        self._phase = DATA if self._chunks else IDLE
        for s in range(min(<int64_t>self.window, self._chunks)):
            self._send_chunk(s, s, now)

    cdef list _take(self):
        """The staged datagrams as bytes (the driven path's answer); the stage emptied."""
        cdef int i
        cdef list out = []
        for i in range(self._nstaged):
            out.append((<char*>self._stage + i * self._dgsize)[:self._stage_size[i]])
        self._nstaged = 0
        return out

    cdef inline int64_t _count(self, int64_t chunk) noexcept nogil:
        return min(<int64_t>self.elements, self._length - chunk * self.elements)

    cdef inline void _encode(self, int s, int flags, uint32_t offset, int count, int exponent) noexcept nogil:
        cdef uint8_t* d = self._bufs + s * self._dgsize
        _put16(d, MAGIC)
        d[2] = VERSION
        d[3] = CONTRIBUTION | flags
        _put32(d + 4, self.job)
        _put16(d + 8, self.worker)
        _put16(d + 10, s)
        _put32(d + 12, self._use[s])
        _put32(d + 16, offset)
        _put16(d + 20, count)
        _put16(d + 22, <uint16_t><int16_t>exponent)
        self._size[s] = HEADER_SIZE + 4 * count

    cdef inline void _arm(self, int s, int64_t chunk, double now) noexcept nogil:
        """Slot ``s`` now carries ``chunk`` (its datagram encoded): arm its timer and send it."""
        self._chunk[s] = chunk
        self._deadline[s] = now + self.timeout
        self._attempts[s] = 0
        self._hurried[s] = 0
        self._sent[s] = self._sends
        self._sends += 1
        self._emit(self._bufs + s * self._dgsize, self._size[s])

    cdef void _send_chunk(self, int s, int64_t chunk, double now) noexcept nogil:
        cdef int64_t offset = chunk * self.elements
        cdef int count = <int>self._count(chunk)
        self._encode(s, 0, <uint32_t>offset, count, 0)
        memcpy(self._bufs + s * self._dgsize + HEADER_SIZE, self._vp + offset, 4 * count)
        self._arm(s, chunk, now)

    cdef inline double _next_deadline(self) noexcept nogil:
        cdef double t = INFINITY
        cdef int s
        for s in range(self.window):
            if self._deadline[s] < t:
                t = self._deadline[s]
        return t

    cdef void _tick(self, double now) noexcept nogil:
        cdef int s
        for s in range(self.window):
            if self._deadline[s] <= now:
                self._resend(s, now)

    cdef void _resend(self, int s, double now) noexcept nogil:
        """Slot ``s``'s datagram again, flagged RETRANSMISSION; its timer backed off."""
        cdef uint8_t* d = self._bufs + s * self._dgsize
        d[3] |= RETRANSMISSION
        self._attempts[s] += 1
        self._deadline[s] = now + self.timeout * ldexp(1.0, <int>min(self._attempts[s], <int64_t>MAX_BACKOFF))
        self.retransmissions += 1
        self._emit(d, self._size[s])

    cdef int _parse(self, const uint8_t* d, Py_ssize_t size) noexcept nogil:
        """-1 when the datagram is well formed, else its Malformed reason (``protocol.parse``
        with the worker's limits: the vector's length once a reduction was begun)."""
        return parse(d, size, self.job, self.workers, self.slots, self.elements,
                     self._length if self._has_length else -1)

    cdef void _receive(self, const uint8_t* d, Py_ssize_t size, double now) noexcept nogil:
        """``WorkerState.receive``: the datagrams it answers are staged."""
        cdef int reason = self._parse(d, size)
        cdef uint8_t flags
        cdef int s
        cdef uint16_t to
        cdef uint32_t offset
        cdef int count
        cdef int64_t c, nxt, sent
        cdef int t
        cdef bint exp_round
        if reason >= 0:
            self._mal[reason] += 1
            return
        flags = d[3]
        s = _u16(d + 10)
        to = _u16(d + 8)
        offset = _u32(d + 16)
        count = _u16(d + 20)
        exp_round = (flags & EXPONENT_ROUND) != 0
        c = self._chunk[s] if s < self.window else NOTHING
        if (not flags & RESULT or (to != ALL_WORKERS and to != self.worker) or c == NOTHING
                or exp_round != (c == EXPONENT_CHUNK) or _u32(d + 12) != self._use[s]
                or (not exp_round and (offset != c * self.elements or count != self._count(c)))):
            self.ignored += 1
            return
        self.results += 1
        self._use[s] += 1
        if exp_round:  # start_exponent's round: the maximum is the result
            self._chunk[s] = NOTHING
            self._deadline[s] = INFINITY
            self.max_exponent = <int16_t>_u16(d + 22)
            self._phase = IDLE
            return
        memcpy(self._rp + offset, d + HEADER_SIZE, 4 * count)
        self._done_chunks += 1
        nxt = c + self.window
        sent = self._sent[s]
        if nxt < self._chunks:
            self._send_chunk(s, nxt, now)
        else:
            self._chunk[s] = NOTHING
            self._deadline[s] = INFINITY
            if self._done_chunks == self._chunks:
                self._phase = IDLE
        if self.fast:  # WorkerState's early retransmission: chunks sent ``fast`` or more sends before
            for t in range(self.window):
                if self._chunk[t] >= 0 and self._sent[t] <= sent - self.fast and not self._hurried[t]:
                    self._hurried[t] = 1
                    self.early += 1
                    self._resend(t, now)

    # ---- the stage, faults and the socket ----------------------------------------------------

    cdef inline void _push(self, const uint8_t* d, int size) noexcept nogil:
        if self._nstaged == self._stage_cap:
            self._flush()  # only the fast path stages this many (one driven call stages at most 2 windows)
        memcpy(self._stage + self._nstaged * self._dgsize, d, size)
        self._stage_size[self._nstaged] = size
        self._nstaged += 1

    cdef void _emit(self, const uint8_t* d, int size) noexcept nogil:
        """Send a datagram the state machine made: staged, through the outgoing faults on a socket."""
        cdef double u0, u1, u2
        cdef int copies, k
        self._io[SENT] += 1
        self._io[SENT_BYTES] += size
        if not (self._faulty and self.fd >= 0):
            self._push(d, size)
            return
        u0, u1, u2 = _uniform(self._rng), _uniform(self._rng), _uniform(self._rng)
        if u0 < self.loss:
            self._io[LOST_OUT] += 1
            return
        copies = 1
        if u1 < self.duplicate:
            copies = 2
            self._io[DUPLICATED_OUT] += 1
        if self._held_out_n:  # this one overtakes what is held back
            for k in range(copies):
                self._push(d, size)
            self._release_out()
        elif u2 < self.reorder:
            self._io[REORDERED_OUT] += 1
            memcpy(self._held_out, d, size)
            self._held_out_n, self._held_out_size = copies, size
        else:
            for k in range(copies):
                self._push(d, size)

    cdef inline void _release_out(self) noexcept nogil:
        cdef int k, n = self._held_out_n
        self._held_out_n = 0
        for k in range(n):
            self._push(self._held_out, self._held_out_size)

    cdef inline void _release_in(self, double now) noexcept nogil:
        cdef int k, n = self._held_in_n
        self._held_in_n = 0
        for k in range(n):
            self._receive(self._held_in, self._held_in_size, now)

    cdef void _arrive(self, const uint8_t* d, Py_ssize_t size, double now) noexcept nogil:
        """A datagram from the socket, through the incoming faults."""
        cdef double u0, u1, u2
        cdef int copies, k
        self._io[RECEIVED] += 1
        if not self._faulty:
            self._receive(d, size, now)
            return
        u0, u1, u2 = _uniform(self._rng), _uniform(self._rng), _uniform(self._rng)
        if u0 < self.loss:
            self._io[LOST_IN] += 1
            return
        copies = 1
        if u1 < self.duplicate:
            copies = 2
            self._io[DUPLICATED_IN] += 1
        if self._held_in_n:
            for k in range(copies):
                self._receive(d, size, now)
            self._release_in(now)
        elif u2 < self.reorder:
            self._io[REORDERED_IN] += 1
            memcpy(self._held_in, d, min(size, <Py_ssize_t>self._insize))  # a longer one is read to its header
            self._held_in_n, self._held_in_size = copies, size
        else:
            for k in range(copies):
                self._receive(d, size, now)

    cdef void _flush(self) noexcept nogil:
        """``sendmmsg`` the staged datagrams (runs of equal size as UDP GSO messages); a datagram
        the kernel does not take is lost (counted), never an error."""
        cdef int n = self._nstaged, i = 0, j, count, size, nmsg = 0, sent = 0, r
        cdef int limit = self._seg_limit if self.gso else 1
        cdef msghdr* m
        if self.fd < 0 or n == 0:
            self._nstaged = 0
            return
        for j in range(n):
            self._outiov[j].iov_base = self._stage + j * self._dgsize
            self._outiov[j].iov_len = self._stage_size[j]
        while i < n:
            size = self._stage_size[i]
            count = 1
            while i + count < n and count < limit and self._stage_size[i + count] == size:
                count += 1
            m = &self._outmsg[nmsg].msg_hdr
            m.msg_name, m.msg_namelen = NULL, 0
            m.msg_iov, m.msg_iovlen = &self._outiov[i], count
            m.msg_flags = 0
            if set_segments(m, self._cmsg + nmsg * self._cmsg_space, self._cmsg_space, count, size):
                self._io[GSO_MESSAGES] += 1
            nmsg += 1
            i += count
        while sent < nmsg:
            r = sendmmsg(self.fd, self._outmsg + sent, nmsg - sent, 0)
            self._io[SEND_CALLS] += 1
            if r > 0:
                sent += r
                continue
            if r < 0 and errno == EINTR:
                continue
            # this message was not sent: a full buffer (EAGAIN), a switch not listening
            # (ECONNREFUSED, an earlier datagram's ICMP error), or GSO refused
            if r < 0 and errno == ECONNREFUSED:
                self._io[REFUSED] += 1
            elif self._outmsg[sent].msg_hdr.msg_control != NULL and errno != EAGAIN and errno != EWOULDBLOCK:
                self.gso = False
            self._io[SEND_FAILED] += self._outmsg[sent].msg_hdr.msg_iovlen
            sent += 1
        self._nstaged = 0

    cdef int _progress(self, double max_wait, int* err) noexcept nogil:
        cdef double start = _now_s(), now, next_due, wait
        cdef double end = start + max(0.0, min(max_wait, _SLICE_S))
        cdef int got, j
        cdef timespec ts
        cdef pollfd pfd
        pfd.fd, pfd.events = self.fd, POLLIN
        while True:
            self._flush()
            if self._phase == IDLE:
                return S_DONE
            got = recvmmsg(self.fd, self._inmsg, self.batch, MSG_DONTWAIT | MSG_TRUNC, NULL)
            now = _now_s()
            if got > 0:
                self._io[RECV_CALLS] += 1
                for j in range(got):
                    self._arrive(self._inbuf + j * self._insize, self._inmsg[j].msg_len, now)
            elif got < 0 and errno != EAGAIN and errno != EWOULDBLOCK:
                if errno == ECONNREFUSED:  # an earlier datagram's ICMP error: nobody listens
                    self._io[REFUSED] += 1
                    continue
                if errno == EINTR:
                    return S_INTERRUPTED
                err[0] = errno
                return S_TIME
            else:  # nothing arrived: let through what a reordering holds back
                got = self._held_out_n + self._held_in_n
                self._release_out()
                self._release_in(now)
            next_due = self._next_deadline()
            if now >= next_due:
                self._tick(now)
                next_due = self._next_deadline()
            self._flush()
            if self._phase == IDLE:
                return S_DONE
            if now >= end:
                return S_TIME
            if got > 0:
                continue
            wait = min(end, next_due) - now
            ts.tv_sec = <long>wait
            ts.tv_nsec = <long>((wait - ts.tv_sec) * 1e9)
            pfd.revents = 0
            if ppoll(&pfd, 1, &ts, NULL) < 0:
                if errno == EINTR:
                    return S_INTERRUPTED
                err[0] = errno
                return S_TIME
