"""Winograd F(2x2, 3x3): a 3x3 stride-1 convolution in 2.25 times fewer multiplications.

Lavin and Gray (2016). The (zero-padded) input is cut into 4x4 tiles two pixels apart; each
tile ``d`` becomes ``V = Bᵀ d B`` and each 3x3 filter ``g`` becomes ``U = G g Gᵀ`` (both 4x4);
at each of the 16 positions ``ξ`` of a tile the channels are contracted by one matrix
product, ``M[ξ] = U[ξ] V[ξ]`` (O, C) @ (C, tiles), and ``Y = Aᵀ M A`` is the tile's 2x2
output. The three transforms take additions only (and halves, exact in binary), so they
cost memory passes while the products, 16 of ``O x C x tiles``, replace the im2row product
of ``O x 9C x 4 tiles``.

Layouts: ``U`` is ``(16, O, C)``, ``V`` is ``(16, C, T)`` with ``T = N * th * tw`` tiles in
(sample, tile row, tile column) order, ``M`` is ``(16, O, T)``; ``ξ = 4 i + j``.

The input gradient of a stride-1 3x3 convolution is a 3x3 convolution of ``gy`` with the
filters rotated by 180° and in/out channels swapped, padded by ``2 - p``. Rotating ``g``
reverses the columns of ``G``, which swaps rows 0 and 3 of ``G``: the rotated filters'
``U`` is ``U[π(i), π(j)]`` transposed, ``π`` swapping 0 and 3 (:data:`ROTATED`), so the
forward's ``U`` serves the backward too.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hpcdl.backend import get_array_module

try:
    from hpcdl._ext import winograd as _kernel
except ImportError:  # not built: `python setup.py build_ext --inplace` or `pip install .`
    _kernel = None

__all__ = [
    "CHUNK_TILES",
    "ROTATED",
    "conv3x3",
    "filter_transform",
    "input_transform",
    "output_transform",
    "tiles",
]

#: ξ of the rotated filters' ``U`` → ξ of the forward's: rows and columns 0 and 3 swapped
ROTATED = tuple(4 * (3, 1, 2, 0)[i] + (3, 1, 2, 0)[j] for i in range(4) for j in range(4))


#: dtypes the compiled transforms take (their fused type)
_KERNEL_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


#: elements between consecutive planes ξ beyond the plane itself: planes of a power-of-two
#: size would start on the same cache sets, and the transforms' 16 streams, one per plane,
#: would evict each other (measured: the filter transform of 512 x 512 filters three times slower)
PLANE_GAP = 16


#: tiles per chunk at least, on the CPU: the samples go through in chunks of this many tiles
#: or more, so that a chunk's ``V`` and ``M`` stay in cache between the transforms and the
#: products while the products are still wide enough (measured, 16 samples of ResNet-18's
#: maps: 64 channels, 32x32, 1 sample a chunk is 1.5 times faster than all 16)
CHUNK_TILES = 64


def planes(xp: Any, rows: int, cols: int, dtype: Any, buffer: Any = None) -> Any:
    """An uninitialised ``(16, rows, cols)`` array, each plane C-contiguous, :data:`PLANE_GAP` apart.

    Args:
        xp: The array module.
        rows: Rows of a plane.
        cols: Columns of a plane.
        dtype: The dtype.
        buffer: A ``(16, size)`` array to view, ``size >= rows * cols`` (a new one when ``None``).
    """
    size = rows * cols
    if buffer is None:
        buffer = xp.empty((16, size + PLANE_GAP), dtype=dtype)
    return buffer[:, :size].reshape(16, rows, cols)


def _planar(a: Any) -> bool:
    """Whether ``a`` (16, rows, cols) has C-contiguous planes (the transforms' layout)."""
    itemsize = a.dtype.itemsize
    _, rows, cols = a.shape  # an axis of length 1 may have any stride
    return (cols == 1 or a.strides[2] == itemsize) and (rows == 1 or a.strides[1] == cols * itemsize)


def _kernel_takes(*arrays: Any) -> bool:
    """True when the compiled transforms take ``arrays``: NumPy, one float32/float64 dtype, C-contiguous."""
    if _kernel is None:
        return False
    dtype = arrays[0].dtype
    return dtype in _KERNEL_DTYPES and all(
        type(a) is np.ndarray and a.dtype == dtype and a.flags.c_contiguous for a in arrays
    )


def tiles(ho: int, wo: int) -> tuple[int, int]:
    """Tile rows and columns covering an ``ho x wo`` output, the last ones partial when odd."""
    return -(-ho // 2), -(-wo // 2)


def filter_transform(w: Any) -> Any:
    """``U = G g Gᵀ`` of every 3x3 filter: ``w`` (O, C, 3, 3) → ``(16, O, C)``, C-contiguous."""
    xp = get_array_module(w)
    o, c = w.shape[:2]
    if _kernel_takes(w):
        u = planes(np, o, c, w.dtype)  # 16, O, C
        _kernel.filter_transform(w, u)
        return u
    # the nine taps as contiguous (O, C) planes: each pass below then runs over whole planes
    # (on (O, C, 3, 3) it would run three elements at a time)
    g = xp.ascontiguousarray(w.reshape(o, c, 9).transpose(2, 0, 1)).reshape(3, 3, o, c)  # k, l, O, C
    r = xp.empty((4, 3, o, c), dtype=w.dtype)  # G g: i, l, O, C
    r[0] = g[0]
    xp.add(g[0], g[2], out=r[1])
    r[2] = r[1]
    r[1] += g[1]
    r[2] -= g[1]
    r[1:3] *= 0.5
    r[3] = g[2]
    u = xp.empty((4, 4, o, c), dtype=w.dtype)  # (G g) Gᵀ: i, j, O, C
    u[:, 0] = r[:, 0]
    xp.add(r[:, 0], r[:, 2], out=u[:, 1])
    u[:, 2] = u[:, 1]
    u[:, 1] += r[:, 1]
    u[:, 2] -= r[:, 1]
    u[:, 1:3] *= 0.5
    u[:, 3] = r[:, 2]
    return u.reshape(16, o, c)


def input_transform(x: Any, padding: int, th: int, tw: int, out: Any = None) -> Any:
    """``V = Bᵀ d B`` of every 4x4 tile of ``x`` (N, C, H, W) zero-padded by ``padding``.

    Tiles start every two pixels of the padded input; rows and columns past its end (a
    partial last tile) read zeros. ``out``, when given, is written (planes C-contiguous).

    Returns:
        ``V``, ``(16, C, N * th * tw)``: ``out``, or a new array.
    """
    xp = get_array_module(x)
    n, c, h, w = x.shape
    if out is None:
        out = planes(xp, c, n * th * tw, x.dtype)  # 16, C, T
    if _kernel_takes(x, out[0]) and _planar(out):
        _kernel.input_transform(x, out, padding, th, tw)
        return out
    hq, wq = 2 * th + 2, 2 * tw + 2  # padded input the tiles cover
    xpad = xp.zeros((c, n, hq, wq), dtype=x.dtype)  # C, N, Hq, Wq
    hi, wi = min(h, hq - padding), min(w, wq - padding)
    xpad[:, :, padding : padding + hi, padding : padding + wi] = x[:, :, :hi, :wi].transpose(1, 0, 2, 3)
    # d B along the columns: a[j] (C, N, Hq, tw) from columns 2tx + 0..3
    a = xp.empty((4, c, n, hq, tw), dtype=x.dtype)
    col = [xpad[..., j : j + 2 * tw : 2] for j in range(4)]  # C, N, Hq, tw each
    xp.subtract(col[0], col[2], out=a[0])
    xp.add(col[1], col[2], out=a[1])
    xp.subtract(col[2], col[1], out=a[2])
    xp.subtract(col[1], col[3], out=a[3])
    # Bᵀ (d B) along the rows
    v = xp.empty((4, 4, c, n, th, tw), dtype=x.dtype)  # i, j, C, N, th, tw
    for j in range(4):
        row = [a[j, :, :, i : i + 2 * th : 2] for i in range(4)]  # C, N, th, tw each
        xp.subtract(row[0], row[2], out=v[0, j])
        xp.add(row[1], row[2], out=v[1, j])
        xp.subtract(row[2], row[1], out=v[2, j])
        xp.subtract(row[1], row[3], out=v[3, j])
    out[...] = v.reshape(16, c, n * th * tw)
    return out


def output_transform(m: Any, n: int, ho: int, wo: int, bias: Any = None, out: Any = None) -> Any:
    """``Y = Aᵀ M A`` of every tile: ``m`` (16, O, N * th * tw) → ``y`` (N, O, Ho, Wo).

    A partial last tile's extra row or column is dropped; ``bias`` (O,), when given, is added.
    ``out`` (C-contiguous), when given, is written; else a new C-contiguous array.
    """
    xp = get_array_module(m)
    o = m.shape[1]
    th, tw = tiles(ho, wo)
    if out is None:
        out = xp.empty((n, o, ho, wo), dtype=m.dtype)  # N, O, Ho, Wo
    if _kernel_takes(m[0], out) and _planar(m) and (bias is None or _kernel_takes(out, bias)):
        _kernel.output_transform(m, out, m[0, 0, :0] if bias is None else bias, bias is not None)
        return out
    mv = m.reshape(4, 4, o, n, th, tw)  # i, j, O, N, th, tw
    s = xp.empty((4, 2, o, n, th, tw), dtype=m.dtype)  # M A: i, b, O, N, th, tw
    for i in range(4):
        xp.add(mv[i, 0], mv[i, 1], out=s[i, 0])
        s[i, 0] += mv[i, 2]
        xp.subtract(mv[i, 1], mv[i, 2], out=s[i, 1])
        s[i, 1] -= mv[i, 3]
    full = xp.empty((n, o, th, 2, tw, 2), dtype=m.dtype)  # N, O, th, a, tw, b
    t = xp.empty((o, n, th, tw), dtype=m.dtype)  # O, N, th, tw (scratch)
    for b in range(2):
        xp.add(s[0, b], s[1, b], out=t)
        t += s[2, b]
        full[:, :, :, 0, :, b] = t.transpose(1, 0, 2, 3)
        xp.subtract(s[1, b], s[2, b], out=t)
        t -= s[3, b]
        full[:, :, :, 1, :, b] = t.transpose(1, 0, 2, 3)
    out[...] = full.reshape(n, o, 2 * th, 2 * tw)[:, :, :ho, :wo]
    if bias is not None:
        out += bias.reshape(1, o, 1, 1)
    return out


def conv3x3(
    x: Any,
    u: Any,
    padding: int,
    rotated: bool = False,
    bias: Any = None,
    samples_per_chunk: int | None = None,
) -> Any:
    """The 3x3 stride-1 convolution of ``x`` (N, C, H, W) by the filters whose ``U`` is ``u``.

    Args:
        x: The input, ``(N, C, H, W)``.
        u: :func:`filter_transform` of the ``(O, C, 3, 3)`` filters, ``(16, O, C)``.
        padding: Zero padding on each side (the same for rows and columns).
        rotated: Convolve with the filters rotated by 180° and their in/out channels swapped
            (``u`` then maps ``C`` → ``O`` with ``C`` its first matrix axis: the input gradient).
        bias: ``(O,)`` added to the output, or ``None``.
        samples_per_chunk: Samples transformed and multiplied at a time (``None``: all).

    Returns:
        ``(N, O, H + 2p - 2, W + 2p - 2)``, C-contiguous.
    """
    xp = get_array_module(x)
    n, c, h, w = x.shape
    ho, wo = h + 2 * padding - 2, w + 2 * padding - 2
    th, tw = tiles(ho, wo)
    o = u.shape[2] if rotated else u.shape[1]
    dtype = xp.result_type(u.dtype, x.dtype)
    step = min(n, samples_per_chunk or n)
    per = th * tw  # tiles of a sample
    y = xp.empty((n, o, ho, wo), dtype=dtype)  # N, O, Ho, Wo
    vbuf = xp.empty((16, c * step * per + PLANE_GAP), dtype=x.dtype)  # a chunk's V (scratch)
    mbuf = xp.empty((16, o * step * per + PLANE_GAP), dtype=dtype)  # a chunk's M (scratch)
    for n0 in range(0, n, step):
        n1 = min(n, n0 + step)
        t = (n1 - n0) * per
        v = input_transform(x[n0:n1], padding, th, tw, out=planes(xp, c, t, x.dtype, vbuf))  # 16, C, t
        m = planes(xp, o, t, dtype, mbuf)  # 16, O, t
        for k in range(16):  # one product per tile position ξ
            uk = u[ROTATED[k]].T if rotated else u[k]  # O, C
            xp.matmul(uk, v[k], out=m[k])
        output_transform(m, n1 - n0, ho, wo, bias, out=y[n0:n1])  # n, O, Ho, Wo
    return y
