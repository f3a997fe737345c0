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
from libc.string cimport memcpy, memset

cdef extern from "conv.h" nogil:
    void hpcdl_add3_f32(float* u, const float* s)
    void hpcdl_add3_f64(double* u, const double* s)


cdef inline void _add3(floating* u, const floating* s) noexcept nogil:
    """``u[0..2] += s[0..2]`` four wide (``s[3]`` read, ``u[3]`` rewritten unchanged)."""
    if floating is float:
        hpcdl_add3_f32(u, s)
    else:
        hpcdl_add3_f64(u, s)


cdef inline Py_ssize_t _out(Py_ssize_t size, Py_ssize_t k, Py_ssize_t s, Py_ssize_t p) noexcept nogil:
    # 0 when the kernel is larger than the padded input (C division truncates towards zero)
    return (size + 2 * p - k) // s + 1 if size + 2 * p >= k else 0


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


# Both kernels walk one output row (b, oy) at a time, in tiles of channels: for each output
# column, the tile's windows. A tile holds about TILE_BYTES of input rows (at least 8
# channels, fewer than would alias in L1): its kh input rows per channel and the row block's
# destination lines stay in L1,
# and the destination is written in runs of (tile channels) * kh * kw. Walking all C channels
# for each pixel instead reads C lines 4 KiB apart when H * W * itemsize is 4 KiB (32x32
# float32), which share a few L1 sets: several times slower; one channel at a time writes runs
# of only kh * kw (a single element for 1x1 kernels) and pays a row's bookkeeping per channel.
# The columns of a row split into runs: windows reaching into the left padding, windows
# inside the image (a tight loop per kernel shape), windows reaching into the right padding.
DEF TILE_BYTES = 3072


cdef Py_ssize_t _gcd(Py_ssize_t a, Py_ssize_t b) noexcept nogil:
    while b:
        a, b = b, a % b
    return a


cdef struct Geometry:
    Py_ssize_t c, h, w, hw, kh, kw, kk, q, sh, sw, ph, pw, ho, wo
    Py_ssize_t tile  # channels per tile
    Py_ssize_t lo    # first column whose window starts inside the image
    Py_ssize_t hi    # columns below this end inside the image
    Py_ssize_t wide  # columns below this (and from lo) have a column of the image right of the window


cdef inline Py_ssize_t _clip(Py_ssize_t v, Py_ssize_t a, Py_ssize_t b) noexcept nogil:
    return a if v < a else (b if v > b else v)


cdef Geometry _plan(Py_ssize_t c, Py_ssize_t h, Py_ssize_t w, Py_ssize_t kh, Py_ssize_t kw,
                    Py_ssize_t sh, Py_ssize_t sw, Py_ssize_t ph, Py_ssize_t pw,
                    Py_ssize_t itemsize) noexcept nogil:
    cdef Geometry g
    g.tile = _clip(TILE_BYTES // (kh * w * itemsize), 8, c if c > 8 else 8)
    # channels h * w * itemsize apart fall into 4096 / gcd(4096, that) groups of L1 sets (one
    # when it is a multiple of 4 KiB): at most 8 lines (the associativity) per group
    g.tile = min(g.tile, 8 * (4096 // _gcd(4096, h * w * itemsize)))
    g.c, g.h, g.w, g.hw, g.kh, g.kw, g.kk, g.q = c, h, w, h * w, kh, kw, kh * kw, c * kh * kw
    g.sh, g.sw, g.ph, g.pw = sh, sw, ph, pw
    g.ho, g.wo = _out(h, kh, sh, ph), _out(w, kw, sw, pw)
    g.lo = _clip((pw + sw - 1) // sw, 0, g.wo)  # ox * sw - pw >= 0
    g.hi = _clip((w + pw - kw) // sw + 1 if w + pw >= kw else 0, g.lo, g.wo)  # ox * sw - pw + kw <= w
    g.wide = _clip((w + pw - kw - 1) // sw + 1 if w + pw > kw else 0, g.lo, g.hi)  # ... + kw < w
    return g


cdef void _border_window(const floating* s, floating* dst, const Geometry* g, Py_ssize_t iy0,
                         Py_ssize_t ix0, Py_ssize_t ct) noexcept nogil:
    """One tile's windows at (iy0, ix0) reaching into the padding: zeros there."""
    cdef Py_ssize_t ch, i, j, kh = g.kh, kw = g.kw, w = g.w
    cdef Py_ssize_t ilo = _clip(-iy0, 0, kh), ihi = _clip(g.h - iy0, ilo, kh)
    cdef Py_ssize_t jlo = _clip(-ix0, 0, kw), jhi = _clip(w - ix0, jlo, kw)
    cdef const floating* t
    memset(dst, 0, ct * g.kk * sizeof(floating))
    if kw == 3 and jlo <= 1 < jhi:  # 3 wide, the middle column in the image: unrolled
        for ch in range(ct):
            t = s + ch * g.hw + iy0 * w + ix0
            for i in range(ilo, ihi):
                if jlo == 0:
                    dst[i * 3] = t[i * w]
                dst[i * 3 + 1] = t[i * w + 1]
                if jhi == 3:
                    dst[i * 3 + 2] = t[i * w + 2]
            dst += g.kk
        return
    for ch in range(ct):
        t = s + ch * g.hw + iy0 * w + ix0
        for i in range(ilo, ihi):
            for j in range(jlo, jhi):
                dst[i * kw + j] = t[i * w + j]
        dst += g.kk


cdef inline void _inside_run(const floating* s, floating* dst, const Geometry* g, Py_ssize_t iy0,
                             Py_ssize_t ct, bint last) noexcept nogil:
    """One tile's windows of row iy0 in columns [lo, hi), all inside the image.

    3x3 windows left of ``wide`` move each kernel row four elements at a time (the fourth
    lands where the next store overwrites it), except the last kernel row of the image's last
    channel (``last``): its fourth element would land on the next row, already written.
    """
    cdef Py_ssize_t ox, ch, i, j, w = g.w, hw = g.hw, q = g.q, kw = g.kw, kh = g.kh
    cdef const floating* t
    cdef floating* d
    cdef Py_ssize_t full = ct - 1 if last else ct  # channels whose every row moves four wide
    s = s + iy0 * w - g.pw
    if kh == 3 and kw == 3:
        for ox in range(g.lo, g.hi):
            t = s + ox * g.sw
            d = dst + ox * q
            if ox < g.wide:
                for ch in range(full):
                    memcpy(d, t, 4 * sizeof(floating))
                    memcpy(d + 3, t + w, 4 * sizeof(floating))
                    memcpy(d + 6, t + 2 * w, 4 * sizeof(floating))
                    d += 9
                    t += hw
                if full < ct:
                    memcpy(d, t, 4 * sizeof(floating))
                    memcpy(d + 3, t + w, 4 * sizeof(floating))
                    d[6] = t[2 * w]; d[7] = t[2 * w + 1]; d[8] = t[2 * w + 2]
            else:
                for ch in range(ct):
                    d[0] = t[0]; d[1] = t[1]; d[2] = t[2]
                    d[3] = t[w]; d[4] = t[w + 1]; d[5] = t[w + 2]
                    d[6] = t[2 * w]; d[7] = t[2 * w + 1]; d[8] = t[2 * w + 2]
                    d += 9
                    t += hw
    elif kh == 1 and kw == 1:
        for ox in range(g.lo, g.hi):
            t = s + ox * g.sw
            d = dst + ox * q
            for ch in range(ct):
                d[ch] = t[ch * hw]
    else:
        for ox in range(g.lo, g.hi):
            t = s + ox * g.sw
            d = dst + ox * q
            for ch in range(ct):
                for i in range(kh):
                    for j in range(kw):
                        d[i * kw + j] = t[i * w + j]
                d += g.kk
                t += hw


cdef void _im2row(const floating* x, floating* rows, Py_ssize_t n, const Geometry* g) noexcept nogil:
    cdef Py_ssize_t b, oy, ox, c0, ct, iy0
    cdef const floating* s
    cdef floating* block
    for b in range(n):
        for oy in range(g.ho):
            iy0 = oy * g.sh - g.ph
            block = rows + (b * g.ho + oy) * g.wo * g.q  # this output row's wo rows
            c0 = 0
            while c0 < g.c:
                ct = min(g.tile, g.c - c0)
                s = x + (b * g.c + c0) * g.hw
                if iy0 >= 0 and iy0 + g.kh <= g.h:
                    for ox in range(g.lo):
                        _border_window(s, block + ox * g.q + c0 * g.kk, g, iy0, ox * g.sw - g.pw, ct)
                    _inside_run(s, block + c0 * g.kk, g, iy0, ct, c0 + ct == g.c)
                    for ox in range(g.hi, g.wo):
                        _border_window(s, block + ox * g.q + c0 * g.kk, g, iy0, ox * g.sw - g.pw, ct)
                else:
                    for ox in range(g.wo):
                        _border_window(s, block + ox * g.q + c0 * g.kk, g, iy0, ox * g.sw - g.pw, ct)
                c0 += ct


cdef void _add_border_window(const floating* src, floating* gb, const Geometry* g, Py_ssize_t iy0,
                             Py_ssize_t ix0, Py_ssize_t ct) noexcept nogil:
    """One tile's windows at (iy0, ix0) reaching into the padding: their part there dropped."""
    cdef Py_ssize_t ch, i, j, kh = g.kh, kw = g.kw, w = g.w
    cdef Py_ssize_t ilo = _clip(-iy0, 0, kh), ihi = _clip(g.h - iy0, ilo, kh)
    cdef Py_ssize_t jlo = _clip(-ix0, 0, kw), jhi = _clip(w - ix0, jlo, kw)
    cdef floating* u
    if kw == 3 and jlo <= 1 < jhi:  # 3 wide, the middle column in the image: unrolled
        for ch in range(ct):
            u = gb + ch * g.hw + iy0 * w + ix0
            for i in range(ilo, ihi):
                if jlo == 0:
                    u[i * w] += src[i * 3]
                u[i * w + 1] += src[i * 3 + 1]
                if jhi == 3:
                    u[i * w + 2] += src[i * 3 + 2]
            src += g.kk
        return
    for ch in range(ct):
        u = gb + ch * g.hw + iy0 * w + ix0
        for i in range(ilo, ihi):
            for j in range(jlo, jhi):
                u[i * w + j] += src[i * kw + j]
        src += g.kk


cdef inline void _add_inside_run(const floating* src, floating* gb, const Geometry* g, Py_ssize_t iy0,
                                 Py_ssize_t ct, bint last) noexcept nogil:
    """One tile's windows of row iy0 in columns [lo, hi), right to left.

    3x3 windows left of ``wide`` add each kernel row four wide (the fourth lane adds +0.0 to
    the pixel right of the window), except the last kernel row of the image's last channel,
    whose fourth source element may lie past the rows.
    """
    cdef Py_ssize_t ox, ch, i, j, w = g.w, hw = g.hw, q = g.q, kw = g.kw, kh = g.kh
    cdef const floating* r
    cdef floating* u
    cdef Py_ssize_t full = ct - 1 if last else ct
    gb = gb + iy0 * w - g.pw
    if kh == 3 and kw == 3:
        for ox in range(g.hi - 1, g.lo - 1, -1):
            u = gb + ox * g.sw
            r = src + ox * q
            if ox < g.wide:
                for ch in range(full):
                    _add3(u, r)
                    _add3(u + w, r + 3)
                    _add3(u + 2 * w, r + 6)
                    r += 9
                    u += hw
                if full < ct:
                    _add3(u, r)
                    _add3(u + w, r + 3)
                    u[2 * w] += r[6]; u[2 * w + 1] += r[7]; u[2 * w + 2] += r[8]
            else:
                for ch in range(ct):
                    u[0] += r[0]; u[1] += r[1]; u[2] += r[2]
                    u[w] += r[3]; u[w + 1] += r[4]; u[w + 2] += r[5]
                    u[2 * w] += r[6]; u[2 * w + 1] += r[7]; u[2 * w + 2] += r[8]
                    r += 9
                    u += hw
    elif kh == 1 and kw == 1:
        for ox in range(g.hi - 1, g.lo - 1, -1):
            u = gb + ox * g.sw
            r = src + ox * q
            for ch in range(ct):
                u[ch * hw] += r[ch]
    else:
        for ox in range(g.hi - 1, g.lo - 1, -1):
            u = gb + ox * g.sw
            r = src + ox * q
            for ch in range(ct):
                for i in range(kh):
                    for j in range(kw):
                        u[i * w + j] += r[i * kw + j]
                r += g.kk
                u += hw


cdef void _row2im(const floating* rows, floating* gx, Py_ssize_t n, const Geometry* g) noexcept nogil:
    # Output rows and columns in descending order: a pixel of gx then receives its
    # contributions in ascending kernel offset (i, then j), as the reference's one pass per
    # offset adds them (channels are independent, so their order is free).
    cdef Py_ssize_t b, oy, ox, c0, ct, iy0
    cdef const floating* block
    cdef floating* gb
    memset(gx, 0, n * g.c * g.hw * sizeof(floating))
    for b in range(n):
        for oy in range(g.ho - 1, -1, -1):
            iy0 = oy * g.sh - g.ph
            block = rows + (b * g.ho + oy) * g.wo * g.q
            c0 = 0
            while c0 < g.c:
                ct = min(g.tile, g.c - c0)
                gb = gx + (b * g.c + c0) * g.hw
                if iy0 >= 0 and iy0 + g.kh <= g.h:
                    for ox in range(g.wo - 1, g.hi - 1, -1):
                        _add_border_window(block + ox * g.q + c0 * g.kk, gb, g, iy0, ox * g.sw - g.pw, ct)
                    _add_inside_run(block + c0 * g.kk, gb, g, iy0, ct, c0 + ct == g.c)
                    for ox in range(g.lo - 1, -1, -1):
                        _add_border_window(block + ox * g.q + c0 * g.kk, gb, g, iy0, ox * g.sw - g.pw, ct)
                else:
                    for ox in range(g.wo - 1, -1, -1):
                        _add_border_window(block + ox * g.q + c0 * g.kk, gb, g, iy0, ox * g.sw - g.pw, ct)
                c0 += ct


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
    cdef Geometry g = _plan(c, h, w, kh, kw, sh, sw, ph, pw, sizeof(floating))
    with nogil:
        _im2row(&x[0, 0, 0, 0], &rows[0, 0], n, &g)


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
    cdef Geometry g = _plan(c, h, w, kh, kw, sh, sw, ph, pw, sizeof(floating))
    with nogil:
        _row2im(&rows[0, 0], &gx[0, 0, 0, 0], n, &g)


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


def maxpool(const floating[:, :, :, ::1] x, floating[:, :, :, ::1] y, int[:, :, :, ::1] argmax,
            int kh, int kw, int sh, int sw, int ph, int pw):
    """Max over each window of ``x`` (N, C, H, W) into ``y`` (N, C, Ho, Wo), and the window offset
    ``i * kw + j`` of the first maximum (row-major) into ``argmax``; padding counts as ``-inf``.

    A value replaces the running maximum only when greater (``v > best``), as
    ``hpcdl.nn.pool.MaxPool2d``'s NumPy passes do: ties and NaNs after the first element keep it.
    """
    cdef Py_ssize_t n = x.shape[0], c = x.shape[1], h = x.shape[2], w = x.shape[3]
    cdef Py_ssize_t ho = y.shape[2], wo = y.shape[3]
    if y.shape[0] != n or y.shape[1] != c or ho != _out(h, kh, sh, ph) or wo != _out(w, kw, sw, pw):
        raise ValueError(f"y is {tuple(y.shape)[:4]}, expected ({n}, {c}, {_out(h, kh, sh, ph)}, "
                         f"{_out(w, kw, sw, pw)})")
    if tuple(argmax.shape)[:4] != tuple(y.shape)[:4]:
        raise ValueError(f"argmax is {tuple(argmax.shape)[:4]}, y {tuple(y.shape)[:4]}")
    cdef Py_ssize_t b, ch, oy, ox, i, j, iy, ix
    cdef int k, arg
    cdef floating v, best
    cdef floating ninf = -float("inf")
    with nogil:
        for b in range(n):
            for ch in range(c):
                for oy in range(ho):
                    for ox in range(wo):
                        best = ninf
                        arg = 0
                        for i in range(kh):
                            iy = oy * sh - ph + i
                            for j in range(kw):
                                ix = ox * sw - pw + j
                                if 0 <= iy < h and 0 <= ix < w:
                                    v = x[b, ch, iy, ix]
                                else:
                                    v = ninf
                                k = <int>(i * kw + j)
                                if k == 0 or v > best:
                                    best = v
                                    arg = k
                        y[b, ch, oy, ox] = best
                        argmax[b, ch, oy, ox] = arg


def maxpool_backward(const floating[:, :, :, ::1] gy, const int[:, :, :, ::1] argmax,
                     floating[:, :, :, ::1] gx, int kh, int kw, int sh, int sw, int ph, int pw):
    """``gx`` (N, C, H, W, overwritten): each window's ``gy`` added onto its maximum (``argmax``),
    zero elsewhere; contributions on the padding dropped. Windows must not overlap (stride at
    least the kernel), so each pixel takes at most one contribution (``0 + gy``, as the NumPy
    passes add it)."""
    if sh < kh or sw < kw:
        raise ValueError(f"maxpool_backward takes windows that do not overlap (stride ({sh}, {sw}) "
                         f"below kernel ({kh}, {kw}))")
    cdef Py_ssize_t n = gx.shape[0], c = gx.shape[1], h = gx.shape[2], w = gx.shape[3]
    cdef Py_ssize_t ho = gy.shape[2], wo = gy.shape[3]
    if (gy.shape[0] != n or gy.shape[1] != c or ho != _out(h, kh, sh, ph) or wo != _out(w, kw, sw, pw)
            or tuple(argmax.shape)[:4] != tuple(gy.shape)[:4]):
        raise ValueError(f"gy {tuple(gy.shape)[:4]} and argmax {tuple(argmax.shape)[:4]} do not fit "
                         f"gx {tuple(gx.shape)[:4]}")
    cdef Py_ssize_t b, ch, oy, ox, iy, ix
    cdef int k
    if n * c * h * w == 0:
        return
    with nogil:
        memset(&gx[0, 0, 0, 0], 0, n * c * h * w * sizeof(floating))
        for b in range(n):
            for ch in range(c):
                for oy in range(ho):
                    for ox in range(wo):
                        k = argmax[b, ch, oy, ox]
                        iy = oy * sh - ph + k // kw
                        ix = ox * sw - pw + k % kw
                        if 0 <= iy < h and 0 <= ix < w:
                            gx[b, ch, iy, ix] += gy[b, ch, oy, ox]
