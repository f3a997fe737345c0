# cython: boundscheck=False, wraparound=False, cdivision=True, language_level=3
"""Pack many contiguous 1-D arrays into one buffer at given offsets, and unpack with a scale.

``offsets`` is the prefix sum of the sizes (``len(arrays) + 1`` entries, ``offsets[0] == 0``):
array ``i`` occupies ``buf[offsets[i]:offsets[i + 1]]``. The arrays and the buffer share
one dtype (float32 or float64: Cython's fused type ``cython.floating``). The copies run
without the GIL: ``memcpy`` for packing, a loop for the scaled unpack.
"""

from cython cimport floating
from libc.string cimport memcpy


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

    Args:
        buf: the contiguous 1-D source buffer.
        arrays: writable contiguous 1-D arrays of the buffer's dtype.
        offsets: prefix sum of the sizes, ``len(arrays) + 1`` entries.
        scale: factor applied while copying (``1.0``: a plain copy).

    Raises:
        ValueError: an array's size does not match its offsets, or ``buf`` is too small.
    """
    cdef Py_ssize_t n_arrays = len(arrays)
    cdef Py_ssize_t i, j, n, off
    cdef floating s = <floating>scale
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
            if scale == 1.0:
                memcpy(&dst[0], &buf[off], <size_t>n * sizeof(floating))
            else:
                for j in range(n):
                    dst[j] = buf[off + j] * s
