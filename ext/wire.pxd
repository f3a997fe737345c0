# cython: language_level=3
"""What the switch's packet loop (``switchloop.pyx``) and the worker's (``workerloop.pyx``) share:
the wire protocol of ``hpcdl/switch/protocol.py`` restated for C (the tests check they agree),
its parser, and the Linux socket calls both batch.

Only declarations, enums and inline functions: ``cimport``-ed at compile time, no module of its
own at run time.
"""

from libc.stdint cimport int64_t, uint8_t, uint16_t, uint32_t

cdef extern from "<sys/uio.h>" nogil:
    struct iovec:
        void* iov_base
        size_t iov_len

cdef extern from "<sys/socket.h>" nogil:
    ctypedef unsigned int socklen_t
    struct sockaddr:
        pass
    struct sockaddr_storage:
        pass
    struct msghdr:
        void* msg_name
        socklen_t msg_namelen
        iovec* msg_iov
        size_t msg_iovlen
        void* msg_control
        size_t msg_controllen
        int msg_flags
    struct mmsghdr:
        msghdr msg_hdr
        unsigned int msg_len
    struct cmsghdr:
        size_t cmsg_len
        int cmsg_level
        int cmsg_type
    int recvmmsg(int fd, mmsghdr* msgvec, unsigned int vlen, int flags, void* timeout)
    int sendmmsg(int fd, mmsghdr* msgvec, unsigned int vlen, int flags)
    size_t CMSG_SPACE(size_t length)
    size_t CMSG_LEN(size_t length)
    unsigned char* CMSG_DATA(cmsghdr* c)
    int MSG_DONTWAIT
    int MSG_TRUNC

cdef extern from *:
    """
    #include <netinet/udp.h>
    #ifndef UDP_SEGMENT
    #define UDP_SEGMENT 103
    #endif
    #ifndef SOL_UDP
    #define SOL_UDP 17
    #endif
    """
    int UDP_SEGMENT
    int SOL_UDP

cdef extern from "<errno.h>" nogil:
    int EWOULDBLOCK
    int ECONNREFUSED

cdef extern from "<time.h>" nogil:
    struct timespec:
        long tv_sec
        long tv_nsec
    int clock_gettime(int clk, timespec* ts)
    int CLOCK_MONOTONIC

cdef extern from "<poll.h>" nogil:
    struct pollfd:
        int fd
        short events
        short revents
    int poll(pollfd* fds, unsigned long nfds, int timeout)
    int ppoll(pollfd* fds, unsigned long nfds, const timespec* tmo, const void* sigmask)
    short POLLIN
    short POLLOUT

# protocol.py's header and flags
cdef enum:
    HEADER_SIZE = 24
    MAGIC = 0x5348
    VERSION = 1
    CONTRIBUTION = 0x01
    RESULT = 0x02
    RETRANSMISSION = 0x04
    EXPONENT_ROUND = 0x08
    KNOWN_FLAGS = 0x0F
    ALL_WORKERS = 0xFFFF
    ZERO_EXPONENT = -32768

# Malformed (protocol.py), in its order
cdef enum:
    M_SHORT = 0
    M_LENGTH = 1
    M_MAGIC = 2
    M_VERSION = 3
    M_FLAGS = 4
    M_JOB = 5
    M_WORKER = 6
    M_SLOT = 7
    M_COUNT = 8
    M_OFFSET = 9
    N_MALFORMED = 10


cdef inline uint16_t _u16(const uint8_t* d) noexcept nogil:
    return <uint16_t>(d[0] | (<uint16_t>d[1] << 8))


cdef inline uint32_t _u32(const uint8_t* d) noexcept nogil:
    return d[0] | (<uint32_t>d[1] << 8) | (<uint32_t>d[2] << 16) | (<uint32_t>d[3] << 24)


cdef inline void _put16(uint8_t* d, uint16_t x) noexcept nogil:
    d[0] = x & 0xFF
    d[1] = x >> 8


cdef inline void _put32(uint8_t* d, uint32_t x) noexcept nogil:
    d[0] = x & 0xFF
    d[1] = (x >> 8) & 0xFF
    d[2] = (x >> 16) & 0xFF
    d[3] = x >> 24


cdef inline int parse(const uint8_t* d, Py_ssize_t size, uint32_t job, int workers, int slots, int elements,
                      int64_t length) noexcept nogil:
    """-1 when the datagram is well formed, else its Malformed reason (``protocol.parse`` with
    these limits; ``length`` the vector's, or -1 when not known, as on the switch)."""
    cdef uint8_t flags
    cdef uint16_t worker, count
    cdef uint32_t offset
    if size < HEADER_SIZE:
        return M_SHORT
    if _u16(d) != MAGIC:
        return M_MAGIC
    if d[2] != VERSION:
        return M_VERSION
    flags = d[3]
    if flags & ~KNOWN_FLAGS or ((flags & CONTRIBUTION) != 0) == ((flags & RESULT) != 0):
        return M_FLAGS
    if _u32(d + 4) != job:
        return M_JOB
    worker = _u16(d + 8)
    if worker >= workers and not (flags & RESULT and worker == ALL_WORKERS):
        return M_WORKER
    if _u16(d + 10) >= slots:
        return M_SLOT
    count = _u16(d + 20)
    if flags & EXPONENT_ROUND:
        if count != 0:
            return M_COUNT
    elif not 1 <= count <= elements:
        return M_COUNT
    offset = _u32(d + 16)
    if offset % <uint32_t>elements or (length >= 0 and <int64_t>offset + count > length):
        return M_OFFSET
    if size < HEADER_SIZE + 4 * <Py_ssize_t>count:
        return M_SHORT
    if size > HEADER_SIZE + 4 * <Py_ssize_t>count:
        return M_LENGTH
    return -1


cdef inline bint set_segments(msghdr* m, uint8_t* cmsg, size_t space, int count, int size) noexcept nogil:
    """Make ``m``, carrying ``count`` datagrams of ``size`` bytes back to back, one UDP GSO message
    (a UDP_SEGMENT control message in ``cmsg``: the kernel cuts it) when ``count`` > 1; True then."""
    cdef cmsghdr* c
    if count > 1:
        c = <cmsghdr*>cmsg
        c.cmsg_level, c.cmsg_type, c.cmsg_len = SOL_UDP, UDP_SEGMENT, CMSG_LEN(sizeof(uint16_t))
        (<uint16_t*>CMSG_DATA(c))[0] = <uint16_t>size
        m.msg_control, m.msg_controllen = c, space
        return True
    m.msg_control, m.msg_controllen = NULL, 0
    return False
