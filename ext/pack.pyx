# cython: boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False, language_level=3
"""Pack many float32/float64 arrays into one buffer at given offsets, casting on the way, and back.

Modes (the buffer's element type): ``PLAIN`` (the arrays' dtype: ``memcpy``; unpack may
scale), ``FLOAT16`` (IEEE half stored as ``uint16`` bits, round to nearest even, bit for bit
``arr.astype(np.float16)`` including subnormals, inf and NaN payloads), ``BFLOAT16``
(``uint16``, round to nearest even; float64 goes through float32) and ``INT32``
(``q = rint(g * qscale)`` saturated to ``±(2**31 - 1)``, NaN to 0; unpack ``g = q * mult``
computed in float64). Every loop runs without the GIL on fused ``cython.floating`` types.
On x86-64 CPUs with F16C, float32 packs and all arrays unpack to and from float16 eight
at a time in ``half.h``; blocks holding a NaN, tails, and float64 packing run the bit
routines below, which define the results (tests check both paths against NumPy). float32
packs to bfloat16 with AVX2, the same integer steps.

:class:`Plan` holds a fixed list of slots (shape, offset); each call checks the arrays in C
(exact ``ndarray``, dtype, shape, C-contiguous, aligned) and copies through a pointer
table, so 64 arrays cost about a microsecond of bookkeeping. It returns False, having
written nothing useful, when an array does not qualify: the caller then takes its NumPy path.
``pack``/``unpack`` (lists and memoryviews) and the element-wise ``to_*``/``from_*``
kernels are the same loops with typed memoryviews.
"""

from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cython cimport floating
from libc.stdint cimport int32_t, uint16_t, uint32_t, uint64_t
from libc.string cimport memcpy

cimport numpy as cnp

cdef extern from "stream.h" nogil:
    void hpcdl_stream_copy(void* dst, const void* src, size_t n)
    void hpcdl_stream_fence()

cdef extern from "half.h" nogil:
    int hpcdl_f16c_supported()
    int hpcdl_avx2_supported()
    size_t hpcdl_f32_to_bf16_avx2(const float* src, uint16_t* dst, size_t n)
    size_t hpcdl_f32_to_f16_f16c(const float* src, uint16_t* dst, size_t n)
    size_t hpcdl_f16_to_f32_f16c(const uint16_t* src, float* dst, size_t n, float s)
    size_t hpcdl_f16_to_f64_f16c(const uint16_t* src, double* dst, size_t n, double s)
import numpy as np

cnp.import_array()

PLAIN, FLOAT16, BFLOAT16, INT32 = 0, 1, 2, 3

#: plain copies of at least this many bytes in one call use streaming stores (like glibc's
#: memcpy above its non-temporal threshold): the destination is not read into the caches
STREAM_BYTES = 8 << 20
cdef Py_ssize_t _STREAM_BYTES = STREAM_BYTES

#: largest magnitude of a quantized value (symmetric saturation)
INT32_LIMIT = 2147483647

#: True when the float16 kernels run on F16C (x86-64 built with GCC or Clang, and this CPU has it)
cdef bint _F16C = hpcdl_f16c_supported()
#: True when float32 packs to bfloat16 with AVX2 (same build and run-time conditions)
cdef bint _AVX2 = hpcdl_avx2_supported()

cdef double _QMAX = 2147483647.0
cdef double _RNE_MAGIC = 6755399441055744.0  # 1.5 * 2**52: (v + M) - M rounds |v| < 2**51 to even


# -- bit conversions ---------------------------------------------------------------------

cdef union _F32:
    float f
    uint32_t u

cdef union _F64:
    double d
    uint64_t u


cdef inline uint32_t _fbits(float f) noexcept nogil:
    cdef _F32 c
    c.f = f
    return c.u


cdef inline float _bitsf(uint32_t u) noexcept nogil:
    cdef _F32 c
    c.u = u
    return c.f


cdef inline uint64_t _dbits(double d) noexcept nogil:
    cdef _F64 c
    c.d = d
    return c.u


cdef inline double _bitsd(uint64_t u) noexcept nogil:
    cdef _F64 c
    c.u = u
    return c.d


cdef inline uint16_t _f32_to_f16(uint32_t x) noexcept nogil:
    """Round to nearest even; NaN keeps its top payload bits (never becomes inf), like NumPy."""
    cdef uint32_t sign = (x >> 16) & 0x8000u
    cdef uint32_t a = x & 0x7fffffffu
    # normal: rebias the exponent, add half an ulp minus one plus the ulp's parity bit
    cdef uint32_t r = (a - (112u << 23) + 0xfffu + ((a >> 13) & 1u)) >> 13
    # subnormal or zero (|x| < 2**-14): let the FPU round at the ulp of 0.5, which is 2**-24
    cdef uint32_t sub = _fbits(_bitsf(a) + <float>0.5) - (126u << 23)
    cdef uint32_t nan = 0x7c00u | ((a >> 13) & 0x3ffu)
    nan = nan + (nan == 0x7c00u)
    r = sub if a < (113u << 23) else r
    r = 0x7c00u if a >= (143u << 23) else r  # overflow and inf
    r = nan if a > 0x7f800000u else r
    return <uint16_t>(r | sign)


cdef inline uint16_t _f64_to_f16(uint64_t x) noexcept nogil:
    """Round float64 bits directly to half (no double rounding through float32), like NumPy."""
    cdef uint32_t sign = <uint32_t>(x >> 48) & 0x8000u
    cdef uint64_t a = x & 0x7fffffffffffffffu
    cdef uint64_t r = (a - (<uint64_t>1008 << 52) + 0x1ffffffffffu + ((a >> 42) & 1u)) >> 42
    # 2**28 has an ulp of 2**-24, the smallest half subnormal
    cdef uint64_t sub = _dbits(_bitsd(a) + 268435456.0) - (<uint64_t>1051 << 52)
    cdef uint64_t nan = 0x7c00u | ((a >> 42) & 0x3ffu)
    nan = nan + (nan == 0x7c00u)
    r = sub if a < (<uint64_t>1009 << 52) else r
    r = 0x7c00u if a >= (<uint64_t>1039 << 52) else r
    r = nan if a > 0x7ff0000000000000u else r
    return <uint16_t>(r | sign)


cdef inline float _f16_to_f32(uint16_t h) noexcept nogil:
    """Exact; NaN payloads are kept (not quieted), like NumPy."""
    cdef uint32_t o = (<uint32_t>h & 0x7fffu) << 13
    cdef uint32_t e = o & (0x1fu << 23)
    o += 112u << 23
    o = o + (112u << 23) if e == (0x1fu << 23) else o
    o = _fbits(_bitsf(o + (1u << 23)) - _bitsf(113u << 23)) if e == 0 else o
    return _bitsf(o | ((<uint32_t>h & 0x8000u) << 16))


cdef inline double _f16_to_f64(uint16_t h) noexcept nogil:
    cdef uint64_t o = (<uint64_t>h & 0x7fffu) << 42
    cdef uint64_t e = o & (<uint64_t>0x1f << 52)
    o += <uint64_t>1008 << 52
    o = o + (<uint64_t>1008 << 52) if e == (<uint64_t>0x1f << 52) else o
    o = _dbits(_bitsd(o + (<uint64_t>1 << 52)) - _bitsd(<uint64_t>1009 << 52)) if e == 0 else o
    return _bitsd(o | ((<uint64_t>h & 0x8000u) << 48))


cdef inline uint16_t _f32_to_bf16(uint32_t x) noexcept nogil:
    cdef uint32_t r = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16
    return <uint16_t>(((x >> 16) | 0x40u) if (x & 0x7fffffffu) > 0x7f800000u else r)


# -- element-wise loops (fused float32/float64) -------------------------------------------

cdef void _copy_scaled(const floating* src, floating* dst, Py_ssize_t n, floating s) noexcept nogil:
    cdef Py_ssize_t j
    for j in range(n):
        dst[j] = src[j] * s


cdef void _to_f16(const floating* src, uint16_t* dst, Py_ssize_t n, bint simd) noexcept nogil:
    """float32 through F16C when ``simd`` (blocks holding a NaN and the tail in software)."""
    cdef Py_ssize_t i = 0, j, end
    if floating is float:
        if simd and _F16C:
            while i < n:
                i += hpcdl_f32_to_f16_f16c(src + i, dst + i, <size_t>(n - i))
                end = i + 8 if i + 8 < n else n
                for j in range(i, end):
                    dst[j] = _f32_to_f16(_fbits(src[j]))
                i = end
            return
    for j in range(n):
        if floating is float:
            dst[j] = _f32_to_f16(_fbits(src[j]))
        else:
            dst[j] = _f64_to_f16(_dbits(src[j]))


cdef void _from_f16(const uint16_t* src, floating* dst, Py_ssize_t n, floating s, bint simd) noexcept nogil:
    """Widen, then multiply in ``floating``; through F16C when ``simd`` (NaN blocks, tail in software)."""
    cdef Py_ssize_t i = 0, end
    if simd and _F16C:
        while i < n:
            if floating is float:
                i += hpcdl_f16_to_f32_f16c(src + i, dst + i, <size_t>(n - i), s)
            else:
                i += hpcdl_f16_to_f64_f16c(src + i, dst + i, <size_t>(n - i), s)
            end = i + 8 if i + 8 < n else n
            _from_f16_soft(src + i, dst + i, end - i, s)
            i = end
        return
    _from_f16_soft(src, dst, n, s)


cdef void _from_f16_soft(const uint16_t* src, floating* dst, Py_ssize_t n, floating s) noexcept nogil:
    cdef Py_ssize_t j
    if s == 1:
        for j in range(n):
            if floating is float:
                dst[j] = _f16_to_f32(src[j])
            else:
                dst[j] = _f16_to_f64(src[j])
    else:
        for j in range(n):
            if floating is float:
                dst[j] = _f16_to_f32(src[j]) * s
            else:
                dst[j] = _f16_to_f64(src[j]) * s


cdef void _to_bf16(const floating* src, uint16_t* dst, Py_ssize_t n, bint simd) noexcept nogil:
    """float32 16 at a time with AVX2 when ``simd`` (the same integer steps; the tail in software)."""
    cdef Py_ssize_t i = 0, j
    if floating is float:
        if simd and _AVX2:
            i = hpcdl_f32_to_bf16_avx2(src, dst, <size_t>n)
    for j in range(i, n):
        dst[j] = _f32_to_bf16(_fbits(<float>src[j]))


cdef void _from_bf16(const uint16_t* src, floating* dst, Py_ssize_t n, floating s) noexcept nogil:
    cdef Py_ssize_t j
    for j in range(n):
        dst[j] = <floating>_bitsf(<uint32_t>src[j] << 16) * s


cdef void _quantize(const floating* src, int32_t* dst, Py_ssize_t n, double qscale) noexcept nogil:
    cdef Py_ssize_t j
    cdef double v
    for j in range(n):
        v = <double>src[j] * qscale
        v = _QMAX if v > _QMAX else v
        v = -_QMAX if v < -_QMAX else v
        v = (v + _RNE_MAGIC) - _RNE_MAGIC
        dst[j] = <int32_t>v if v == v else 0


cdef void _dequantize(const int32_t* src, floating* dst, Py_ssize_t n, double mult) noexcept nogil:
    cdef Py_ssize_t j
    for j in range(n):
        dst[j] = <floating>(<double>src[j] * mult)


cdef double _maxabs(const floating* x, Py_ssize_t n) noexcept nogil:
    """max |x| through the bit patterns (integer max vectorises); NaN when any is NaN."""
    cdef Py_ssize_t j
    cdef uint32_t b32, m32 = 0
    cdef uint64_t b64, m64 = 0
    if floating is float:
        for j in range(n):
            b32 = _fbits(x[j]) & 0x7fffffffu
            m32 = b32 if b32 > m32 else m32
        return <double>_bitsf(0x7fc00000u if m32 > 0x7f800000u else m32)
    else:
        for j in range(n):
            b64 = _dbits(x[j]) & 0x7fffffffffffffffu
            m64 = b64 if b64 > m64 else m64
        return _bitsd(0x7ff8000000000000u if m64 > 0x7ff0000000000000u else m64)


cdef inline void _copy(void* dst, const void* src, size_t nbytes, bint stream) noexcept nogil:
    if stream:
        hpcdl_stream_copy(dst, src, nbytes)
    else:
        memcpy(dst, src, nbytes)


cdef void _pack_one(int mode, const floating* src, char* dst, Py_ssize_t n, double qscale,
                    bint stream=False) noexcept nogil:
    if mode == 0:
        _copy(dst, src, <size_t>n * sizeof(floating), stream)
    elif mode == 1:
        _to_f16(src, <uint16_t*>dst, n, True)
    elif mode == 2:
        _to_bf16(src, <uint16_t*>dst, n, True)
    else:
        _quantize(src, <int32_t*>dst, n, qscale)


cdef void _unpack_one(int mode, const char* src, floating* dst, Py_ssize_t n, double scale,
                      bint stream=False) noexcept nogil:
    if mode == 0:
        if scale == 1.0:
            _copy(dst, src, <size_t>n * sizeof(floating), stream)
        else:
            _copy_scaled(<const floating*>src, dst, n, <floating>scale)
    elif mode == 1:
        _from_f16(<const uint16_t*>src, dst, n, <floating>scale, True)
    elif mode == 2:
        _from_bf16(<const uint16_t*>src, dst, n, <floating>scale)
    else:
        _dequantize(<const int32_t*>src, dst, n, scale)  # scale is the multiplier here


# -- the plan: a pointer table over a fixed list of slots ---------------------------------

cdef int _buffer_type(int mode, int typenum):
    if mode == 0:
        return typenum
    if mode == 1:
        return cnp.NPY_FLOAT16
    if mode == 2:
        return cnp.NPY_UINT16
    return cnp.NPY_INT32


cdef class Plan:
    """Slots of fixed shapes at element offsets of a buffer; copies through a pointer table.

    Args:
        shapes: the arrays' shapes, in packing order.
        dtype: the arrays' dtype (``numpy.float32`` or ``numpy.float64``).
        mode: ``PLAIN``, ``FLOAT16``, ``BFLOAT16`` or ``INT32``.

    Raises:
        ValueError: unsupported dtype or mode.
    """

    cdef readonly Py_ssize_t n, total
    cdef readonly int mode
    cdef int typenum, buftype
    cdef Py_ssize_t itemsize, bufsize
    cdef Py_ssize_t* offsets
    cdef int* ndims
    cdef Py_ssize_t* dims
    cdef Py_ssize_t* dim_start
    cdef void** ptrs

    def __cinit__(self, list shapes, dtype, int mode=0):
        cdef Py_ssize_t k, d, nd_total = 0
        dt = np.dtype(dtype)
        if dt == np.float32:
            self.typenum, self.itemsize = cnp.NPY_FLOAT32, 4
        elif dt == np.float64:
            self.typenum, self.itemsize = cnp.NPY_FLOAT64, 8
        else:
            raise ValueError(f"Plan supports float32 and float64 arrays (got {dtype})")
        if mode < 0 or mode > 3:
            raise ValueError(f"mode must be 0..3 (got {mode})")
        self.mode = mode
        self.buftype = _buffer_type(mode, self.typenum)
        self.bufsize = (self.itemsize, 2, 2, 4)[mode]
        self.n = len(shapes)
        for s in shapes:
            nd_total += len(s)
        self.offsets = <Py_ssize_t*>PyMem_Malloc((self.n + 1) * sizeof(Py_ssize_t))
        self.ndims = <int*>PyMem_Malloc((self.n + 1) * sizeof(int))
        self.dim_start = <Py_ssize_t*>PyMem_Malloc((self.n + 1) * sizeof(Py_ssize_t))
        self.dims = <Py_ssize_t*>PyMem_Malloc((nd_total + 1) * sizeof(Py_ssize_t))
        self.ptrs = <void**>PyMem_Malloc((self.n + 1) * sizeof(void*))
        if not (self.offsets and self.ndims and self.dim_start and self.dims and self.ptrs):
            raise MemoryError()
        self.offsets[0] = 0
        nd_total = 0
        for k in range(self.n):
            s = shapes[k]
            size = 1
            self.ndims[k] = len(s)
            self.dim_start[k] = nd_total
            for d in range(len(s)):
                self.dims[nd_total] = s[d]
                size *= s[d]
                nd_total += 1
            self.offsets[k + 1] = self.offsets[k] + size
        self.total = self.offsets[self.n]

    def __dealloc__(self):
        PyMem_Free(self.offsets)
        PyMem_Free(self.ndims)
        PyMem_Free(self.dim_start)
        PyMem_Free(self.dims)
        PyMem_Free(self.ptrs)

    cdef bint _gather(self, list arrays, bint writable):
        """Fill the pointer table; False when some array is not a matching plain ndarray."""
        cdef Py_ssize_t k, d
        cdef int flags, need = cnp.NPY_ARRAY_C_CONTIGUOUS | cnp.NPY_ARRAY_ALIGNED
        cdef object obj
        cdef cnp.ndarray a
        cdef cnp.npy_intp* shape
        if writable:
            need |= cnp.NPY_ARRAY_WRITEABLE
        if len(arrays) != self.n:
            return False
        for k in range(self.n):
            obj = arrays[k]
            if type(obj) is not cnp.ndarray:
                return False
            a = <cnp.ndarray>obj
            flags = cnp.PyArray_FLAGS(a)
            if (cnp.PyArray_TYPE(a) != self.typenum or (flags & need) != need
                    or not cnp.PyArray_ISNOTSWAPPED(a) or cnp.PyArray_NDIM(a) != self.ndims[k]):
                return False
            shape = cnp.PyArray_DIMS(a)
            for d in range(self.ndims[k]):
                if shape[d] != self.dims[self.dim_start[k] + d]:
                    return False
            self.ptrs[k] = cnp.PyArray_DATA(a)
        return True

    cdef char* _buffer(self, object buf, bint writable):
        cdef int flags, need = cnp.NPY_ARRAY_C_CONTIGUOUS | cnp.NPY_ARRAY_ALIGNED
        cdef cnp.ndarray b
        if writable:
            need |= cnp.NPY_ARRAY_WRITEABLE
        if type(buf) is not cnp.ndarray:
            return NULL
        b = <cnp.ndarray>buf
        flags = cnp.PyArray_FLAGS(b)
        if (cnp.PyArray_TYPE(b) != self.buftype or (flags & need) != need
                or not cnp.PyArray_ISNOTSWAPPED(b) or cnp.PyArray_SIZE(b) < self.total):
            return NULL
        return <char*>cnp.PyArray_DATA(b)

    def pack(self, list arrays, buf, double qscale=1.0):
        """Cast-copy ``arrays`` into ``buf`` (``qscale``: INT32 only); False if they do not qualify."""
        cdef char* dst = self._buffer(buf, True)
        cdef Py_ssize_t k, n, bsize = self.bufsize
        cdef bint stream = self.mode == 0 and self.total * self.itemsize >= _STREAM_BYTES
        if dst == NULL or not self._gather(arrays, False):
            return False
        with nogil:
            for k in range(self.n):
                n = self.offsets[k + 1] - self.offsets[k]
                if n == 0:
                    continue
                if self.typenum == cnp.NPY_FLOAT32:
                    _pack_one(self.mode, <const float*>self.ptrs[k], dst + self.offsets[k] * bsize, n, qscale,
                              stream)
                else:
                    _pack_one(self.mode, <const double*>self.ptrs[k], dst + self.offsets[k] * bsize, n, qscale,
                              stream)
            if stream:
                hpcdl_stream_fence()
        return True

    def unpack(self, buf, list arrays, double scale=1.0):
        """Copy ``buf`` back into ``arrays`` times ``scale`` (INT32: the multiplier); False if
        they do not qualify."""
        cdef char* src = self._buffer(buf, False)
        cdef Py_ssize_t k, n, bsize = self.bufsize
        cdef bint stream = self.mode == 0 and self.total * self.itemsize >= _STREAM_BYTES
        if src == NULL or not self._gather(arrays, True):
            return False
        with nogil:
            for k in range(self.n):
                n = self.offsets[k + 1] - self.offsets[k]
                if n == 0:
                    continue
                if self.typenum == cnp.NPY_FLOAT32:
                    _unpack_one(self.mode, src + self.offsets[k] * bsize, <float*>self.ptrs[k], n, scale,
                                stream)
                else:
                    _unpack_one(self.mode, src + self.offsets[k] * bsize, <double*>self.ptrs[k], n, scale,
                                stream)
            if stream:
                hpcdl_stream_fence()
        return True

    def maxabs(self, list arrays):
        """max |x| over all arrays (0 when empty, NaN if any is NaN); None if they do not qualify."""
        cdef Py_ssize_t k, n
        cdef double m = 0.0, v
        if not self._gather(arrays, False):
            return None
        with nogil:
            for k in range(self.n):
                n = self.offsets[k + 1] - self.offsets[k]
                if self.typenum == cnp.NPY_FLOAT32:
                    v = _maxabs(<const float*>self.ptrs[k], n)
                else:
                    v = _maxabs(<const double*>self.ptrs[k], n)
                if v != v or v > m:
                    m = v
                    if m != m:
                        break
        return m


# -- list and memoryview entry points -----------------------------------------------------

cdef inline Py_ssize_t _check(Py_ssize_t n_arrays, Py_ssize_t n_offsets, Py_ssize_t buf_len,
                              const Py_ssize_t[::1] offsets) except -1:
    if n_offsets != n_arrays + 1:
        raise ValueError(
            f"offsets must have len(arrays) + 1 entries ({n_offsets} != {n_arrays} + 1)"
        )
    if buf_len < offsets[n_arrays]:
        raise ValueError(
            f"buffer too small for the packed arrays ({buf_len} < {offsets[n_arrays]} elements)"
        )
    return 0


def pack(list arrays, floating[::1] buf, const Py_ssize_t[::1] offsets):
    """Copy ``arrays[i]`` into ``buf[offsets[i]:offsets[i + 1]]`` for every ``i``.

    Args:
        arrays: contiguous 1-D arrays of the buffer's dtype.
        buf: the contiguous 1-D destination buffer.
        offsets: prefix sum of the sizes, ``len(arrays) + 1`` entries.

    Raises:
        ValueError: an array's size does not match its offsets, or ``buf`` is too small.
    """
    cdef Py_ssize_t n_arrays = len(arrays)
    cdef Py_ssize_t i, n, off
    cdef const floating[::1] src
    _check(n_arrays, offsets.shape[0], buf.shape[0], offsets)
    for i in range(n_arrays):
        src = arrays[i]
        off = offsets[i]
        n = offsets[i + 1] - off
        if src.shape[0] != n:
            raise ValueError(f"array {i} has {src.shape[0]} elements, its slot {n}")
        if n == 0:
            continue
        with nogil:
            memcpy(&buf[off], &src[0], <size_t>n * sizeof(floating))


def unpack(const floating[::1] buf, list arrays, const Py_ssize_t[::1] offsets, double scale=1.0):
    """Copy ``buf[offsets[i]:offsets[i + 1]] * scale`` into ``arrays[i]`` for every ``i``.

    The product is computed in the buffer's dtype (``scale`` is first rounded to it), as
    NumPy does for ``buf[a:b] * scale`` with a Python float.

    Raises:
        ValueError: an array's size does not match its offsets, or ``buf`` is too small.
    """
    cdef Py_ssize_t n_arrays = len(arrays)
    cdef Py_ssize_t i, n, off
    cdef floating[::1] dst
    _check(n_arrays, offsets.shape[0], buf.shape[0], offsets)
    for i in range(n_arrays):
        dst = arrays[i]
        off = offsets[i]
        n = offsets[i + 1] - off
        if dst.shape[0] != n:
            raise ValueError(f"array {i} has {dst.shape[0]} elements, its slot {n}")
        if n == 0:
            continue
        with nogil:
            _unpack_one(0, <const char*>&buf[off], &dst[0], n, scale)


cdef inline int _same(Py_ssize_t a, Py_ssize_t b) except -1:
    if a != b:
        raise ValueError(f"source and output differ in size ({a} != {b})")
    return 0


def simd_paths():
    """Which vector paths run here: ``{"float16": F16C, "bfloat16": AVX2}`` (True when used).

    The element-wise kernels take ``simd=False`` to run the software routines instead.
    """
    return {"float16": bool(_F16C), "bfloat16": bool(_AVX2)}


def to_float16(const floating[::1] src, uint16_t[::1] out, bint simd=True):
    """``out[:] = src.astype(float16)`` as ``uint16`` bits (round to nearest even)."""
    _same(src.shape[0], out.shape[0])
    if src.shape[0]:
        with nogil:
            _to_f16(&src[0], &out[0], src.shape[0], simd)


def from_float16(const uint16_t[::1] src, floating[::1] out, double scale=1.0, bint simd=True):
    """``out[:] = half(src) * scale``, the product in ``out``'s dtype."""
    _same(src.shape[0], out.shape[0])
    if src.shape[0]:
        with nogil:
            _from_f16(&src[0], &out[0], src.shape[0], <floating>scale, simd)


def to_bfloat16(const floating[::1] src, uint16_t[::1] out, bint simd=True):
    """bfloat16 bits of ``src`` (round to nearest even; float64 is first rounded to float32)."""
    _same(src.shape[0], out.shape[0])
    if src.shape[0]:
        with nogil:
            _to_bf16(&src[0], &out[0], src.shape[0], simd)


def from_bfloat16(const uint16_t[::1] src, floating[::1] out, double scale=1.0):
    """``out[:] = bfloat16(src) * scale``, the product in ``out``'s dtype."""
    _same(src.shape[0], out.shape[0])
    if src.shape[0]:
        with nogil:
            _from_bf16(&src[0], &out[0], src.shape[0], <floating>scale)


def quantize(const floating[::1] src, int32_t[::1] out, double qscale):
    """``out = rint(src * qscale)`` in float64, saturated to ``±(2**31 - 1)``, NaN to 0."""
    _same(src.shape[0], out.shape[0])
    if src.shape[0]:
        with nogil:
            _quantize(&src[0], &out[0], src.shape[0], qscale)


def dequantize(const int32_t[::1] src, floating[::1] out, double mult):
    """``out = src * mult`` computed in float64, rounded to ``out``'s dtype."""
    _same(src.shape[0], out.shape[0])
    if src.shape[0]:
        with nogil:
            _dequantize(&src[0], &out[0], src.shape[0], mult)


def maxabs(const floating[::1] src):
    """max |src| (0.0 when empty, NaN when any element is NaN)."""
    cdef double m = 0.0
    if src.shape[0]:
        with nogil:
            m = _maxabs(&src[0], src.shape[0])
    return m
