# cython: boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False, language_level=3
"""Convolution windows as rows and back, on C-contiguous float32/float64 arrays, padding folded in.

``im2row`` copies the windows of ``x`` (N, C, H, W) into ``rows`` (N*Ho*Wo, C*kh*kw): one row
per output pixel, its columns in (channel, kernel row, kernel column) order, zeros where a
window reaches into the padding — no padded copy of ``x`` is made. ``row2im`` is its adjoint:
it sums each row back onto the windows of an unpadded ``gx`` (N, C, H, W), overwriting it,
contributions that fall on the padding dropped. Each pixel's contributions are added in
kernel-offset order (kernel row, then column, ascending), the order of the NumPy reference
``hpcdl.nn.conv.col2im``, so that the two agree bit for bit. ``rows_to_nchw`` transposes a
GEMM's (N*Ho*Wo, O) product to (N, O, Ho*Wo) in cache-sized tiles.

Every loop runs without the GIL on fused ``cython.floating`` types; shapes are checked here
(``ValueError`` naming them) and the caller's array module decides when to call.
"""

from cython cimport floating
from libc.string cimport memset


cdef inline Py_ssize_t _out(Py_ssize_t size, Py_ssize_t k, Py_ssize_t s, Py_ssize_t p) noexcept nogil:
    return (size + 2 * p - k) // s + 1


def _geometry(Py_ssize_t n, Py_ssize_t c, Py_ssize_t h, Py_ssize_t w, Py_ssize_t r, Py_ssize_t q,
              int kh, int kw, int sh, int sw, int ph, int pw):
    """``(Ho, Wo)``, after checking the window and the rows' shape ``(r, q)``."""
    if kh < 1 or kw < 1 or sh < 1 or sw < 1 or ph < 0 or pw < 0:
        raise ValueError(f"kernel and stride must be >= 1 and padding >= 0 "
                         f"(got ({kh}, {kw}), ({sh}, {sw}), ({ph}, {pw}))")
    cdef Py_ssize_t ho = _out(h, kh, sh, ph), wo = _out(w, kw, sw, pw)
    if ho < 1 or wo < 1:
        raise ValueError(f"input {h}x{w} padded by ({ph}, {pw}) is smaller than the kernel {kh}x{kw}")
    if r != n * ho * wo or q != c * kh * kw:
        raise ValueError(f"rows are ({r}, {q}), expected (N*Ho*Wo, C*kh*kw) = ({n * ho * wo}, {c * kh * kw})")
    return ho, wo


# Both kernels walk one output row (b, oy) at a time, in tiles of CT channels: for each
# output column, the tile's CT windows. A tile's CT * kh input rows and the row block's
# destination lines stay in L1, and the destination is written in runs of CT * kh * kw.
# Walking all C channels for each pixel instead reads C lines 4 KiB apart when
# H * W * itemsize is 4 KiB (32x32 float32), which share a few L1 sets: several times slower;
# one channel at a time writes runs of only kh * kw (a single element for 1x1 kernels).
DEF CT = 8


cdef inline void _window(const floating* s, floating* dst, Py_ssize_t hw, Py_ssize_t w,
                         Py_ssize_t kh, Py_ssize_t kw, Py_ssize_t ct) noexcept nogil:
    """``dst[ch, i, j] = s[ch * hw + i * w + j]`` for ``ch < ct``: windows inside the image."""
    cdef Py_ssize_t ch, i, j
    cdef const floating* t
    if kh == 3 and kw == 3:
        for ch in range(ct):
            t = s + ch * hw
            dst[0] = t[0]; dst[1] = t[1]; dst[2] = t[2]
            dst[3] = t[w]; dst[4] = t[w + 1]; dst[5] = t[w + 2]
            dst[6] = t[2 * w]; dst[7] = t[2 * w + 1]; dst[8] = t[2 * w + 2]
            dst += 9
    elif kh == 1 and kw == 1:
        for ch in range(ct):
            dst[ch] = s[ch * hw]
    else:
        for ch in range(ct):
            t = s + ch * hw
            for i in range(kh):
                for j in range(kw):
                    dst[j] = t[j]
                dst += kw
                t += w


cdef void _im2row(const floating* x, floating* rows, Py_ssize_t n, Py_ssize_t c, Py_ssize_t h,
                  Py_ssize_t w, Py_ssize_t kh, Py_ssize_t kw, Py_ssize_t sh, Py_ssize_t sw,
                  Py_ssize_t ph, Py_ssize_t pw, Py_ssize_t ho, Py_ssize_t wo) noexcept nogil:
    cdef Py_ssize_t b, oy, ox, c0, ct, ch, i, j, iy, ix, iy0, ix0
    cdef Py_ssize_t hw = h * w, kk = kh * kw, q = c * kk
    cdef bint rows_inside
    cdef const floating* s
    cdef floating* block
    cdef floating* dst
    for b in range(n):
        for oy in range(ho):
            iy0 = oy * sh - ph
            rows_inside = iy0 >= 0 and iy0 + kh <= h
            block = rows + (b * ho + oy) * wo * q  # this output row's wo rows
            for c0 in range(0, c, CT):
                ct = min(CT, c - c0)
                s = x + (b * c + c0) * hw
                dst = block + c0 * kk
                for ox in range(wo):
                    ix0 = ox * sw - pw
                    if rows_inside and ix0 >= 0 and ix0 + kw <= w:
                        _window(s + iy0 * w + ix0, dst, hw, w, kh, kw, ct)
                    else:  # the window reaches into the padding
                        for ch in range(ct):
                            for i in range(kh):
                                iy = iy0 + i
                                for j in range(kw):
                                    ix = ix0 + j
                                    dst[(ch * kh + i) * kw + j] = (
                                        s[(ch * h + iy) * w + ix] if 0 <= iy < h and 0 <= ix < w else 0)
                    dst += q


cdef inline void _add_window(const floating* src, floating* t, Py_ssize_t hw, Py_ssize_t w,
                             Py_ssize_t kh, Py_ssize_t kw, Py_ssize_t ct) noexcept nogil:
    """``t[ch * hw + i * w + j] += src[ch, i, j]`` for ``ch < ct``: windows inside the image."""
    cdef Py_ssize_t ch, i, j
    cdef floating* u
    if kh == 3 and kw == 3:
        for ch in range(ct):
            u = t + ch * hw
            u[0] += src[0]; u[1] += src[1]; u[2] += src[2]
            u[w] += src[3]; u[w + 1] += src[4]; u[w + 2] += src[5]
            u[2 * w] += src[6]; u[2 * w + 1] += src[7]; u[2 * w + 2] += src[8]
            src += 9
    elif kh == 1 and kw == 1:
        for ch in range(ct):
            t[ch * hw] += src[ch]
    else:
        for ch in range(ct):
            u = t + ch * hw
            for i in range(kh):
                for j in range(kw):
                    u[j] += src[j]
                src += kw
                u += w


cdef void _row2im(const floating* rows, floating* gx, Py_ssize_t n, Py_ssize_t c, Py_ssize_t h,
                  Py_ssize_t w, Py_ssize_t kh, Py_ssize_t kw, Py_ssize_t sh, Py_ssize_t sw,
                  Py_ssize_t ph, Py_ssize_t pw, Py_ssize_t ho, Py_ssize_t wo) noexcept nogil:
    # Output rows and columns in descending order: a pixel of gx then receives its
    # contributions in ascending kernel offset (i, then j), as the reference's one pass per
    # offset adds them (channels are independent, so their order is free).
    cdef Py_ssize_t b, oy, ox, c0, ct, ch, i, j, iy, ix, iy0, ix0
    cdef Py_ssize_t hw = h * w, kk = kh * kw, q = c * kk
    cdef bint rows_inside
    cdef const floating* src
    cdef floating* g
    memset(gx, 0, n * c * hw * sizeof(floating))
    for b in range(n):
        for oy in range(ho - 1, -1, -1):
            iy0 = oy * sh - ph
            rows_inside = iy0 >= 0 and iy0 + kh <= h
            for c0 in range(0, c, CT):
                ct = min(CT, c - c0)
                g = gx + (b * c + c0) * hw
                for ox in range(wo - 1, -1, -1):
                    ix0 = ox * sw - pw
                    src = rows + ((b * ho + oy) * wo + ox) * q + c0 * kk
                    if rows_inside and ix0 >= 0 and ix0 + kw <= w:
                        _add_window(src, g + iy0 * w + ix0, hw, w, kh, kw, ct)
                    else:  # the part of the window on the padding is dropped
                        for ch in range(ct):
                            for i in range(kh):
                                iy = iy0 + i
                                if 0 <= iy < h:
                                    for j in range(kw):
                                        ix = ix0 + j
                                        if 0 <= ix < w:
                                            g[(ch * h + iy) * w + ix] += src[(ch * kh + i) * kw + j]


def im2row(const floating[:, :, :, ::1] x, floating[:, ::1] rows, int kh, int kw, int sh, int sw,
           int ph, int pw):
    """Write the windows of ``x`` (N, C, H, W) into ``rows`` (N*Ho*Wo, C*kh*kw).

    Args:
        x: the unpadded input.
        rows: the output, every element written.
        kh, kw: the kernel.
        sh, sw: the stride.
        ph, pw: zero padding on each side.

    Raises:
        ValueError: the window does not fit or ``rows`` has another shape.
    """
    cdef Py_ssize_t n = x.shape[0], c = x.shape[1], h = x.shape[2], w = x.shape[3], ho, wo
    ho, wo = _geometry(n, c, h, w, rows.shape[0], rows.shape[1], kh, kw, sh, sw, ph, pw)
    if rows.shape[0] == 0 or rows.shape[1] == 0:
        return
    with nogil:
        _im2row(&x[0, 0, 0, 0], &rows[0, 0], n, c, h, w, kh, kw, sh, sw, ph, pw, ho, wo)


def row2im(const floating[:, ::1] rows, floating[:, :, :, ::1] gx, int kh, int kw, int sh, int sw,
           int ph, int pw):
    """Overwrite ``gx`` (N, C, H, W) with the adjoint of :func:`im2row` applied to ``rows``.

    Args:
        rows: gradients of the windows, (N*Ho*Wo, C*kh*kw).
        gx: the output, the gradient of the unpadded input.
        kh, kw: the kernel.
        sh, sw: the stride.
        ph, pw: zero padding on each side.

    Raises:
        ValueError: the window does not fit or ``rows`` has another shape.
    """
    cdef Py_ssize_t n = gx.shape[0], c = gx.shape[1], h = gx.shape[2], w = gx.shape[3], ho, wo
    ho, wo = _geometry(n, c, h, w, rows.shape[0], rows.shape[1], kh, kw, sh, sw, ph, pw)
    if n * c * h * w == 0:
        return
    with nogil:
        _row2im(&rows[0, 0], &gx[0, 0, 0, 0], n, c, h, w, kh, kw, sh, sw, ph, pw, ho, wo)


cdef void _transpose(const floating* src, floating* dst, Py_ssize_t n, Py_ssize_t p,
                     Py_ssize_t o) noexcept nogil:
    # dst[b, k, t] = src[b, t, k], in 32 x 32 tiles (4 KiB of float32 read and written)
    cdef Py_ssize_t b, t0, k0, t, k, t1, k1
    cdef const floating* s
    cdef floating* d
    for b in range(n):
        s = src + b * p * o
        d = dst + b * p * o
        for k0 in range(0, o, 32):
            k1 = min(k0 + 32, o)
            for t0 in range(0, p, 32):
                t1 = min(t0 + 32, p)
                for k in range(k0, k1):
                    for t in range(t0, t1):
                        d[k * p + t] = s[t * o + k]


def rows_to_nchw(const floating[:, :, ::1] src, floating[:, :, ::1] dst):
    """``dst[b, k, t] = src[b, t, k]``: a (N*Ho*Wo, O) product as (N, O, Ho*Wo).

    Raises:
        ValueError: the shapes are not (N, P, O) and (N, O, P).
    """
    cdef Py_ssize_t n = src.shape[0], p = src.shape[1], o = src.shape[2]
    if dst.shape[0] != n or dst.shape[1] != o or dst.shape[2] != p:
        raise ValueError(f"rows_to_nchw: ({dst.shape[0]}, {dst.shape[1]}, {dst.shape[2]}) is not "
                         f"the transpose of ({n}, {p}, {o})")
    if n * p * o == 0:
        return
    with nogil:
        _transpose(&src[0, 0, 0], &dst[0, 0, 0], n, p, o)
