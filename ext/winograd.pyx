# cython: boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False, language_level=3
"""Winograd F(2x2, 3x3) input and output transforms, on C-contiguous float32/float64 arrays.

``input_transform`` cuts ``x`` (N, C, H, W), zero-padded by ``p`` (no padded copy: each
tile row's four input rows are copied into a padded line), into 4x4 tiles two pixels apart
and writes ``V = Bᵀ d B`` of each to ``v`` (16, C, N*th*tw). ``output_transform`` writes
``Y = Aᵀ M A`` of each tile of ``m`` (16, O, N*th*tw), plus the bias, to ``y`` (N, O, Ho, Wo),
dropping a partial last tile's extra row or column. One pass each, where the array-module
reference (``hpcdl.nn.winograd``) makes several; the additions are the reference's, in its
order, so the two agree bit for bit.
"""

from cython cimport floating
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy, memset


def _check_planes(Py_ssize_t row, Py_ssize_t item, Py_ssize_t rows, Py_ssize_t cols, Py_ssize_t itemsize):
    """The planes ξ of a (16, rows, cols) array must each be C-contiguous (they may be apart).

    The stride of an axis of length 1 is never used (NumPy may give it any value).
    """
    if (cols > 1 and item != itemsize) or (rows > 1 and row != cols * itemsize):
        raise ValueError(f"planes are not C-contiguous (strides ({row}, {item}) bytes, {cols} columns)")


def input_transform(const floating[:, :, :, ::1] x, floating[:, :, :] v, int padding, Py_ssize_t th,
                    Py_ssize_t tw):
    """``v`` (16, C, N*th*tw) = ``Bᵀ d B`` of every 4x4 tile of ``x`` (N, C, H, W) padded by ``padding``."""
    cdef Py_ssize_t n = x.shape[0], c = x.shape[1], h = x.shape[2], w = x.shape[3]
    cdef Py_ssize_t t = th * tw, wq = 2 * tw + 2
    if v.shape[0] != 16 or v.shape[1] != c or v.shape[2] != n * t:
        raise ValueError(f"v is {tuple(v.shape)[:3]}, expected (16, C, N*th*tw) = (16, {c}, {n * t})")
    _check_planes(v.strides[1], v.strides[2], v.shape[1], v.shape[2], sizeof(floating))
    if padding < 0 or 2 * th + 2 < h + 2 * padding or 2 * tw + 2 < w + 2 * padding:
        raise ValueError(f"{th}x{tw} tiles do not cover a {h}x{w} input padded by {padding}")
    # a tile row's four padded input rows, then its d B (16 rows of tw: row i's column k at 4 i + k)
    cdef floating* line = <floating*> malloc((4 * wq + 16 * tw) * sizeof(floating))
    if line == NULL:
        raise MemoryError()
    cdef floating* col = line + 4 * wq
    cdef Py_ssize_t b, ch, ty, tx, i, iy, x0, x1, k, stride = v.strides[0] // sizeof(floating)  # between planes ξ
    cdef floating* vp
    cdef const floating* r
    cdef floating* q
    x0 = min(padding, wq)  # the image's columns in the line: [x0, x1)
    x1 = max(x0, min(padding + w, wq))
    # every loop over tx below is a plain vector loop (the compiler's); the same additions as
    # the reference, in its order
    with nogil:
        for ch in range(c):
            for b in range(n):
                for ty in range(th):
                    for i in range(4):
                        iy = 2 * ty + i - padding
                        q = line + i * wq
                        if iy < 0 or iy >= h:
                            memset(q, 0, wq * sizeof(floating))
                        else:
                            memset(q, 0, x0 * sizeof(floating))
                            memcpy(q + x0, &x[b, ch, iy, 0], (x1 - x0) * sizeof(floating))
                            memset(q + x1, 0, (wq - x1) * sizeof(floating))
                    for i in range(4):  # d B along the columns
                        r = line + i * wq
                        q = col + 4 * i * tw
                        for tx in range(tw):
                            q[tx] = r[2 * tx] - r[2 * tx + 2]
                        for tx in range(tw):
                            q[tw + tx] = r[2 * tx + 1] + r[2 * tx + 2]
                        for tx in range(tw):
                            q[2 * tw + tx] = r[2 * tx + 2] - r[2 * tx + 1]
                        for tx in range(tw):
                            q[3 * tw + tx] = r[2 * tx + 1] - r[2 * tx + 3]
                    vp = &v[0, ch, (b * th + ty) * tw]
                    for k in range(4):  # Bᵀ (d B) along the rows: ξ = 4 i + k
                        _rows(vp + k * stride, col + k * tw, col + (4 + k) * tw, col + (8 + k) * tw,
                              col + (12 + k) * tw, tw, stride)
    free(line)


cdef inline void _rows(floating* vp, const floating* a0, const floating* a1, const floating* a2,
                       const floating* a3, Py_ssize_t tw, Py_ssize_t stride) noexcept nogil:
    """Bᵀ along the rows for one column k: ξ = k, 4 + k, 8 + k, 12 + k, ``stride`` apart."""
    cdef Py_ssize_t tx
    for tx in range(tw):
        vp[tx] = a0[tx] - a2[tx]
    vp += 4 * stride
    for tx in range(tw):
        vp[tx] = a1[tx] + a2[tx]
    vp += 4 * stride
    for tx in range(tw):
        vp[tx] = a2[tx] - a1[tx]
    vp += 4 * stride
    for tx in range(tw):
        vp[tx] = a1[tx] - a3[tx]


def output_transform(const floating[:, :, :] m, floating[:, :, :, ::1] y, const floating[::1] bias,
                     bint with_bias):
    """``y`` (N, O, Ho, Wo) = ``Aᵀ M A`` of every tile of ``m`` (16, O, N*th*tw), plus ``bias`` when ``with_bias``."""
    cdef Py_ssize_t n = y.shape[0], o = y.shape[1], ho = y.shape[2], wo = y.shape[3]
    cdef Py_ssize_t th = (ho + 1) // 2, tw = (wo + 1) // 2, t = th * tw
    if m.shape[0] != 16 or m.shape[1] != o or m.shape[2] != n * t:
        raise ValueError(f"m is {tuple(m.shape)[:3]}, expected (16, O, N*th*tw) = (16, {o}, {n * t})")
    _check_planes(m.strides[1], m.strides[2], m.shape[1], m.shape[2], sizeof(floating))
    if with_bias and bias.shape[0] != o:
        raise ValueError(f"bias has {bias.shape[0]} elements, expected {o}")
    # one tile row's M A (8 rows of tw: row i's column b at 2 i + b), then its 2 x 2tw outputs
    cdef floating* sa = <floating*> malloc((8 * tw + 4 * tw) * sizeof(floating))
    if sa == NULL:
        raise MemoryError()
    cdef floating* out = sa + 8 * tw
    cdef Py_ssize_t b, oc, ty, tx, i, rows, stride = m.strides[0] // sizeof(floating)  # between planes ξ
    cdef const floating* mp
    cdef const floating* m0
    cdef floating* q
    cdef floating bv
    with nogil:
        for b in range(n):
            for oc in range(o):
                bv = bias[oc] if with_bias else 0
                for ty in range(th):
                    mp = &m[0, oc, (b * th + ty) * tw]
                    for i in range(4):  # M A along the columns
                        m0 = mp + 4 * i * stride
                        q = sa + 2 * i * tw
                        for tx in range(tw):
                            q[tx] = (m0[tx] + m0[stride + tx]) + m0[2 * stride + tx]
                        for tx in range(tw):
                            q[tw + tx] = (m0[stride + tx] - m0[2 * stride + tx]) - m0[3 * stride + tx]
                    for tx in range(tw):  # Aᵀ (M A) along the rows, columns interleaved
                        out[2 * tx] = (sa[tx] + sa[2 * tw + tx]) + sa[4 * tw + tx]
                        out[2 * tx + 1] = (sa[tw + tx] + sa[3 * tw + tx]) + sa[5 * tw + tx]
                        out[2 * tw + 2 * tx] = (sa[2 * tw + tx] - sa[4 * tw + tx]) - sa[6 * tw + tx]
                        out[2 * tw + 2 * tx + 1] = (sa[3 * tw + tx] - sa[5 * tw + tx]) - sa[7 * tw + tx]
                    if with_bias:
                        for tx in range(4 * tw):
                            out[tx] = out[tx] + bv
                    rows = 2 if 2 * ty + 1 < ho else 1  # a partial last tile row
                    for i in range(rows):
                        memcpy(&y[b, oc, 2 * ty + i, 0], out + 2 * tw * i, wo * sizeof(floating))
    free(sa)


def filter_transform(const floating[:, :, :, ::1] w, floating[:, :, :] u):
    """``u`` (16, O, C) = ``G g Gᵀ`` of every 3x3 filter ``g`` of ``w`` (O, C, 3, 3)."""
    cdef Py_ssize_t o = w.shape[0], c = w.shape[1], oc, ch, i, stride = u.strides[0] // sizeof(floating)
    if w.shape[2] != 3 or w.shape[3] != 3:
        raise ValueError(f"w is {tuple(w.shape)[:4]}, expected (O, C, 3, 3)")
    if u.shape[0] != 16 or u.shape[1] != o or u.shape[2] != c:
        raise ValueError(f"u is {tuple(u.shape)[:3]}, expected (16, O, C) = (16, {o}, {c})")
    _check_planes(u.strides[1], u.strides[2], u.shape[1], u.shape[2], sizeof(floating))
    cdef const floating* g
    cdef floating* up
    cdef floating r[4][3]
    cdef floating s
    with nogil:
        for oc in range(o):
            for ch in range(c):
                g = &w[oc, ch, 0, 0]
                for i in range(3):  # G g along the rows (the reference's additions, in its order)
                    s = g[i] + g[6 + i]
                    r[0][i] = g[i]
                    r[1][i] = (s + g[3 + i]) * 0.5
                    r[2][i] = (s - g[3 + i]) * 0.5
                    r[3][i] = g[6 + i]
                up = &u[0, oc, ch]
                for i in range(4):  # (G g) Gᵀ along the columns: ξ = 4 i + j
                    s = r[i][0] + r[i][2]
                    up[(4 * i) * stride] = r[i][0]
                    up[(4 * i + 1) * stride] = (s + r[i][1]) * 0.5
                    up[(4 * i + 2) * stride] = (s - r[i][1]) * 0.5
                    up[(4 * i + 3) * stride] = r[i][2]
