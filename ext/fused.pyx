# cython: boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False, language_level=3
"""Fused element-wise passes of the training step: SGD and Adam updates, ReLU, BatchNorm.

Each NumPy expression of the code these kernels replace is a pass over memory, often into a
temporary; here each update is one pass (BatchNorm's, a few per channel while the channel
is in cache), without the GIL, on float32 or float64 (``cython.floating``) C-contiguous
arrays.

**Same numbers.** The SGD, Adam and ReLU kernels compute what the NumPy code computes, bit
for bit: the same operations in the same order in the array's precision (a Python float
scalar is rounded to the array's dtype first, as NumPy does with a float32 array, and each
intermediate is rounded where NumPy stores its temporary). The module is compiled with
``-ffp-contract=off`` so that no multiply and add are fused into one FMA (``setup.py``).
BatchNorm's kernels accumulate their per-channel sums in float64, in a fixed order, instead
of NumPy's pairwise sums in the array's dtype: its statistics and gradients differ from the
NumPy path's in the last bits (and are deterministic: the same input, the same bits).

**Coverage.** Every kernel returns False, having written nothing, when an array is not a
plain native-order ``numpy.ndarray`` of the one dtype (float32 or float64; bool for masks),
C-contiguous and aligned, of the expected size, writeable where written: the caller then
takes its array-module (NumPy or CuPy) path. :func:`takes` is that check for one array.
"""

from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cython cimport floating
from libc.math cimport sqrt, sqrtf

cimport numpy as cnp

cnp.import_array()

cdef int _NEED = cnp.NPY_ARRAY_C_CONTIGUOUS | cnp.NPY_ARRAY_ALIGNED


# -- checks ------------------------------------------------------------------------------

cdef inline int _float_type(object obj) noexcept:
    """NPY_FLOAT or NPY_DOUBLE when ``obj`` is a plain, C-contiguous, aligned, native float
    array; -1 otherwise."""
    cdef cnp.ndarray a
    cdef int t
    if type(obj) is not cnp.ndarray:
        return -1
    a = <cnp.ndarray>obj
    t = cnp.PyArray_TYPE(a)
    if (t != cnp.NPY_FLOAT and t != cnp.NPY_DOUBLE) or (cnp.PyArray_FLAGS(a) & _NEED) != _NEED \
            or not cnp.PyArray_ISNOTSWAPPED(a):
        return -1
    return t


cdef inline bint _like(object obj, int typenum, cnp.npy_intp size, bint writable) noexcept:
    """Whether ``obj`` is a plain, C-contiguous, aligned, native array of ``typenum`` and
    ``size`` elements (writeable if asked)."""
    cdef cnp.ndarray a
    cdef int need = _NEED
    if type(obj) is not cnp.ndarray:
        return False
    a = <cnp.ndarray>obj
    if writable:
        need |= cnp.NPY_ARRAY_WRITEABLE
    return (cnp.PyArray_TYPE(a) == typenum and (cnp.PyArray_FLAGS(a) & need) == need
            and cnp.PyArray_ISNOTSWAPPED(a) and cnp.PyArray_SIZE(a) == size)


cdef inline bint _same_shape(cnp.ndarray a, cnp.ndarray b) noexcept:
    cdef int d
    if cnp.PyArray_NDIM(a) != cnp.PyArray_NDIM(b):
        return False
    for d in range(cnp.PyArray_NDIM(a)):
        if cnp.PyArray_DIMS(a)[d] != cnp.PyArray_DIMS(b)[d]:
            return False
    return True


cdef inline void* _data(object obj) noexcept:
    return cnp.PyArray_DATA(<cnp.ndarray>obj)


def takes(x) -> bool:
    """Whether the kernels cover ``x``: a plain native-order ``numpy.ndarray`` of float32 or
    float64, C-contiguous and aligned (the other arrays of a call are checked by the call)."""
    return _float_type(x) >= 0


# -- SGD ---------------------------------------------------------------------------------
# An optimizer's loop is written once with its cases as flags and called with constant flags,
# one call per case: the compiler inlines a branch-free copy of the loop for each, which it
# vectorises. (The same loop with run-time branches does not vectorise; a loop per NumPy
# operation over cache-sized blocks does, but measured slower than NumPy for plain momentum.)

cdef inline void _sgd_loop(floating* w, const floating* g, floating* v, Py_ssize_t n, floating lr,
                           floating mu, floating wd, bint decay, bint momentum, bint first,
                           bint nesterov) noexcept nogil:
    """The update, one value at a time; each caller passes constant flags, so that the
    compiler makes a branch-free (vectorised) copy of the loop for each case."""
    cdef floating gi, vi, t
    cdef Py_ssize_t i
    for i in range(n):
        gi = g[i]
        if decay:
            t = w[i] * wd  # multiply(w, wd, out=tmp)
            gi = t + gi  # tmp += g
        if momentum:
            if first:
                vi = gi  # v[...] = g
            else:
                t = v[i] * mu  # v *= mu
                vi = t + gi  # v += g
            v[i] = vi
            if nesterov:
                t = mu * vi  # mu * v
                gi = gi + t  # tmp += mu * v
            else:
                gi = vi
        t = gi * lr  # multiply(g, lr, out=tmp)
        w[i] = w[i] - t  # w -= tmp


cdef inline void _sgd_decay(floating* w, const floating* g, floating* v, Py_ssize_t n, floating lr,
                            floating mu, floating wd, bint decay, bint first,
                            bint nesterov) noexcept nogil:
    """The loop for this momentum case, its flags as constants."""
    if v == NULL:
        _sgd_loop(w, g, v, n, lr, mu, wd, decay, False, False, False)
    elif first and nesterov:
        _sgd_loop(w, g, v, n, lr, mu, wd, decay, True, True, True)
    elif first:
        _sgd_loop(w, g, v, n, lr, mu, wd, decay, True, True, False)
    elif nesterov:
        _sgd_loop(w, g, v, n, lr, mu, wd, decay, True, False, True)
    else:
        _sgd_loop(w, g, v, n, lr, mu, wd, decay, True, False, False)


cdef void _sgd(floating* w, const floating* g, floating* v, Py_ssize_t n, double lr, double mu,
               double wd, bint first, bint nesterov) noexcept nogil:
    cdef floating lr_ = <floating>lr, mu_ = <floating>mu, wd_ = <floating>wd
    if wd != 0:
        _sgd_decay(w, g, v, n, lr_, mu_, wd_, True, first, nesterov)
    else:
        _sgd_decay(w, g, v, n, lr_, mu_, wd_, False, first, nesterov)


def sgd(w, g, v, double lr, double mu, double wd, bint first, bint nesterov) -> bool:
    """One SGD update of one parameter in place (``hpcdl.optim.SGD.step``'s formula).

    Args:
        w: the parameter, updated.
        g: its gradient, read only.
        v: its momentum buffer, updated; None without momentum.
        lr: learning rate.
        mu: momentum.
        wd: weight decay (0: none).
        first: the first step (``v = g``).
        nesterov: Nesterov momentum.

    Returns:
        False, with nothing written, when the arrays are not covered (module docstring).
    """
    cdef int t = _float_type(w)
    cdef cnp.npy_intp n
    cdef void* vp = NULL
    if t < 0:
        return False
    n = cnp.PyArray_SIZE(<cnp.ndarray>w)
    if not _like(w, t, n, True) or not _like(g, t, n, False):
        return False
    if v is not None:
        if not _like(v, t, n, True):
            return False
        vp = _data(v)
    cdef void* wp = _data(w)
    cdef void* gp = _data(g)
    with nogil:
        if t == cnp.NPY_FLOAT:
            _sgd(<float*>wp, <const float*>gp, <float*>vp, n, lr, mu, wd, first, nesterov)
        else:
            _sgd(<double*>wp, <const double*>gp, <double*>vp, n, lr, mu, wd, first, nesterov)
    return True


# -- Adam --------------------------------------------------------------------------------

cdef enum:
    _PLAIN = 0
    _DECOUPLED = 1
    _L2 = 2

#: Adam's weight-decay modes: none, decoupled (AdamW: ``w *= 1 - lr * wd``), L2 in the gradient
ADAM_PLAIN, ADAM_DECOUPLED, ADAM_L2 = _PLAIN, _DECOUPLED, _L2


cdef inline void _adam_loop(floating* w, const floating* g, floating* m, floating* v, Py_ssize_t n,
                            int mode, floating decay, floating wd, floating b1, floating c1,
                            floating b2, floating c2, floating ib, floating eps,
                            floating step_size) noexcept nogil:
    """The update, one value at a time; each caller passes a constant ``mode`` (see _sgd_loop)."""
    cdef floating gi, wi, mi, vi, t
    cdef Py_ssize_t i
    for i in range(n):
        gi = g[i]
        wi = w[i]
        if mode == _DECOUPLED:
            wi = wi * decay  # w *= 1 - lr * wd
        elif mode == _L2:
            t = wi * wd  # multiply(w, wd, out=tmp)
            gi = t + gi  # tmp += g
        t = c1 * gi  # (1 - b1) * g
        mi = m[i] * b1  # m *= b1
        mi = mi + t  # m += (1 - b1) * g
        m[i] = mi
        t = gi * gi  # multiply(g, g, out=tmp)
        t = t * c2  # tmp *= 1 - b2
        vi = v[i] * b2  # v *= b2
        vi = vi + t  # v += tmp
        v[i] = vi
        if floating is float:
            t = sqrtf(vi)  # sqrt(v, out=tmp)
        else:
            t = sqrt(vi)
        t = t * ib  # tmp *= 1 / sqrt(bc2)
        t = t + eps  # tmp += eps
        t = mi / t  # divide(m, tmp, out=tmp)
        t = t * step_size  # tmp *= step_size
        w[i] = wi - t  # w -= tmp


cdef void _adam(floating* w, const floating* g, floating* m, floating* v, Py_ssize_t n, int mode,
                double decay, double wd, double b1, double c1, double b2, double c2,
                double inv_sqrt_bc2, double eps, double step_size) noexcept nogil:
    cdef floating decay_ = <floating>decay, wd_ = <floating>wd
    cdef floating b1_ = <floating>b1, c1_ = <floating>c1, b2_ = <floating>b2, c2_ = <floating>c2
    cdef floating ib_ = <floating>inv_sqrt_bc2, eps_ = <floating>eps, ss_ = <floating>step_size
    if mode == _DECOUPLED:
        _adam_loop(w, g, m, v, n, _DECOUPLED, decay_, wd_, b1_, c1_, b2_, c2_, ib_, eps_, ss_)
    elif mode == _L2:
        _adam_loop(w, g, m, v, n, _L2, decay_, wd_, b1_, c1_, b2_, c2_, ib_, eps_, ss_)
    else:
        _adam_loop(w, g, m, v, n, _PLAIN, decay_, wd_, b1_, c1_, b2_, c2_, ib_, eps_, ss_)


def adam(w, g, m, v, int mode, double decay, double wd, double b1, double c1, double b2, double c2,
         double inv_sqrt_bc2, double eps, double step_size) -> bool:
    """One Adam update of one parameter in place (``hpcdl.optim.Adam.step``'s formula).

    The scalars are the ones that code computes in Python (float64) before NumPy rounds
    them to the arrays' dtype.

    Args:
        w: the parameter, updated.
        g: its gradient, read only.
        m: first-moment buffer, updated.
        v: second-moment buffer, updated.
        mode: ``ADAM_PLAIN``, ``ADAM_DECOUPLED`` or ``ADAM_L2``.
        decay: ``1 - lr * wd`` (``ADAM_DECOUPLED``).
        wd: weight decay (``ADAM_L2``).
        b1: beta1.
        c1: ``1 - beta1``.
        b2: beta2.
        c2: ``1 - beta2``.
        inv_sqrt_bc2: ``1 / sqrt(1 - beta2**t)``.
        eps: added to the denominator.
        step_size: ``lr / (1 - beta1**t)``.

    Returns:
        False, with nothing written, when the arrays are not covered (module docstring).
    """
    cdef int t = _float_type(w)
    cdef cnp.npy_intp n
    if t < 0:
        return False
    n = cnp.PyArray_SIZE(<cnp.ndarray>w)
    if not (_like(w, t, n, True) and _like(g, t, n, False) and _like(m, t, n, True)
            and _like(v, t, n, True)):
        return False
    cdef void* wp = _data(w)
    cdef void* gp = _data(g)
    cdef void* mp = _data(m)
    cdef void* vp = _data(v)
    with nogil:
        if t == cnp.NPY_FLOAT:
            _adam(<float*>wp, <const float*>gp, <float*>mp, <float*>vp, n,
                  mode, decay, wd, b1, c1, b2, c2, inv_sqrt_bc2, eps, step_size)
        else:
            _adam(<double*>wp, <const double*>gp, <double*>mp, <double*>vp, n,
                  mode, decay, wd, b1, c1, b2, c2, inv_sqrt_bc2, eps, step_size)
    return True


# -- ReLU --------------------------------------------------------------------------------

cdef void _relu_forward(const floating* x, floating* y, cnp.npy_bool* mask,
                        Py_ssize_t n) noexcept nogil:
    cdef floating xi
    cdef Py_ssize_t i
    for i in range(n):
        xi = x[i]
        mask[i] = xi > 0
        # maximum(x, 0): +0 for x <= 0 (-0 included), x itself when it is NaN
        y[i] = 0 if xi <= 0 else xi


cdef void _relu_backward(const floating* gy, const cnp.npy_bool* mask, floating* gx,
                         Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n):
        gx[i] = gy[i] * <floating>mask[i]  # multiply(gy, mask): the bool cast to 0 or 1


def relu_forward(x, y, mask) -> bool:
    """``mask = x > 0`` and ``y = maximum(x, 0)`` in one pass.

    Args:
        x: the input.
        y: written, the output, x's size (may be ``x``: in place).
        mask: written, bool, x's size.

    Returns:
        False, with nothing written, when the arrays are not covered (module docstring).
    """
    cdef int t = _float_type(x)
    cdef cnp.npy_intp n
    if t < 0:
        return False
    n = cnp.PyArray_SIZE(<cnp.ndarray>x)
    if not (_like(y, t, n, True) and _like(mask, cnp.NPY_BOOL, n, True)):
        return False
    cdef void* xp = _data(x)
    cdef void* yp = _data(y)
    cdef cnp.npy_bool* mp = <cnp.npy_bool*>_data(mask)
    with nogil:
        if t == cnp.NPY_FLOAT:
            _relu_forward(<const float*>xp, <float*>yp, mp, n)
        else:
            _relu_forward(<const double*>xp, <double*>yp, mp, n)
    return True


def relu_backward(gy, mask, gx) -> bool:
    """``gx = gy * mask`` in one pass.

    Args:
        gy: the output's gradient.
        mask: the forward's ``x > 0``, bool, gy's shape.
        gx: written, the input gradient, gy's size (may be ``gy``: in place).

    Returns:
        False, with nothing written, when the arrays are not covered (module docstring).
    """
    cdef int t = _float_type(gy)
    cdef cnp.npy_intp n
    if t < 0:
        return False
    n = cnp.PyArray_SIZE(<cnp.ndarray>gy)
    if not (_like(gx, t, n, True) and _like(mask, cnp.NPY_BOOL, n, False)
            and _same_shape(<cnp.ndarray>gy, <cnp.ndarray>mask)):
        return False
    cdef void* gyp = _data(gy)
    cdef void* gxp = _data(gx)
    cdef const cnp.npy_bool* mp = <const cnp.npy_bool*>_data(mask)
    with nogil:
        if t == cnp.NPY_FLOAT:
            _relu_backward(<const float*>gyp, mp, <float*>gxp, n)
        else:
            _relu_backward(<const double*>gyp, mp, <double*>gxp, n)
    return True


# -- BatchNorm ---------------------------------------------------------------------------
# x is (N, C, S): S the product of the axes after the channels (1 for (N, C)). A channel's
# values are N runs of S contiguous values, ``x + (k * C + c) * S`` for k < N: the kernels
# take one channel at a time, its passes reading it from cache after the first. For S = 1
# (BatchNorm1d on (N, C)) a channel is a column: the ``_rows`` kernels go row by row instead,
# the per-channel sums in a float64 scratch of 2 C values.

cdef inline double _sum(const floating* p, Py_ssize_t s) noexcept nogil:
    """Sum of ``p[:s]`` in float64, four partial sums (a fixed order: deterministic)."""
    cdef double a0 = 0, a1 = 0, a2 = 0, a3 = 0
    cdef Py_ssize_t i = 0
    while i + 4 <= s:
        a0 += p[i]
        a1 += p[i + 1]
        a2 += p[i + 2]
        a3 += p[i + 3]
        i += 4
    while i < s:
        a0 += p[i]
        i += 1
    return (a0 + a1) + (a2 + a3)


cdef inline double _sum_sq(const floating* p, Py_ssize_t s, floating mean) noexcept nogil:
    """Sum of ``(p[:s] - mean)**2``, the difference rounded to the dtype, the square in float64."""
    cdef double a0 = 0, a1 = 0, a2 = 0, a3 = 0, d0, d1, d2, d3
    cdef Py_ssize_t i = 0
    while i + 4 <= s:
        d0 = <floating>(p[i] - mean)
        d1 = <floating>(p[i + 1] - mean)
        d2 = <floating>(p[i + 2] - mean)
        d3 = <floating>(p[i + 3] - mean)
        a0 += d0 * d0
        a1 += d1 * d1
        a2 += d2 * d2
        a3 += d3 * d3
        i += 4
    while i < s:
        d0 = <floating>(p[i] - mean)
        a0 += d0 * d0
        i += 1
    return (a0 + a1) + (a2 + a3)


cdef inline void _sum_dot(const floating* gy, const floating* xh, Py_ssize_t s,
                          double* sg, double* sgx) noexcept nogil:
    """Add the sums of ``gy[:s]`` and of ``gy[:s] * xh[:s]`` (products in float64) to ``sg``, ``sgx``."""
    cdef double a0 = 0, a1 = 0, b0 = 0, b1 = 0
    cdef Py_ssize_t i = 0
    while i + 2 <= s:
        a0 += gy[i]
        a1 += gy[i + 1]
        b0 += <double>gy[i] * <double>xh[i]
        b1 += <double>gy[i + 1] * <double>xh[i + 1]
        i += 2
    if i < s:
        a0 += gy[i]
        b0 += <double>gy[i] * <double>xh[i]
    sg[0] += a0 + a1
    sgx[0] += b0 + b1


cdef void _bn_forward_channels(const floating* x, Py_ssize_t N, Py_ssize_t C, Py_ssize_t S,
                      const floating* gamma, const floating* beta, double eps,
                      floating* xhat, floating* y, floating* mean_out, floating* var_out,
                      floating* inv_out) noexcept nogil:
    cdef Py_ssize_t c, k, i, off
    cdef double m = <double>(N * S), acc
    cdef floating mean, var, inv, gam, bet, xh, eps_ = <floating>eps
    for c in range(C):
        acc = 0
        for k in range(N):
            acc += _sum(x + (k * C + c) * S, S)
        mean = <floating>(acc / m)  # 1, C, 1, 1
        acc = 0
        for k in range(N):
            acc += _sum_sq(x + (k * C + c) * S, S, mean)
        var = <floating>(acc / m)  # biased
        if floating is float:
            inv = 1 / sqrtf(var + eps_)  # 1 / sqrt(var + eps)
        else:
            inv = 1 / sqrt(var + eps_)
        gam = gamma[c]
        bet = beta[c]
        for k in range(N):
            off = (k * C + c) * S
            for i in range(off, off + S):
                xh = (x[i] - mean) * inv  # (x - mean) * inv_std
                xhat[i] = xh
                y[i] = xh * gam + bet  # xhat * gamma + beta
        mean_out[c] = mean
        var_out[c] = var
        inv_out[c] = inv


cdef void _bn_backward_channels(const floating* gy, const floating* xhat, Py_ssize_t N, Py_ssize_t C,
                       Py_ssize_t S, const floating* gamma, const floating* inv_std,
                       floating* gbeta, floating* ggamma, floating* gx) noexcept nogil:
    cdef Py_ssize_t c, k, i, off
    cdef double m = <double>(N * S), sg, sgx
    cdef floating gam, inv, mean_g, mean_gx, gxh
    for c in range(C):
        sg = 0
        sgx = 0
        for k in range(N):
            off = (k * C + c) * S
            _sum_dot(gy + off, xhat + off, S, &sg, &sgx)
        gbeta[c] = <floating>sg  # sum(gy)
        ggamma[c] = <floating>sgx  # sum(gy * xhat)
        if gx == NULL:
            continue
        gam = gamma[c]
        inv = inv_std[c]
        mean_g = <floating>(gam * sg / m)  # mean(gy * gamma)
        mean_gx = <floating>(gam * sgx / m)  # mean(gy * gamma * xhat)
        for k in range(N):
            off = (k * C + c) * S
            for i in range(off, off + S):
                gxh = gy[i] * gam  # gxhat
                gx[i] = (gxh - mean_g - xhat[i] * mean_gx) * inv


cdef void _bn_forward_rows(const floating* x, Py_ssize_t N, Py_ssize_t C, const floating* gamma,
                           const floating* beta, double eps, floating* xhat, floating* y,
                           floating* mean_out, floating* var_out, floating* inv_out,
                           double* acc) noexcept nogil:
    cdef Py_ssize_t c, k
    cdef const floating* row
    cdef floating d, xh, eps_ = <floating>eps
    for c in range(C):
        acc[c] = 0
    for k in range(N):
        row = x + k * C
        for c in range(C):
            acc[c] += row[c]
    for c in range(C):
        mean_out[c] = <floating>(acc[c] / N)  # C
        acc[c] = 0
    for k in range(N):
        row = x + k * C
        for c in range(C):
            d = row[c] - mean_out[c]
            acc[c] += <double>d * <double>d
    for c in range(C):
        var_out[c] = <floating>(acc[c] / N)  # biased
        if floating is float:
            inv_out[c] = 1 / sqrtf(var_out[c] + eps_)  # 1 / sqrt(var + eps)
        else:
            inv_out[c] = 1 / sqrt(var_out[c] + eps_)
    for k in range(N):
        row = x + k * C
        for c in range(C):
            xh = (row[c] - mean_out[c]) * inv_out[c]  # (x - mean) * inv_std
            xhat[k * C + c] = xh
            y[k * C + c] = xh * gamma[c] + beta[c]  # xhat * gamma + beta


cdef void _bn_backward_rows(const floating* gy, const floating* xhat, Py_ssize_t N, Py_ssize_t C,
                            const floating* gamma, const floating* inv_std, floating* gbeta,
                            floating* ggamma, floating* gx, double* acc) noexcept nogil:
    cdef Py_ssize_t c, k, off
    cdef double* sg = acc
    cdef double* sgx = acc + C
    cdef floating gxh
    for c in range(C):
        sg[c] = 0
        sgx[c] = 0
    for k in range(N):
        off = k * C
        for c in range(C):
            sg[c] += gy[off + c]
            sgx[c] += <double>gy[off + c] * <double>xhat[off + c]
    for c in range(C):
        gbeta[c] = <floating>sg[c]  # sum(gy)
        ggamma[c] = <floating>sgx[c]  # sum(gy * xhat)
        sg[c] = <floating>(gamma[c] * sg[c] / N)  # mean(gy * gamma), rounded to the dtype
        sgx[c] = <floating>(gamma[c] * sgx[c] / N)  # mean(gy * gamma * xhat)
    if gx == NULL:
        return
    for k in range(N):
        off = k * C
        for c in range(C):
            gxh = gy[off + c] * gamma[c]  # gxhat
            gx[off + c] = (gxh - <floating>sg[c] - xhat[off + c] * <floating>sgx[c]) * inv_std[c]


cdef bint _ncs(cnp.ndarray x, Py_ssize_t* N, Py_ssize_t* C, Py_ssize_t* S) noexcept:
    """(N, C, S) of an array of at least two axes; False for fewer."""
    cdef int d
    if cnp.PyArray_NDIM(x) < 2:
        return False
    N[0] = cnp.PyArray_DIMS(x)[0]
    C[0] = cnp.PyArray_DIMS(x)[1]
    S[0] = 1
    for d in range(2, cnp.PyArray_NDIM(x)):
        S[0] *= cnp.PyArray_DIMS(x)[d]
    return True


def batchnorm_forward(x, gamma, beta, double eps, xhat, y, mean, var, inv_std) -> bool:
    """BatchNorm's training forward over ``(N, C, ...)``: per-channel batch mean and biased
    variance (sums in float64), ``xhat = (x - mean) * inv_std`` and ``y = xhat * gamma + beta``.

    Args:
        x: the input, N, C, ... (at least two values per channel).
        gamma: weight, C.
        beta: bias, C.
        eps: added to the variance.
        xhat: written, the normalised input, shape of x.
        y: written, the output, shape of x.
        mean: written, the batch means, C (rounded to the dtype).
        var: written, the biased batch variances, C.
        inv_std: written, ``1 / sqrt(var + eps)``, C.

    Returns:
        False, with nothing written, when the arrays are not covered (module docstring).
    """
    cdef int t = _float_type(x)
    cdef Py_ssize_t N, C, S, n
    if t < 0 or not _ncs(<cnp.ndarray>x, &N, &C, &S) or N * S < 1:
        return False
    n = N * C * S
    if not (_like(gamma, t, C, False) and _like(beta, t, C, False) and _like(xhat, t, n, True)
            and _like(y, t, n, True) and _like(mean, t, C, True) and _like(var, t, C, True)
            and _like(inv_std, t, C, True)):
        return False
    cdef void* p[8]
    p[0], p[1], p[2], p[3] = _data(x), _data(gamma), _data(beta), _data(xhat)
    p[4], p[5], p[6], p[7] = _data(y), _data(mean), _data(var), _data(inv_std)
    cdef double* acc = NULL
    if S == 1:
        acc = <double*>PyMem_Malloc(max(C, 1) * sizeof(double))
        if acc == NULL:
            raise MemoryError()
    try:
        with nogil:
            if t == cnp.NPY_FLOAT and S == 1:
                _bn_forward_rows(<const float*>p[0], N, C, <const float*>p[1], <const float*>p[2],
                                 eps, <float*>p[3], <float*>p[4], <float*>p[5], <float*>p[6],
                                 <float*>p[7], acc)
            elif S == 1:
                _bn_forward_rows(<const double*>p[0], N, C, <const double*>p[1],
                                 <const double*>p[2], eps, <double*>p[3], <double*>p[4],
                                 <double*>p[5], <double*>p[6], <double*>p[7], acc)
            elif t == cnp.NPY_FLOAT:
                _bn_forward_channels(<const float*>p[0], N, C, S, <const float*>p[1],
                                     <const float*>p[2], eps, <float*>p[3], <float*>p[4],
                                     <float*>p[5], <float*>p[6], <float*>p[7])
            else:
                _bn_forward_channels(<const double*>p[0], N, C, S, <const double*>p[1],
                                     <const double*>p[2], eps, <double*>p[3], <double*>p[4],
                                     <double*>p[5], <double*>p[6], <double*>p[7])
    finally:
        PyMem_Free(acc)
    return True


def batchnorm_backward(gy, xhat, gamma, inv_std, gbeta, ggamma, gx) -> bool:
    """BatchNorm's training backward: ``gbeta = sum(gy)``, ``ggamma = sum(gy * xhat)`` per
    channel (sums in float64), then, unless ``gx`` is None,
    ``gx = (gy * gamma - mean(gy * gamma) - xhat * mean(gy * gamma * xhat)) * inv_std``.

    Args:
        gy: the output's gradient, N, C, ...
        xhat: the forward's normalised input, shape of gy.
        gamma: weight, C.
        inv_std: the forward's ``1 / sqrt(var + eps)``, C.
        gbeta: written, the bias gradient, C.
        ggamma: written, the weight gradient, C.
        gx: written, the input gradient, shape of gy; None to skip it.

    Returns:
        False, with nothing written, when the arrays are not covered (module docstring).
    """
    cdef int t = _float_type(gy)
    cdef Py_ssize_t N, C, S, n
    cdef void* gxp = NULL
    if t < 0 or not _ncs(<cnp.ndarray>gy, &N, &C, &S) or N * S < 1:
        return False
    n = N * C * S
    if not (_like(xhat, t, n, False) and _same_shape(<cnp.ndarray>gy, <cnp.ndarray>xhat)
            and _like(gamma, t, C, False) and _like(inv_std, t, C, False)
            and _like(gbeta, t, C, True) and _like(ggamma, t, C, True)):
        return False
    if gx is not None:
        if not _like(gx, t, n, True):
            return False
        gxp = _data(gx)
    cdef void* p[6]
    p[0], p[1], p[2] = _data(gy), _data(xhat), _data(gamma)
    p[3], p[4], p[5] = _data(inv_std), _data(gbeta), _data(ggamma)
    cdef double* acc = NULL
    if S == 1:
        acc = <double*>PyMem_Malloc(max(2 * C, 1) * sizeof(double))
        if acc == NULL:
            raise MemoryError()
    try:
        with nogil:
            if t == cnp.NPY_FLOAT and S == 1:
                _bn_backward_rows(<const float*>p[0], <const float*>p[1], N, C, <const float*>p[2],
                                  <const float*>p[3], <float*>p[4], <float*>p[5], <float*>gxp, acc)
            elif S == 1:
                _bn_backward_rows(<const double*>p[0], <const double*>p[1], N, C,
                                  <const double*>p[2], <const double*>p[3], <double*>p[4],
                                  <double*>p[5], <double*>gxp, acc)
            elif t == cnp.NPY_FLOAT:
                _bn_backward_channels(<const float*>p[0], <const float*>p[1], N, C, S,
                                      <const float*>p[2], <const float*>p[3], <float*>p[4],
                                      <float*>p[5], <float*>gxp)
            else:
                _bn_backward_channels(<const double*>p[0], <const double*>p[1], N, C, S,
                                      <const double*>p[2], <const double*>p[3], <double*>p[4],
                                      <double*>p[5], <double*>gxp)
    finally:
        PyMem_Free(acc)
    return True


# -- the allreduce shm: one chunk summed, scaled and spread ----------------------------------

cdef enum:
    _BLOCK = 512  # elements summed at once on the stack (general rank counts)


cdef void _spread(floating** bufs, Py_ssize_t nbuf, Py_ssize_t own, Py_ssize_t lo, Py_ssize_t hi,
                  floating scale, bint scaled) noexcept nogil:
    """``s = bufs[own][i] + bufs[0][i] + bufs[1][i] + ...`` (the others in order, left to right),
    ``s *= scale`` if ``scaled``, then ``s`` stored into every buffer, for ``lo <= i < hi``."""
    cdef floating* a = bufs[own]
    cdef floating* o
    cdef floating s
    cdef floating acc[_BLOCK]
    cdef Py_ssize_t i, p, b, end, k
    if nbuf == 2:
        o = bufs[1 - own]
        if scaled:
            for i in range(lo, hi):
                s = (a[i] + o[i]) * scale
                a[i] = s
                o[i] = s
        else:
            for i in range(lo, hi):
                s = a[i] + o[i]
                a[i] = s
                o[i] = s
        return
    b = lo
    while b < hi:
        end = b + _BLOCK if b + _BLOCK < hi else hi
        k = end - b
        for i in range(k):
            acc[i] = a[b + i]
        for p in range(nbuf):
            if p != own:
                o = bufs[p]
                for i in range(k):
                    acc[i] = acc[i] + o[b + i]
        if scaled:
            for i in range(k):
                acc[i] = acc[i] * scale
        for p in range(nbuf):
            o = bufs[p]
            for i in range(k):
                o[b + i] = acc[i]
        b = end


def sum_spread(list bufs, Py_ssize_t own, Py_ssize_t lo, Py_ssize_t hi, scale) -> bool:
    """The reducing rank's pass of the allreduce ``shm`` (:mod:`hpcdl.comm.collectives.shm`):
    elements ``[lo, hi)`` of every rank's buffer summed (``bufs[own]``'s first, then the others
    in rank order), multiplied by ``scale`` (None: not), and written into every buffer.

    The bits of NumPy's ``acc = bufs[own][lo:hi]; np.add(acc, bufs[p][lo:hi], out=acc)`` for
    each other ``p`` in order, ``np.multiply(acc, dtype(scale), out=acc)``, then the copies.

    Returns:
        False (nothing written) unless ``bufs`` are 1-D float32 or float64 arrays of one
        dtype and size, C-contiguous, aligned and writeable, and ``0 <= lo <= hi <= size``.
    """
    cdef Py_ssize_t n = len(bufs), p, size
    cdef int t
    cdef void** ptrs
    cdef bint scaled = scale is not None
    cdef double factor = 1.0 if scale is None else <double>scale
    if n < 1 or not 0 <= own < n:
        return False
    t = _float_type(bufs[0])
    if t < 0:
        return False
    size = cnp.PyArray_SIZE(<cnp.ndarray>bufs[0])
    if not 0 <= lo <= hi <= size:
        return False
    for p in range(n):
        if not _like(bufs[p], t, size, True) or cnp.PyArray_NDIM(<cnp.ndarray>bufs[p]) != 1:
            return False
    ptrs = <void**>PyMem_Malloc(n * sizeof(void*))
    if ptrs == NULL:
        raise MemoryError()
    try:
        for p in range(n):
            ptrs[p] = _data(bufs[p])
        if t == cnp.NPY_FLOAT:
            with nogil:
                _spread(<float**>ptrs, n, own, lo, hi, <float>factor, scaled)
        else:
            with nogil:
                _spread(<double**>ptrs, n, own, lo, hi, factor, scaled)
    finally:
        PyMem_Free(ptrs)
    return True
