# cython: boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False, language_level=3
"""Fused element-wise passes of the training step: SGD and Adam updates, ReLU.

Each NumPy expression of the code these kernels replace is a pass over memory, often into a
temporary; here each update is one pass, without the GIL, on float32 or float64
(``cython.floating``) C-contiguous arrays.

**Same numbers.** The kernels compute what the NumPy code computes, bit for bit: the same
operations in the same order in the array's precision (a Python float scalar is rounded to
the array's dtype first, as NumPy does with a float32 array, and each intermediate is rounded
where NumPy stores its temporary). The module is compiled with ``-ffp-contract=off`` so that
no multiply and add are fused into one FMA (``setup.py``).

**Coverage.** Every kernel returns False, having written nothing, when an array is not a
plain native-order ``numpy.ndarray`` of the one dtype (float32 or float64; bool for masks),
C-contiguous and aligned, of the expected size, writeable where written: the caller then
takes its array-module (NumPy or CuPy) path. :func:`takes` is that check for one array.
"""

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
    """``mask = x > 0`` and ``y = maximum(x, 0)`` in one pass (``y`` may be ``x``).

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
    """``gx = gy * mask`` in one pass (``gx`` may be ``gy``; ``mask`` of gy's shape).

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
