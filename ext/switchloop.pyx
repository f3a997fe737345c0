# cython: boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False, language_level=3
# distutils: define_macros=_GNU_SOURCE=1
"""The aggregation switch's packet loop: ``hpcdl.switch.slots.SwitchState`` in C, on a UDP socket.

:class:`SwitchLoop` holds the same per-(slot, set) state as ``SwitchState`` (use, state,
bitmap, int64 sums, offset, count, kind, exponent) in C arrays and applies the same rules,
datagram for datagram: the same counters in ``Counter`` order, the malformed drops in
``protocol.Malformed`` order, the same result bytes. :meth:`SwitchLoop.receive` takes one
datagram from Python (the tests drive it and ``SwitchState`` with the same traffic);
:meth:`SwitchLoop.serve` owns a bound, non-blocking UDP socket's fd and runs without the GIL:
``recvmmsg`` up to ``batch`` datagrams, process them, ``sendmmsg`` every answer (a multicast
result once per worker, to the address each worker last contributed from; a shadow result to
the asking worker). ``batch = 1`` runs the same code one datagram per system call.

:func:`generate` is the benchmark's load: W emulated workers, each on its own socket, keep a
window of chunks in flight; a result paces the slot's next contribution, as in
``WorkerState``, and a chunk without result for a while is sent again.
"""

from libc.errno cimport EAGAIN, EINTR, errno
from libc.stdint cimport int16_t, int32_t, int64_t, int8_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free
from libc.string cimport memcpy, memset

import numpy as np

from wire cimport *

__all__ = ["SwitchLoop", "generate", "COUNTERS", "IO_COUNTERS"]

# slots.py, restated for C (tests check they agree; the protocol's constants are in wire.pxd)
cdef enum:
    MULTICAST = -1
    EMPTY = 0
    FILLING = 1
    COMPLETE = 2
    INT32_MAX = 2147483647
    INT32_MIN = -2147483648
    SOCKADDR_SIZE = 128  # sizeof(struct sockaddr_storage)

# Counter (slots.py), in its order
cdef enum:
    PACKETS_IN = 0
    BYTES_IN = 1
    PACKETS_OUT = 2
    BYTES_OUT = 3
    SUMMED = 4
    COMPLETED = 5
    EXPONENT_ROUNDS = 6
    DUPLICATES = 7
    RETRANSMITTED_RESULTS = 8
    STALE = 9
    MISMATCH = 10
    NOT_CONTRIBUTION = 11
    OVERFLOW = 12
    MALFORMED = 13
    N_COUNTERS = 14
# the socket loop's own counters (``SwitchLoop.io``)
cdef enum:
    RECV_CALLS = 0
    SEND_CALLS = 1
    SEND_FAILED = 2
    NO_ADDRESS = 3
    GSO_MESSAGES = 4
    N_IO = 5

#: the names of ``SwitchLoop.count`` (``Counter``'s, lower case)
COUNTERS = ("packets_in", "bytes_in", "packets_out", "bytes_out", "summed", "completed",
            "exponent_rounds", "duplicates", "retransmitted_results", "stale", "mismatch",
            "not_contribution", "overflow", "malformed")
#: the names of ``SwitchLoop.io``: ``recvmmsg`` calls that returned datagrams (an idle poll
#: is not counted) and ``sendmmsg`` calls, datagrams not sent (a failed or short
#: ``sendmmsg``, e.g. EAGAIN), results for a worker whose address is not known yet, messages
#: of several datagrams sent with UDP GSO
IO_COUNTERS = ("recv_calls", "send_calls", "send_failed", "no_address", "gso_messages")
_MALFORMED = ("short", "length", "magic", "version", "flags", "job", "worker", "slot", "count", "offset")


cdef inline bint _newer(uint32_t a, uint32_t b) noexcept nogil:
    """``a`` is a later use than ``b`` modulo 2**32 (RFC 1982), as slots._newer."""
    cdef uint32_t d = a - b
    return 0 < d < 0x80000000u


cdef inline double _now_ms() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6


cdef class SwitchLoop:
    """The slots of one switch serving one job, in C; the same rules as ``SwitchState``.

    Args:
        workers: W, the contributions each chunk needs (1 .. 65534).
        slots: the slots (1 .. 65535).
        payload: payload bytes (a positive multiple of 4, at most 4 * 65535).
        job: the job served (u32).
        batch: datagrams per ``recvmmsg`` in :meth:`serve` (1: one per system call).
        gso: send a worker's results of one batch that have the same size as one message with
            UDP generic segmentation offload (``UDP_SEGMENT``: the kernel splits it into the
            same datagrams, walking its UDP/IP path once); turned off by itself, the datagrams
            of that call counted in ``send_failed``, if the kernel refuses it.

    Attributes:
        count: int64 counters indexed by ``slots.Counter``.
        malformed: int64 drops by reason indexed by ``protocol.Malformed``.
        io: int64 socket-loop counters named by :data:`IO_COUNTERS`.
    """

    cdef readonly int workers, slots, payload, elements, words, batch, out_cap
    cdef readonly bint gso  # coalesce each worker's equal-size results into one UDP_SEGMENT message
    cdef readonly uint32_t job
    cdef readonly object count, malformed, io
    cdef readonly double first_ms, last_ms  # monotonic ms of the first and last datagram served
    cdef object _arrays
    cdef int64_t* _count
    cdef int64_t* _malformed
    cdef int64_t* _io
    cdef int64_t* _sums
    cdef uint64_t* _seen
    cdef uint64_t* _full
    cdef int32_t* _contributors
    cdef int8_t* _state
    cdef uint32_t* _use
    cdef uint32_t* _offset
    cdef uint16_t* _elems
    cdef int16_t* _exponent
    cdef uint8_t* _exp_round
    # socket buffers (C heap)
    cdef uint8_t* _inbuf
    cdef uint8_t* _outbuf
    cdef uint8_t* _names
    cdef mmsghdr* _inmsg
    cdef iovec* _iniov
    cdef mmsghdr* _outmsg
    cdef iovec* _outiov
    cdef uint8_t* _addr  # worker -> sockaddr (SOCKADDR_SIZE bytes each)
    cdef socklen_t* _addrlen
    cdef int _insize, _seg_limit, _cmsg_space
    cdef uint8_t* _cmsg  # one UDP_SEGMENT control message per output message
    cdef uint8_t** _res_buf  # the results of the batch being served
    cdef int* _res_size
    cdef int* _res_dest

    def __cinit__(self):
        self._inbuf = self._outbuf = self._names = self._addr = NULL
        self._inmsg = self._outmsg = NULL
        self._iniov = self._outiov = NULL
        self._addrlen = NULL
        self._cmsg = NULL
        self._res_buf = NULL
        self._res_size = self._res_dest = NULL

    def __init__(self, int workers, int slots, int payload, long long job, int batch=64, bint gso=False):
        if not 1 <= workers < ALL_WORKERS:
            raise ValueError(f"workers must be in 1 .. {ALL_WORKERS - 1} (got {workers})")
        if not 1 <= slots <= 0xFFFF:
            raise ValueError(f"slots must be in 1 .. 65535 (got {slots})")
        if payload < 4 or payload % 4 or payload // 4 > 0xFFFF:
            raise ValueError(f"payload must be a positive multiple of 4 bytes (got {payload})")
        if not 0 <= job <= 0xFFFFFFFF:
            raise ValueError(f"job must be a u32 (got {job})")
        if not 1 <= batch <= 1024:
            raise ValueError(f"batch must be in 1 .. 1024 datagrams (got {batch})")
        self.workers, self.slots, self.payload, self.job, self.batch = workers, slots, payload, job, batch
        self.elements = payload // 4
        self.words = (workers + 63) // 64
        cdef int sets = 2 * slots
        full = np.full(self.words, np.iinfo(np.uint64).max, np.uint64)
        if workers % 64:
            full[self.words - 1] = np.uint64((1 << (workers % 64)) - 1)
        arrays = {
            "count": np.zeros(N_COUNTERS, np.int64),
            "malformed": np.zeros(N_MALFORMED, np.int64),
            "io": np.zeros(N_IO, np.int64),
            "sums": np.zeros(sets * self.elements, np.int64),
            "seen": np.zeros(sets * self.words, np.uint64),
            "full": full,
            "contributors": np.zeros(sets, np.int32),
            "state": np.zeros(sets, np.int8),
            "use": np.zeros(sets, np.uint32),
            "offset": np.zeros(sets, np.uint32),
            "elems": np.zeros(sets, np.uint16),
            "exponent": np.zeros(sets, np.int16),
            "exp_round": np.zeros(sets, np.uint8),
        }
        self._arrays = arrays
        self.count, self.malformed, self.io = arrays["count"], arrays["malformed"], arrays["io"]
        cdef int64_t[::1] c = arrays["count"]
        cdef int64_t[::1] m = arrays["malformed"]
        cdef int64_t[::1] io = arrays["io"]
        cdef int64_t[::1] sums = arrays["sums"]
        cdef uint64_t[::1] seen = arrays["seen"]
        cdef uint64_t[::1] fullv = arrays["full"]
        cdef int32_t[::1] contributors = arrays["contributors"]
        cdef int8_t[::1] state = arrays["state"]
        cdef uint32_t[::1] use = arrays["use"]
        cdef uint32_t[::1] offset = arrays["offset"]
        cdef uint16_t[::1] elems = arrays["elems"]
        cdef int16_t[::1] exponent = arrays["exponent"]
        cdef uint8_t[::1] exp_round = arrays["exp_round"]
        self._count, self._malformed, self._io = &c[0], &m[0], &io[0]
        self._sums, self._seen, self._full = &sums[0], &seen[0], &fullv[0]
        self._contributors, self._state, self._use = &contributors[0], &state[0], &use[0]
        self._offset, self._elems = &offset[0], &elems[0]
        self._exponent, self._exp_round = &exponent[0], &exp_round[0]
        self.first_ms = self.last_ms = 0.0
        # socket buffers: room for one byte more than the largest valid datagram
        self._insize = HEADER_SIZE + payload + 4
        self.out_cap = max(batch, min(batch * workers, 4096))
        self._inbuf = <uint8_t*>calloc(batch, self._insize)
        self._outbuf = <uint8_t*>calloc(batch, self._insize)
        self._names = <uint8_t*>calloc(batch, SOCKADDR_SIZE)
        self._inmsg = <mmsghdr*>calloc(batch, sizeof(mmsghdr))
        self._iniov = <iovec*>calloc(batch, sizeof(iovec))
        self._outmsg = <mmsghdr*>calloc(self.out_cap, sizeof(mmsghdr))
        self._outiov = <iovec*>calloc(self.out_cap, sizeof(iovec))
        self._addr = <uint8_t*>calloc(workers, SOCKADDR_SIZE)
        self._addrlen = <socklen_t*>calloc(workers, sizeof(socklen_t))
        self.gso = gso
        self._seg_limit = max(1, min(64, 65000 // self._insize, batch))  # the kernel's limits: 64 segments, 64 KiB
        self._cmsg_space = CMSG_SPACE(sizeof(uint16_t))
        self._cmsg = <uint8_t*>calloc(self.out_cap, self._cmsg_space)
        self._res_buf = <uint8_t**>calloc(batch, sizeof(uint8_t*))
        self._res_size = <int*>calloc(batch, sizeof(int))
        self._res_dest = <int*>calloc(batch, sizeof(int))
        if (self._cmsg == NULL or self._res_buf == NULL or self._res_size == NULL or self._res_dest == NULL
                or self._inbuf == NULL or self._outbuf == NULL or self._names == NULL or self._inmsg == NULL
                or self._iniov == NULL or self._outmsg == NULL or self._outiov == NULL
                or self._addr == NULL or self._addrlen == NULL):
            raise MemoryError("cannot allocate the switch loop's socket buffers")
        cdef int i
        for i in range(batch):
            self._iniov[i].iov_base = self._inbuf + i * self._insize
            self._iniov[i].iov_len = self._insize
            self._inmsg[i].msg_hdr.msg_iov = &self._iniov[i]
            self._inmsg[i].msg_hdr.msg_iovlen = 1
            self._inmsg[i].msg_hdr.msg_name = self._names + i * SOCKADDR_SIZE
        for i in range(self.out_cap):
            self._outmsg[i].msg_hdr.msg_iov = &self._outiov[i]
            self._outmsg[i].msg_hdr.msg_iovlen = 1

    def __dealloc__(self):
        free(self._inbuf)
        free(self._outbuf)
        free(self._names)
        free(self._inmsg)
        free(self._iniov)
        free(self._outmsg)
        free(self._outiov)
        free(self._addr)
        free(self._addrlen)
        free(self._cmsg)
        free(self._res_buf)
        free(self._res_size)
        free(self._res_dest)

    def arrays(self) -> dict:
        """The state arrays by name (flat: index ``2 * slot + set``), for tests and inspection."""
        return dict(self._arrays)

    def counters(self) -> dict:
        """The counters by name: ``SwitchState.counters()``'s, then :data:`IO_COUNTERS`."""
        named = {name: int(self.count[i]) for i, name in enumerate(COUNTERS)}
        named.update({f"malformed_{name}": int(self.malformed[i]) for i, name in enumerate(_MALFORMED)})
        named.update({name: int(self.io[i]) for i, name in enumerate(IO_COUNTERS)})
        return named

    def receive(self, data) -> list:
        """Take one datagram; return what to send, ``[(dest, bytes)]`` as ``SwitchState.receive``.

        Args:
            data: the datagram's bytes (anything with the buffer protocol).

        Returns:
            None or one ``(dest, data)``: dest a worker id or -1 (multicast).
        """
        cdef const uint8_t[::1] view = memoryview(data).cast("B")
        cdef Py_ssize_t size = view.shape[0]
        cdef uint8_t* out = self._outbuf
        cdef int dest = 0
        cdef int n
        cdef const uint8_t* p = &view[0] if size else <const uint8_t*>out
        with nogil:
            n = self._process(p, size, out, &dest)
        return [(dest, bytes(out[:n]))] if n else []

    cdef int _parse(self, const uint8_t* d, Py_ssize_t size) noexcept nogil:
        """-1 when the datagram is well formed, else its Malformed reason (``protocol.parse``)."""
        return parse(d, size, self.job, self.workers, self.slots, self.elements, -1)

    cdef int _process(self, const uint8_t* d, Py_ssize_t size, uint8_t* out, int* dest) noexcept nogil:
        """``SwitchState.receive``: the answer's size in ``out`` (0: none) and its ``dest``."""
        cdef int reason, k, n
        cdef uint8_t flags
        cdef uint32_t u, held
        cdef int s, v, w, i, st
        cdef bint exp_round
        cdef uint64_t bit
        cdef uint64_t* seen
        cdef int64_t* sums
        cdef int64_t x
        cdef int16_t e
        cdef bint over
        self._count[PACKETS_IN] += 1
        self._count[BYTES_IN] += size
        reason = self._parse(d, size)
        if reason >= 0:
            self._malformed[reason] += 1
            self._count[MALFORMED] += 1
            return 0
        flags = d[3]
        if not flags & CONTRIBUTION:
            self._count[NOT_CONTRIBUTION] += 1
            return 0
        s = _u16(d + 10)
        u = _u32(d + 12)
        w = _u16(d + 8)
        n = _u16(d + 20)
        v = u & 1
        i = 2 * s + v
        st = self._state[i]
        exp_round = (flags & EXPONENT_ROUND) != 0
        held = self._use[i]
        if st == EMPTY or (st == COMPLETE and _newer(u, held)):
            self._state[i] = FILLING  # SwitchState._start
            self._use[i] = u
            self._offset[i] = _u32(d + 16)
            self._elems[i] = n
            self._exp_round[i] = exp_round
            self._exponent[i] = ZERO_EXPONENT
            memset(self._seen + i * self.words, 0, self.words * sizeof(uint64_t))
            self._contributors[i] = 0
            memset(self._sums + i * self.elements, 0, self.elements * sizeof(int64_t))
        elif u != held:
            self._count[STALE] += 1
            return 0
        elif _u32(d + 16) != self._offset[i] or n != self._elems[i] or exp_round != self._exp_round[i]:
            self._count[MISMATCH] += 1
            return 0
        seen = self._seen + i * self.words + (w >> 6)
        bit = (<uint64_t>1) << (w & 63)
        if seen[0] & bit:
            if st == COMPLETE:
                self._count[RETRANSMITTED_RESULTS] += 1
                dest[0] = w
                return self._result(i, w, RETRANSMISSION, out)
            self._count[DUPLICATES] += 1
            return 0
        seen[0] |= bit
        self._count[SUMMED] += 1
        if exp_round:
            e = <int16_t>_u16(d + 22)
            if e > self._exponent[i]:
                self._exponent[i] = e
        else:
            sums = self._sums + i * self.elements
            for k in range(n):
                sums[k] += <int32_t>_u32(d + HEADER_SIZE + 4 * k)
        self._contributors[i] += 1
        if self._contributors[i] < self.workers:
            return 0
        self._state[i] = COMPLETE
        self._count[COMPLETED] += 1
        if exp_round:
            self._count[EXPONENT_ROUNDS] += 1
        else:
            sums = self._sums + i * self.elements
            over = False
            for k in range(n):
                x = sums[k]
                if x > INT32_MAX:
                    sums[k] = INT32_MAX
                    over = True
                elif x < INT32_MIN:
                    sums[k] = INT32_MIN
                    over = True
            if over:
                self._count[OVERFLOW] += 1
        dest[0] = MULTICAST
        return self._result(i, MULTICAST, 0, out)

    cdef int _result(self, int i, int dest, int extra, uint8_t* out) noexcept nogil:
        """Encode set ``i``'s result for ``dest`` into ``out``; count it (``SwitchState._result``)."""
        cdef bint exp_round = self._exp_round[i]
        cdef int n = 0 if exp_round else self._elems[i]
        cdef int k, size, copies
        cdef int64_t* sums = self._sums + i * self.elements
        _put16(out, MAGIC)
        out[2] = VERSION
        out[3] = RESULT | extra | (EXPONENT_ROUND if exp_round else 0)
        _put32(out + 4, self.job)
        _put16(out + 8, ALL_WORKERS if dest == MULTICAST else dest)
        _put16(out + 10, i >> 1)
        _put32(out + 12, self._use[i])
        _put32(out + 16, self._offset[i])
        _put16(out + 20, n)
        _put16(out + 22, <uint16_t>(self._exponent[i] if exp_round else 0))
        for k in range(n):
            _put32(out + HEADER_SIZE + 4 * k, <uint32_t><int32_t>sums[k])
        size = HEADER_SIZE + 4 * n
        copies = self.workers if dest == MULTICAST else 1
        self._count[PACKETS_OUT] += copies
        self._count[BYTES_OUT] += copies * size
        return size

    cdef inline void _learn(self, const uint8_t* d, Py_ssize_t size, int j) noexcept nogil:
        """Remember the address of a well-formed contribution's sender (input message ``j``)."""
        cdef int w
        cdef socklen_t length = self._inmsg[j].msg_hdr.msg_namelen
        if size < HEADER_SIZE or not d[3] & CONTRIBUTION or length > SOCKADDR_SIZE:
            return
        if self._parse(d, size) >= 0:
            return
        w = _u16(d + 8)
        memcpy(self._addr + w * SOCKADDR_SIZE, self._names + j * SOCKADDR_SIZE, length)
        self._addrlen[w] = length

    cdef void _flush(self, int fd, int nout) noexcept nogil:
        """``sendmmsg`` the ``nout`` queued messages; count the datagrams that could not be sent."""
        cdef int sent = 0, r, tries = 0
        cdef pollfd pfd
        while sent < nout:
            r = sendmmsg(fd, self._outmsg + sent, nout - sent, 0)
            self._io[SEND_CALLS] += 1
            if r > 0:
                sent += r
                continue
            if r < 0 and errno == EINTR:
                continue
            if r < 0 and (errno == EAGAIN or errno == EWOULDBLOCK):
                if tries < 1:
                    tries += 1  # the send queue is full: wait a millisecond once, then drop
                    pfd.fd, pfd.events, pfd.revents = fd, POLLOUT, 0
                    poll(&pfd, 1, 1)
                    continue
                while sent < nout:
                    self._io[SEND_FAILED] += self._outmsg[sent].msg_hdr.msg_iovlen
                    sent += 1
                break
            # this message failed (an unreachable worker, or GSO refused): skip it
            if self._outmsg[sent].msg_hdr.msg_control != NULL:
                self.gso = False
            self._io[SEND_FAILED] += self._outmsg[sent].msg_hdr.msg_iovlen
            sent += 1

    cdef inline int _message(self, int nout, int niov, int count, int size, int w) noexcept nogil:
        """Make message ``nout``: the ``count`` datagrams at ``_outiov[niov:]`` to worker ``w``."""
        cdef msghdr* m = &self._outmsg[nout].msg_hdr
        m.msg_iov = &self._outiov[niov]
        m.msg_iovlen = count
        m.msg_name = self._addr + w * SOCKADDR_SIZE
        m.msg_namelen = self._addrlen[w]
        if set_segments(m, self._cmsg + nout * self._cmsg_space, self._cmsg_space, count, size):
            self._io[GSO_MESSAGES] += 1
        return nout + 1

    cdef void _send_results(self, int fd, int nres) noexcept nogil:
        """Send the batch's ``nres`` results: one datagram per worker of a multicast, one to the
        asker of a shadow result; with GSO, a worker's run of equal-size results as one message."""
        cdef int nout = 0, niov = 0, r, w, count, size = 0, limit = 1
        if self.gso:
            limit = self._seg_limit
        for w in range(self.workers):
            count = 0
            for r in range(nres):
                if self._res_dest[r] != MULTICAST and self._res_dest[r] != w:
                    continue
                if self._addrlen[w] == 0:
                    self._io[NO_ADDRESS] += 1
                    continue
                if count and (self._res_size[r] != size or count == limit):
                    nout = self._message(nout, niov, count, size, w)
                    niov += count
                    count = 0
                if count == 0:
                    if nout == self.out_cap or niov + limit > self.out_cap:
                        self._flush(fd, nout)
                        nout = niov = 0
                    size = self._res_size[r]
                self._outiov[niov + count].iov_base = self._res_buf[r]
                self._outiov[niov + count].iov_len = size
                count += 1
            if count:
                nout = self._message(nout, niov, count, size, w)
                niov += count
        if nout:
            self._flush(fd, nout)

    def serve(self, int fd, double max_ms) -> int:
        """Serve datagrams on ``fd`` for at most ``max_ms`` milliseconds, without the GIL.

        Args:
            fd: a bound, non-blocking UDP socket's file descriptor (the caller owns it).
            max_ms: how long to serve before returning (the caller checks its signals and
                flags between calls); an interrupted system call also returns early.

        Returns:
            The datagrams received.

        Raises:
            OSError: the socket failed (other than EAGAIN/EINTR).
        """
        cdef double start = _now_ms(), now = start, deadline = start + max_ms
        cdef long long served = 0
        cdef int got, j, size, nres, dest, err = 0, wait
        cdef int vlen = self.batch
        cdef uint8_t* inp
        cdef uint8_t* out
        cdef pollfd pfd
        pfd.fd, pfd.events = fd, POLLIN
        with nogil:
            while True:
                for j in range(vlen):
                    self._inmsg[j].msg_hdr.msg_namelen = SOCKADDR_SIZE
                got = recvmmsg(fd, self._inmsg, vlen, MSG_DONTWAIT | MSG_TRUNC, NULL)
                if got <= 0:
                    if got < 0 and errno != EAGAIN and errno != EWOULDBLOCK:
                        if errno != EINTR:
                            err = errno
                        break
                    now = _now_ms()
                    wait = <int>(deadline - now + 0.999)
                    if wait <= 0:
                        break
                    pfd.revents = 0
                    if poll(&pfd, 1, wait) < 0:
                        if errno != EINTR:
                            err = errno
                        break
                    continue
                self._io[RECV_CALLS] += 1
                now = _now_ms()
                if self.first_ms == 0.0:
                    self.first_ms = now
                self.last_ms = now
                served += got
                nres = 0
                for j in range(got):
                    inp = self._inbuf + j * self._insize
                    size = self._inmsg[j].msg_len  # the datagram's real size (MSG_TRUNC)
                    if size > self._insize:  # longer than any valid datagram: only the header is read
                        self._count[PACKETS_IN] += 1
                        self._count[BYTES_IN] += size
                        self._malformed[self._parse_long(inp, size)] += 1
                        self._count[MALFORMED] += 1
                        continue
                    self._learn(inp, size, j)
                    out = self._outbuf + j * self._insize
                    size = self._process(inp, size, out, &dest)
                    if size:
                        self._res_buf[nres], self._res_size[nres], self._res_dest[nres] = out, size, dest
                        nres += 1
                if nres:
                    self._send_results(fd, nres)
                if now >= deadline:
                    break
        if err:
            raise OSError(err, f"the switch socket failed (errno {err}): check the socket passed to serve()")
        return served

    cdef int _parse_long(self, const uint8_t* d, Py_ssize_t size) noexcept nogil:
        """The Malformed reason of a datagram longer than the receive buffer (never well formed)."""
        cdef int reason = self._parse(d, size)
        return M_LENGTH if reason < 0 else reason


def generate(fds, int workers, int slots, int payload, long long job, double duration_ms,
             int window=32, int batch=64, double timeout_ms=20.0, bint gso=False) -> dict:
    """Emulate ``workers`` workers streaming contributions to a switch, for ``duration_ms``.

    Worker w sends on ``fds[w]`` (connected UDP sockets, non-blocking, one per worker).
    Each keeps ``window`` chunks in flight on slots 0 .. window-1 (as ``WorkerState``): the
    result of a slot's use u makes it send use u + 1; a chunk without result after
    ``timeout_ms`` is sent again flagged RETRANSMISSION. Contributions carry ``w + 1`` in
    every element; a result whose elements are not W(W+1)/2 is counted ``bad``. Datagrams
    are sent with ``sendmmsg`` and received with ``recvmmsg``, up to ``batch`` per call; with
    ``gso``, a worker's datagrams of one call go as one ``UDP_SEGMENT`` message (the kernel
    cuts it into the same datagrams, so the load costs the generator less CPU).

    Returns:
        ``sent``, ``received``, ``results`` (results for the chunk in flight),
        ``retransmissions``, ``bad``, ``send_failed`` and ``seconds`` (the run's length).
    """
    if len(fds) != workers or not 1 <= window <= slots or not 1 <= batch <= 1024:
        raise ValueError(f"need one socket per worker and 1 <= window <= slots (got {len(fds)} "
                         f"sockets, window {window}, slots {slots})")
    cdef int elements = payload // 4
    cdef int size = HEADER_SIZE + 4 * elements
    cdef int insize = size + 4
    cdef int32_t expected = workers * (workers + 1) // 2
    fd_arr = np.asarray(fds, np.int32)
    cdef int32_t[::1] fd = fd_arr
    use_arr = np.zeros((workers, window), np.uint32)
    cdef uint32_t[:, ::1] use = use_arr
    sent_at_arr = np.zeros((workers, window), np.float64)
    cdef double[:, ::1] sent_at = sent_at_arr
    # one datagram per (worker, slot), kept for retransmissions; receive buffers per worker
    out_arr = np.zeros((workers, window, size), np.uint8)
    cdef uint8_t[:, :, ::1] out = out_arr
    in_arr = np.zeros((batch, insize), np.uint8)
    cdef uint8_t[:, ::1] inb = in_arr
    cdef mmsghdr* inmsg = <mmsghdr*>calloc(batch, sizeof(mmsghdr))
    cdef iovec* iniov = <iovec*>calloc(batch, sizeof(iovec))
    cdef mmsghdr* outmsg = <mmsghdr*>calloc(batch, sizeof(mmsghdr))
    cdef iovec* outiov = <iovec*>calloc(batch, sizeof(iovec))
    cdef pollfd* pfds = <pollfd*>calloc(workers, sizeof(pollfd))
    cdef int* pending = <int*>calloc(window, sizeof(int))
    cdef int space = CMSG_SPACE(sizeof(uint16_t))
    cdef uint8_t* cmsg = <uint8_t*>calloc(batch, space)
    cdef int limit = max(1, min(64, 65000 // size, batch)) if gso else 1
    if (inmsg == NULL or iniov == NULL or outmsg == NULL or outiov == NULL or pfds == NULL or pending == NULL
            or cmsg == NULL):
        free(inmsg); free(iniov); free(outmsg); free(outiov); free(pfds); free(pending); free(cmsg)
        raise MemoryError("cannot allocate the generator's buffers")
    cdef int w, s, j, k, got, npend, nsent, r, flags
    cdef long long sent = 0, received = 0, results = 0, retrans = 0, bad = 0, failed = 0
    cdef uint8_t* d
    cdef uint32_t u
    cdef double start, now, deadline, next_check
    cdef bint idle
    for j in range(batch):
        iniov[j].iov_base = &inb[j, 0]
        iniov[j].iov_len = insize
        inmsg[j].msg_hdr.msg_iov = &iniov[j]
        inmsg[j].msg_hdr.msg_iovlen = 1
        outmsg[j].msg_hdr.msg_iov = &outiov[j]
        outmsg[j].msg_hdr.msg_iovlen = 1
    for w in range(workers):
        pfds[w].fd, pfds[w].events = fd[w], POLLIN
        for s in range(window):
            d = &out[w, s, 0]
            _put16(d, MAGIC)
            d[2] = VERSION
            _put32(d + 4, <uint32_t>job)
            _put16(d + 8, w)
            _put16(d + 10, s)
            _put32(d + 16, s * elements)
            _put16(d + 20, elements)
            for k in range(elements):
                _put32(d + HEADER_SIZE + 4 * k, w + 1)
    with nogil:
        start = _now_ms()
        deadline = start + duration_ms
        next_check = start + timeout_ms
        # every worker sends its first window
        for w in range(workers):
            for s in range(window):
                pending[s] = s
            sent += _gen_send(fd[w], out, w, pending, window, size, outmsg, outiov, batch, cmsg, space, limit,
                              use, sent_at, start, CONTRIBUTION, &failed)
        while True:
            now = _now_ms()
            if now >= deadline:
                break
            idle = True
            for w in range(workers):
                got = recvmmsg(fd[w], inmsg, batch, MSG_DONTWAIT, NULL)
                if got <= 0:
                    continue
                idle = False
                received += got
                npend = 0
                for j in range(got):
                    d = &inb[j, 0]
                    if inmsg[j].msg_len < HEADER_SIZE or not d[3] & RESULT:
                        continue
                    s = _u16(d + 10)
                    u = _u32(d + 12)
                    if s >= window or u != use[w, s]:
                        continue  # a duplicate or late result
                    if <int>inmsg[j].msg_len != size or <int32_t>_u32(d + HEADER_SIZE) != expected:
                        bad += 1
                    results += 1
                    use[w, s] = u + 1
                    pending[npend] = s
                    npend += 1
                if npend:
                    sent += _gen_send(fd[w], out, w, pending, npend, size, outmsg, outiov, batch, cmsg, space, limit,
                                      use, sent_at, now, CONTRIBUTION, &failed)
            if now >= next_check:  # chunks whose result is overdue: send again
                next_check = now + timeout_ms / 4
                for w in range(workers):
                    npend = 0
                    for s in range(window):
                        if now - sent_at[w, s] >= timeout_ms:
                            pending[npend] = s
                            npend += 1
                    if npend:
                        retrans += npend
                        sent += _gen_send(fd[w], out, w, pending, npend, size, outmsg, outiov, batch, cmsg, space, limit,
                                          use, sent_at, now, CONTRIBUTION | RETRANSMISSION, &failed)
            if idle:
                poll(pfds, workers, 1)
        now = _now_ms()
    free(inmsg); free(iniov); free(outmsg); free(outiov); free(pfds); free(pending); free(cmsg)
    return {"sent": sent, "received": received, "results": results, "retransmissions": retrans,
            "bad": bad, "send_failed": failed, "seconds": (now - start) / 1e3}


cdef long long _gen_send(int fd, uint8_t[:, :, ::1] out, int w, int* pending, int n, int size,
                         mmsghdr* msg, iovec* iov, int batch, uint8_t* cmsg, int space, int limit,
                         uint32_t[:, ::1] use, double[:, ::1] sent_at, double now, int flags,
                         long long* failed) noexcept nogil:
    """Stamp and send worker ``w``'s datagrams for the ``n`` slots in ``pending``: ``sendmmsg``
    of messages of up to ``limit`` datagrams each (more than one: a ``UDP_SEGMENT`` message)."""
    cdef int j = 0, m, k, r, s, nmsg, count
    cdef long long sent = 0
    while j < n:
        m = min(batch, n - j)
        for k in range(m):
            s = pending[j + k]
            _put32(&out[w, s, 0] + 12, use[w, s])
            out[w, s, 3] = flags
            sent_at[w, s] = now
            iov[k].iov_base = &out[w, s, 0]
            iov[k].iov_len = size
        nmsg = 0
        k = 0
        while k < m:
            count = min(limit, m - k)
            msg[nmsg].msg_hdr.msg_iov = &iov[k]
            msg[nmsg].msg_hdr.msg_iovlen = count
            set_segments(&msg[nmsg].msg_hdr, cmsg + nmsg * space, space, count, size)
            nmsg += 1
            k += count
        k = 0
        while k < nmsg:
            r = sendmmsg(fd, msg + k, nmsg - k, 0)
            if r > 0:
                for s in range(r):
                    sent += msg[k + s].msg_hdr.msg_iovlen
                k += r
            elif r < 0 and errno == EINTR:
                continue
            else:
                for s in range(k, nmsg):  # dropped: the retransmission timer sends them again
                    failed[0] += msg[s].msg_hdr.msg_iovlen
                break
        j += m
    return sent
