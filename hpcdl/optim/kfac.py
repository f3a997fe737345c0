"""K-FAC: Kronecker-factored approximate curvature (Martens & Grosse 2015; KFC, Grosse & Martens
2016, for convolutions), one process. Its distribution is :mod:`hpcdl.parallel.kfac`'s: nothing
here communicates.

**Conventions.** B is the batch, T a convolution's output positions, ā the layer's input with
a 1 appended when the layer has a bias (a convolution's ā is its im2col patch, one per output
position), s the layer's output and g = B · ∂L/∂s the per-sample gradient of s when L is the
batch-mean loss. Per covered layer (``Linear`` and ``Conv2d``, with or without bias)::

    Linear:  A = (1/B) Σ_i ā_i ā_iᵀ          G = (1/B) Σ_i g_i g_iᵀ
    Conv2d:  A = (1/(B T)) Σ_i,t ā_it ā_itᵀ   G = (1/(B T)) Σ_i,t g_it g_itᵀ

(kfac-pytorch divides a convolution's a and g by T before the covariance; these are the
formulas here.) Factors are collected through the per-layer hook (:mod:`hpcdl.nn.hooks`, a
``nested`` observer: it reaches the convolutions inside residual blocks) on the steps where
``t mod factor_every = 0``, as the mean over the step's micro-steps when gradients accumulate,
into running averages ``F ← decay · F + (1 − decay) · F_batch`` (the first collection sets F;
``factor_decay = 0`` keeps the last batch's). Factors accumulate in the model's dtype.

**Ops.** Each factor's computation, eigendecomposition and preconditioning is announced to the
layer observers as an op (:func:`hpcdl.nn.hooks.op`: ``"factor"`` of ``(rows, d)``, ``"eigh"``
of ``(n,)``, ``"precondition"`` of ``(d_out, d_in)``), so that a profile records them and the
simulator's cost tables charge them; folding the factors, KL clipping and the update are
elementwise and, like SGD's update, not announced.

**The step** (``t mod inv_every = 0`` decomposes: collect → decompose → precondition, so step
0 is preconditioned): eigendecompositions ``A = Q_A diag(λ_A) Q_Aᵀ``, ``G = Q_G diag(λ_G)
Q_Gᵀ``, computed in float64 (``numpy.linalg.eigh`` / ``cupy.linalg.eigh``) with negative
eigenvalues of rounding clamped to 0, and kept in the model's dtype (the preconditioning's
products run in it). The preconditioned gradient of the layer's weight matrix W (a
convolution's ``(out, in · kh · kw)``, the bias its last column) is::

    P = Q_G [(Q_Gᵀ ∇W Q_A) / (λ_G λ_Aᵀ + damping)] Q_Aᵀ

KL clipping (``kl_clip > 0``, as kfac-pytorch): every P scaled by ``ν = min(1, sqrt(kl_clip /
|lr² Σ_layers ⟨P, ∇W⟩|))``. Then SGD's update with momentum and weight decay on every
parameter, P taking the place of a covered layer's gradient; the layers K-FAC does not cover
(BatchNorm, ...) take SGD's update alike.

**State** (:meth:`state_dict`): SGD's momentum buffers and counters, and per covered layer
``kfac/<layer name>/A`` and ``G`` (the running factors), ``QA``, ``dA``, ``QG``, ``dG`` (the
eigenbases and eigenvalues in use), so a resumed run is bitwise an uninterrupted one. A
checkpoint stores them in its piece's ``kfac`` group: ``/pieces/<piece>/kfac/<layer>/A``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hpcdl.backend import get_array_module, to_numpy
from hpcdl.errors import HpcdlError
from hpcdl.nn import hooks
from hpcdl.nn.conv import Conv2d
from hpcdl.nn.layer import Layer
from hpcdl.nn.linear import Linear
from hpcdl.nn.parameter import Parameter
from hpcdl.optim.optimizer import Optimizer
from hpcdl.optim.sgd import SGD

__all__ = ["KFAC", "KfacLayer", "covariance", "covered_layers", "eigen", "preconditioned"]


def covered_layers(model: Layer) -> list[Layer]:
    """The ``Linear`` and ``Conv2d`` layers of ``model``, inside blocks too, in definition order."""
    out: list[Layer] = []

    def visit(layer: Layer) -> None:
        if isinstance(layer, (Linear, Conv2d)):
            out.append(layer)
        for child in layer.children():
            visit(child)

    visit(model)
    return out


@dataclass
class KfacLayer:
    """One covered layer's K-FAC state.

    Attributes:
        layer: the layer.
        name: its dotted name (the checkpoint's ``kfac/<name>``).
        A: the running input factor, ``(d_in, d_in)`` (``d_in`` counts the bias's 1); None
            before the first collection.
        G: the running output-gradient factor, ``(d_out, d_out)``.
        QA, dA, QG, dG: the eigenbases and eigenvalues the preconditioning uses (None
            before the first decomposition).
        batch_A, batch_G: this step's sums over its micro-steps (None when nothing was
            collected), and ``micro`` how many micro-steps they hold.
        grad: the preconditioned gradient matrix of the step (``(d_out, d_in)``), or None.
    """

    layer: Layer
    name: str
    A: Any = None
    G: Any = None
    QA: Any = None
    dA: Any = None
    QG: Any = None
    dG: Any = None
    batch_A: Any = None
    batch_G: Any = None
    micro: int = 0
    grad: Any = field(default=None, repr=False)

    @property
    def bias(self) -> bool:
        return self.layer.bias is not None

    @property
    def dims(self) -> tuple[int, int]:
        """``(d_in, d_out)``: the factors' sizes (the bias's 1 counted in ``d_in``)."""
        w = self.layer.weight.data
        return int(np.prod(w.shape[1:])) + int(self.bias), int(w.shape[0])

    def gradient(self) -> Any:
        """∇W as one matrix ``(d_out, d_in)``, the bias gradient its last column."""
        w = self.layer.weight
        g = w.grad.reshape(w.shape[0], -1)
        if not self.bias:
            return g
        xp = get_array_module(g)
        return xp.concatenate([g, self.layer.bias.grad[:, None]], axis=1)

    def parameters(self) -> list[Parameter]:
        return [p for p in (self.layer.weight, self.layer.bias) if p is not None]


class _Collector:
    """The ``nested`` layer observer that adds each covered layer's ā āᵀ and g gᵀ to its step's sums."""

    nested = True

    def __init__(self, kfac: KFAC) -> None:
        self.kfac = kfac

    def before(self, phase: str, layer: Layer, x: Any) -> None:
        if phase == "backward" and self.kfac.collecting:
            entry = self.kfac.by_layer.get(id(layer))
            if entry is not None:
                t0 = self.kfac.clock()
                rows = x.shape[0] * (x.shape[2] * x.shape[3] if x.ndim == 4 else 1)  # B or B*T
                with hooks.op("factor", rows, entry.dims[1]):
                    _add(entry, "batch_G", _g_factor(layer, x))
                self.kfac.seconds["factors"] += self.kfac.clock() - t0

    def after(self, phase: str, layer: Layer, y: Any) -> None:
        if phase == "forward" and self.kfac.collecting:
            entry = self.kfac.by_layer.get(id(layer))
            if entry is not None:
                t0 = self.kfac.clock()
                a = _a_rows(layer)  # B, in or B*T, C*kh*kw
                with hooks.op("factor", a.shape[0], entry.dims[0]):
                    _add(entry, "batch_A", _a_factor(layer, a))
                entry.micro += 1
                self.kfac.seconds["factors"] += self.kfac.clock() - t0


def _add(entry: KfacLayer, attr: str, value: Any) -> None:
    held = getattr(entry, attr)
    if held is None:
        setattr(entry, attr, value)
    else:
        held += value


def _a_rows(layer: Layer) -> Any:
    """A Linear's cached input (B, in), or a convolution's input windows (B*T, C*kh*kw)."""
    return layer._x if isinstance(layer, Linear) else layer.windows()


def _a_factor(layer: Layer, a: Any) -> Any:
    """(1/B) Σ ā āᵀ of a Linear's cached input, (1/(B T)) Σ ā āᵀ of a convolution's im2col patches
    (``a``: :func:`_a_rows`)."""
    xp = get_array_module(a)
    if layer.bias is not None:
        a = xp.concatenate([a, xp.ones((a.shape[0], 1), dtype=a.dtype)], axis=1)
    return covariance(a)


def covariance(a: Any) -> Any:
    """``(1/rows) aᵀ a`` of ``a`` ``(rows, d)``: one factor (the op ``"factor"`` of ``(rows, d)``)."""
    return (a.T @ a) / a.dtype.type(a.shape[0])


def _g_factor(layer: Layer, gy: Any) -> Any:
    """(1/B) Σ g gᵀ with g = B · ∂L/∂s (``gy`` is ∂L/∂s): B · gyᵀ gy for a Linear; for a
    convolution (1/(B T)) Σ_i,t g_it g_itᵀ = (B / T) · Σ_i,t gy_it gy_itᵀ."""
    if isinstance(layer, Linear):
        b = gy.shape[0]
        return (gy.T @ gy) * gy.dtype.type(b)
    xp = get_array_module(gy)
    b, o = gy.shape[0], gy.shape[1]
    t = gy.shape[2] * gy.shape[3]
    g2 = xp.ascontiguousarray(gy.transpose(0, 2, 3, 1)).reshape(b * t, o)  # B*T, O
    return (g2.T @ g2) * gy.dtype.type(b / t)


class KFAC(Optimizer):
    """K-FAC over a model's ``Linear`` and ``Conv2d`` layers, SGD's update on the rest (module docstring).

    Args:
        model: the model (its layers are observed; its parameters updated).
        lr: the learning rate.
        momentum: SGD's momentum.
        weight_decay: SGD's L2 weight decay.
        damping: added to every ``λ_G λ_A`` (> 0).
        factor_decay: the running average's decay in [0, 1).
        factor_every: collect factors on steps ``t mod factor_every = 0``.
        inv_every: decompose on steps ``t mod inv_every = 0`` (a multiple of ``factor_every``
            is typical; at least ``factor_every``).
        kl_clip: KL clipping's bound (0: off).

    Raises:
        ValueError: damping ≤ 0, ``inv_every < factor_every``, a decay outside [0, 1), or a
            model without a covered layer.
    """

    #: K-FAC preconditions whole layers: it cannot be split into shards of parameters
    elementwise = False
    #: a checkpoint's piece keeps the ``kfac/...`` arrays in a group of their own
    state_groups = ("kfac",)

    def __init__(
        self,
        model: Layer,
        lr: float,
        *,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        damping: float = 1e-3,
        factor_decay: float = 0.95,
        factor_every: int = 1,
        inv_every: int = 10,
        kl_clip: float = 1e-3,
    ) -> None:
        if not damping > 0:
            raise ValueError(f"kfac.damping must be > 0 (got {damping})")
        if factor_every < 1 or inv_every < factor_every:
            raise ValueError(
                f"kfac.inv_every = {inv_every} must be >= kfac.factor_every = {factor_every} >= 1: "
                "eigendecompositions of factors never collected in between are wasted"
            )
        if not 0 <= factor_decay < 1:
            raise ValueError(f"kfac.factor_decay must be in [0, 1) (got {factor_decay})")
        if kl_clip < 0:
            raise ValueError(f"kfac.kl_clip must be >= 0 (got {kl_clip})")
        params = model.parameters()
        super().__init__(params, lr)
        self.sgd = SGD(params, lr, momentum=momentum, weight_decay=weight_decay)
        self.state = self.sgd.state
        self.damping, self.factor_decay = float(damping), float(factor_decay)
        self.factor_every, self.inv_every, self.kl_clip = int(factor_every), int(inv_every), float(kl_clip)
        self.layers = [KfacLayer(layer, layer.name) for layer in covered_layers(model)]
        if not self.layers:
            raise ValueError("K-FAC needs a Linear or Conv2d layer; the model has none")
        self.by_layer = {id(e.layer): e for e in self.layers}
        self.observer = _Collector(self)
        #: the clock of :attr:`seconds`: a monotonic counter here; a distributed step hands in
        #: ``hpcdl.comm.wtime`` (virtual in the simulator), so that all of K-FAC's times share one clock
        self.clock: Callable[[], float] = time.perf_counter
        #: seconds spent so far (for benchmarks): collecting factors (in forward and backward),
        #: folding them, decomposing, preconditioning, updating
        self.seconds = dict.fromkeys(("factors", "fold", "decompose", "precondition", "update"), 0.0)

    # -- when ----------------------------------------------------------------------------
    @property
    def collecting(self) -> bool:
        """This step collects factors (``t mod factor_every = 0``)."""
        return self.t % self.factor_every == 0

    @property
    def inverting(self) -> bool:
        """This step decomposes the factors (``t mod inv_every = 0``)."""
        return self.t % self.inv_every == 0

    # -- the pieces of a step (a distributed step calls them in its own order) ----------
    def batch_factors(self) -> list[Any]:
        """This step's factors, ``[A_0, G_0, A_1, G_1, ...]`` (each the mean over the step's
        micro-steps), to be averaged over ranks in place before :meth:`update_factors`;
        [] when the step collected nothing."""
        out: list[Any] = []
        for e in self.layers:
            if e.batch_A is None or e.batch_G is None:
                return []
            if e.micro > 1:
                scale = e.batch_A.dtype.type(1.0 / e.micro)
                e.batch_A *= scale
                e.batch_G *= scale
                e.micro = 1
            out += [e.batch_A, e.batch_G]
        return out

    def update_factors(self) -> None:
        """Fold the step's factors into the running averages (the first collection sets them).

        Raises:
            HpcdlError: a factor is not finite (the same on every rank of a distributed step:
                the factors were averaged); the run stops as a non-finite loss stops it.
        """
        t0 = self.clock()
        self.batch_factors()  # means over micro-steps, if not taken yet
        decay = self.factor_decay
        for e in self.layers:
            if e.batch_A is None or e.batch_G is None:
                continue
            if e.A is None:
                e.A, e.G = e.batch_A.copy(), e.batch_G.copy()
            else:
                for running, batch in ((e.A, e.batch_A), (e.G, e.batch_G)):
                    running *= running.dtype.type(decay)
                    running += running.dtype.type(1 - decay) * batch
            e.batch_A = e.batch_G = None
            e.micro = 0
        self.seconds["fold"] += self.clock() - t0
        bad = next((e.name for e in self.layers if not _finite(e.A) or not _finite(e.G)), None)
        if bad is not None:
            raise HpcdlError(
                f"K-FAC's factors of layer {bad} are not finite at step {self.t}: stopped; the last good "
                "checkpoint is kept (lower optimizer.lr or raise kfac.damping)"
            )

    def decompose(self, index: int) -> None:
        """Eigendecompose layer ``index``'s factors (in float64; kept in the model's dtype)."""
        e = self.layers[index]
        if e.A is None:
            raise RuntimeError(f"K-FAC: layer {e.name} has no factors to decompose yet")
        t0 = self.clock()
        with hooks.op("eigh", e.A.shape[0]):
            e.QA, e.dA = eigen(e.A)
        with hooks.op("eigh", e.G.shape[0]):
            e.QG, e.dG = eigen(e.G)
        self.seconds["decompose"] += self.clock() - t0

    def precondition(self, index: int) -> Any:
        """Layer ``index``'s preconditioned gradient matrix P (kept for :meth:`apply`)."""
        e = self.layers[index]
        t0 = self.clock()
        d_in, d_out = e.dims
        with hooks.op("precondition", d_out, d_in):
            e.grad = preconditioned(e.gradient(), e.QA, e.dA, e.QG, e.dG, self.damping)
        self.seconds["precondition"] += self.clock() - t0
        return e.grad

    def apply(self) -> None:
        """KL clipping over the preconditioned gradients, then SGD's update with them in place of
        the covered layers' gradients (their ``.grad`` left as it was); ``t`` advances."""
        t0 = self.clock()
        lr = self.lr
        nu = 1.0
        if self.kl_clip > 0:
            total = sum(float(to_numpy((e.grad * e.gradient()).sum())) for e in self.layers) * lr * lr
            if total != 0:
                nu = min(1.0, math.sqrt(self.kl_clip / abs(total)))
        kept: list[tuple[Parameter, Any]] = []
        for e in self.layers:
            p = e.grad if nu == 1.0 else e.grad * e.grad.dtype.type(nu)
            w = e.layer.weight
            kept.append((w, w.grad))
            cols = w.grad.reshape(w.shape[0], -1).shape[1]
            w.grad = get_array_module(p).ascontiguousarray(p[:, :cols]).reshape(w.shape)
            if e.bias:
                kept.append((e.layer.bias, e.layer.bias.grad))
                e.layer.bias.grad = get_array_module(p).ascontiguousarray(p[:, cols])
            e.grad = None
        try:
            self.sgd.lr = lr
            self.sgd.step()
        finally:
            for param, grad in kept:
                param.grad = grad
        self.t = self.sgd.t
        self.seconds["update"] += self.clock() - t0

    def step(self) -> None:
        """One process's whole step: fold the factors, decompose when due, precondition every
        covered layer, update."""
        self.update_factors()
        if self.inverting or self.layers[0].QA is None:
            for i in range(len(self.layers)):
                self.decompose(i)
        for i in range(len(self.layers)):
            self.precondition(i)
        self.apply()

    # -- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """SGD's state and counters, and per covered layer ``kfac/<name>/{A,G,QA,dA,QG,dG}``."""
        out = self.sgd.state_dict()
        for e in self.layers:
            for attr in ("A", "G", "QA", "dA", "QG", "dG"):
                value = getattr(e, attr)
                if value is not None:
                    out[f"kfac/{e.name}/{attr}"] = to_numpy(value).copy()
        return out

    def check_state(self, state: dict[str, Any]) -> str:
        """Why ``state`` cannot be loaded ("" when it can): a state past step 0 without K-FAC's
        factors and eigenbases for every covered layer (another optimizer's)."""
        if int(state.get("t", 0)) == 0:
            return ""
        for e in self.layers:
            for attr in ("A", "G", "QA", "dA", "QG", "dG"):
                if f"kfac/{e.name}/{attr}" not in state:
                    return (
                        f"it holds no K-FAC state for layer {e.name} (saved with another optimizer): "
                        "resume with the optimizer it was saved with, or start a new run"
                    )
        return ""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned.

        Raises:
            ValueError: the state was saved for other parameters, or holds no K-FAC factors
                (a checkpoint of another optimizer) after its first step.
        """
        self.sgd.load_state_dict(state)
        self.t = self.sgd.t
        xp = get_array_module(self.params[0].data)
        dtype = self.params[0].data.dtype
        for e in self.layers:
            for attr in ("A", "G", "QA", "dA", "QG", "dG"):
                key = f"kfac/{e.name}/{attr}"
                if key in state:
                    setattr(e, attr, xp.asarray(np.asarray(state[key]), dtype=dtype))
                else:
                    setattr(e, attr, None)
        problem = self.check_state(state)
        if problem:
            raise ValueError(problem)


def _finite(factor: Any) -> bool:
    return factor is None or bool(get_array_module(factor).isfinite(factor).all())


def eigen(factor: Any) -> tuple[Any, Any]:
    """``(Q, λ)`` of a symmetric factor: ``eigh`` in float64, λ clamped at 0, both in its dtype."""
    xp = get_array_module(factor)
    lam, q = xp.linalg.eigh(factor.astype(np.float64))
    xp.maximum(lam, 0.0, out=lam)
    return xp.ascontiguousarray(q.astype(factor.dtype)), lam.astype(factor.dtype)


def preconditioned(grad: Any, qa: Any, da: Any, qg: Any, dg: Any, damping: float) -> Any:
    """``Q_G [(Q_Gᵀ ∇W Q_A) / (λ_G λ_Aᵀ + damping)] Q_Aᵀ`` of ``grad`` ``(d_out, d_in)`` (the op
    ``"precondition"``: four matrix products)."""
    v = qg.T @ grad @ qa
    v /= dg[:, None] * da[None, :] + v.dtype.type(damping)
    return qg @ v @ qa.T


def factor_sizes(model: Layer) -> Sequence[tuple[str, int, int]]:
    """Per covered layer of ``model``: its name and its factors' sizes ``(d_in, d_out)``."""
    return [(layer.name, *KfacLayer(layer, layer.name).dims) for layer in covered_layers(model)]
