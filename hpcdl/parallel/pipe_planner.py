"""The hybrid pipeline planner: partition, replicas per stage and microbatch cut, exactly.

Pure (docs/design.md's "plans are data"): per-layer costs, the network's α-β numbers and
N are handed in; nothing here runs a model or communicates.

**The cost model.** Layers ``l = 0 .. n-1`` with forward + backward seconds ``τ_l(b)`` at a
microbatch of b samples, output bytes ``o_l`` at the reference microbatch of ``batch`` samples,
``P_l`` parameters of ``itemsize`` bytes. A plan cuts the layers into p contiguous stages, gives
stage s ``r_s`` replicas (``Σ r_s = N``, every ``r_s`` divides m) and the global batch B
into m microbatches of ``b = B / m`` samples (an integer). With ``σ = b / batch``::

    t_s    = Σ_{l ∈ s} τ_l(b)  (+ ι b for s = 0)     one microbatch through stage s
    c_s    = β · σ · (o_in(s) + o_last(s))           the bytes a replica's send (and receive)
                                                      channel carries per microbatch
    X_s    = (m / r_s − 1) · max(t_s + κ · P_s, c_s)  the rest of a replica's m / r_s microbatches
    A_s    = 2 (α + β · σ · o_last(s))   (s < p−1)   its activation forward, gradient back
    Y_s    = allreduce(r_s, itemsize · Σ_{l ∈ s} P_l)
    allreduce(r, x) = 2 (r − 1) / r · x · β_ar + 2 (r − 1) · α_ar    (ring; 0 when r = 1)

    step   = Σ_s t_s  +  max_s X_s  +  Σ_{s<p−1} A_s  +  max_s Y_s

the first microbatch's way through every stage (fill and drain), the busiest replica's
remaining microbatches, each boundary crossed once forward and once backward on the
critical path, and the stages' concurrent gradient allreduces after the last backward.
``o_in(s)`` is the output of the layer before the stage (0 for the first stage: its input
is local), ``o_last(s)`` its own last layer's (0 for the last stage). A replica's
remaining microbatches are paced by the slower of its two resources: the core, which
gathers each microbatch's input samples (the first stage: ``ι`` seconds a sample,
``CostModel.input_s``), computes them and adds each one's gradients (``κ`` seconds a parameter,
``CostModel.accumulate_s``) to the sum it keeps, and its network channels, each of which
carries every microbatch's activations one way and gradients the other (sends are
nonblocking and overlap compute: a full-duplex NIC's two directions are separate
channels). Unreplicated equal stages give GPipe's ``(m + p − 1) t``; one stage of N
replicas gives ``(m / N) t``. GPipe and 1F1B take the same time; they differ in memory: a
replica of stage s holds ``h_s`` microbatches' activations, ``h_s = m / r_s`` (GPipe) or
``min(p − s, m / r_s)`` (1F1B), and a plan fits when ``h_s · σ · Σ_{l ∈ s} o_l ≤ limit``
for every stage (limit 0: no limit).

**Layer costs at a microbatch size.** ``τ_l`` is measured at ``batch`` and, optionally, at more
sizes (``CostModel.sizes``); between two measured sizes it is interpolated linearly, above the
largest it grows at the last segment's slope (a layer's marginal cost a sample; with one size,
in proportion), and a per-call cost shows as the intercept — so a larger microbatch costs less
a sample, as BLAS and the per-call overheads make it. Below the smallest measured size the
cost a sample is unknown and grows, and a linear extrapolation would always pick the smallest
microbatch: the planner and its baselines consider microbatches of at least the smallest
measured size only (:func:`microbatch_counts`; the whole batch in one microbatch when it is
smaller), and :func:`predict` below it scales the smallest size's cost in proportion.

**The search, and why it is exact.** ``Σ_s t_s = Σ_l τ_l(b)`` depends on m alone.
The rest, ``max X + max Y + Σ A``, is searched over rectangles ``[X_a, X_b] × [Y_a, Y_b]``
of thresholds taken from the finite sets of values X and Y any (segment, replicas) pair
takes (one set each per m); a rectangle stands for the plans whose own ``(max X, max Y)``
lies in it, and its plans take at least ``Σ t + max(X_a, W / N − Σ t) + Y_a + Σ A``: with
``W = (B / batch) Σ_l (f_l + w_l)`` all the work of a step, the replicas' busy times
``(m / r_s) t_s`` add up over the N ranks to ``m Σ_s t_s = W``, so the busiest one's is at
least ``W / N``, and so is ``Σ t + max X`` (X_s is at least ``(m / r_s − 1) t_s``; W is m Σ t,
one per m). Rectangles of every m are taken lowest bound
first, starting from the best of :func:`baselines` as the best step found. A rectangle is
first cut down: ``X_b`` and ``Y_b`` to where, with the other's bound, the step reaches the
best found, and ``X_a`` and ``Y_a`` to the least thresholds at which a relaxation admits a
plan — some partition into stages allowed at the thresholds (``X_s ≤ X*``, ``Y_s ≤ Y*``,
memory at depth 1) whose least replica counts add up to at most N, and some whose most add
up to at least N, as a plan's partition does — a program over layers alone, bisected over
the thresholds. Then a dynamic program over (first layer of the remaining stages, stages
after it, ranks used) — stages built from the last layer back, so a stage's 1F1B depth
``p − s`` is bounded by the DP's stage count — gives the least ``Σ A`` over plans whose every
stage has ``X_s ≤ X_b``, ``Y_s ≤ Y_b`` and fits in memory, and one such plan P with its own
``(x, y)``. Every plan in the rectangle with max X ≥ x and max Y ≥ y takes at least as long
as P (its ``Σ A`` is no smaller), so two rectangles remain: max X below x, and max X from x
with max Y below y, each with P's ``Σ A`` as a bound on theirs. The search stops when the
lowest bound reaches the best step found: every cut is by a bound, not a heuristic, so the
result is the optimum. The DP's rank dimension is a NumPy vector, one shift per allowed
replica count.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from hpcdl.errors import ConfigError
from hpcdl.parallel.pipe_plan import LayerInfo, balance_by_cost

__all__ = [
    "CostModel",
    "Network",
    "Plan",
    "baselines",
    "MAX_MICROBATCHES",
    "memory",
    "microbatch_counts",
    "plan",
    "predict",
]

_SCHEDULES = ("gpipe", "1f1b")
#: the most microbatches a step may have: the executor's message tags (``pipe_exec.message_tag``,
#: 2 m of them for GPipe and 1F1B) stay below MPI's guaranteed 32,767
MAX_MICROBATCHES = (2**15 - 1) // 2


@dataclass(frozen=True)
class Network:
    """α-β costs: a point-to-point transfer ``alpha + beta · bytes``; an allreduce over r ranks
    (ring) ``2 (r − 1) / r · bytes · allreduce_beta + 2 (r − 1) · allreduce_alpha``
    (the transfer's numbers when not given)."""

    alpha: float = 0.0
    beta: float = 0.0
    allreduce_alpha: float | None = None
    allreduce_beta: float | None = None

    def transfer(self, nbytes: float) -> float:
        """One message of ``nbytes``."""
        return self.alpha + self.beta * nbytes

    def ring(self) -> tuple[float, float]:
        """The allreduce's α and β."""
        a = self.alpha if self.allreduce_alpha is None else self.allreduce_alpha
        b = self.beta if self.allreduce_beta is None else self.allreduce_beta
        return a, b

    def allreduce(self, ranks: int, nbytes: float) -> float:
        """A ring allreduce of ``nbytes`` over ``ranks`` ranks (0 for one rank)."""
        if ranks <= 1:
            return 0.0
        a, b = self.ring()
        return 2 * (ranks - 1) / ranks * nbytes * b + 2 * (ranks - 1) * a


@dataclass(frozen=True)
class CostModel:
    """The planner's inputs but N and B: costs per layer at ``batch`` samples, the network,
    the schedule (``gpipe`` or ``1f1b``), a per-rank activation limit in bytes (0: none), the
    bytes of one parameter, each layer's forward + backward seconds at more microbatch sizes
    (``sizes``: ``(samples, (τ_0, …, τ_{n-1}))`` pairs; the module's "layer costs") and the
    seconds a replica takes to add one parameter's gradient into its sum (``accumulate_s``) and
    the first stage's to gather one input sample (``input_s``)."""

    layers: tuple[LayerInfo, ...]
    batch: int
    network: Network = Network()
    schedule: str = "1f1b"
    memory_limit: float = 0
    itemsize: int = 4
    sizes: tuple[tuple[int, tuple[float, ...]], ...] = ()
    accumulate_s: float = 0.0
    input_s: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        object.__setattr__(self, "sizes", tuple((int(b), tuple(map(float, t))) for b, t in self.sizes))
        if self.schedule not in _SCHEDULES:
            raise ConfigError(
                f"the planner knows the schedules {', '.join(_SCHEDULES)}, not {self.schedule!r}"
            )
        if not self.layers or self.batch < 1:
            raise ConfigError(f"the planner needs layers and a reference batch >= 1 (got {self.batch})")
        seen = {self.batch}
        for b, times in self.sizes:
            if b < 1 or b in seen or len(times) != len(self.layers) or min(times, default=0.0) < 0:
                raise ConfigError(
                    f"the planner's costs at {b} samples must be {len(self.layers)} seconds >= 0, one per "
                    "layer, at a size >= 1 measured once"
                )
            seen.add(b)
        if self.accumulate_s < 0 or self.input_s < 0:
            raise ConfigError(
                f"the planner's accumulate_s and input_s must be >= 0 (got {self.accumulate_s}, "
                f"{self.input_s})"
            )
        points = sorted([(self.batch, tuple(x.forward_s + x.backward_s for x in self.layers)), *self.sizes])
        object.__setattr__(self, "_bs", np.array([b for b, _ in points], dtype=float))
        times = np.array([t for _, t in points], dtype=float).reshape(len(points), -1)
        object.__setattr__(self, "_ts", times)

    @property
    def smallest(self) -> int:
        """The smallest microbatch the costs were measured at."""
        return int(self._bs[0])  # type: ignore[attr-defined]

    def layer_times(self, samples: float) -> np.ndarray:
        """Each layer's ``τ_l`` at a microbatch of ``samples`` (the module's "layer costs")."""
        bs, ts = self._bs, self._ts  # type: ignore[attr-defined]
        if samples <= bs[0] or len(bs) == 1:  # at or below the smallest size, or one size: in proportion
            return ts[0] * (samples / bs[0])
        if samples >= bs[-1]:
            slope = np.maximum((ts[-1] - ts[-2]) / (bs[-1] - bs[-2]), 0.0)
            return ts[-1] + slope * (samples - bs[-1])
        k = int(np.searchsorted(bs, samples))  # bs[k - 1] < samples <= bs[k]
        w = (samples - bs[k - 1]) / (bs[k] - bs[k - 1])
        return ts[k - 1] + w * (ts[k] - ts[k - 1])

    def stage_times(self, samples: float) -> np.ndarray:
        """:meth:`layer_times` with the first stage's input gather (``input_s`` a sample) on layer 0:
        what a stage's ``t_s`` sums."""
        out = self.layer_times(samples).copy()
        out[0] += self.input_s * samples
        return out


@dataclass(frozen=True)
class Plan:
    """A hybrid plan: ``balance[s]`` layers and ``replicas[s]`` ranks for stage s, the global
    batch cut into ``microbatches`` microbatches."""

    balance: tuple[int, ...]
    replicas: tuple[int, ...]
    microbatches: int
    global_batch: int

    @property
    def microbatch_size(self) -> int:
        """Samples per microbatch, B / m."""
        return self.global_batch // self.microbatches

    def __str__(self) -> str:
        return (
            f"balance = {list(self.balance)}, replicas = {list(self.replicas)}, "
            f"m = {self.microbatches} x {self.microbatch_size}"
        )


def _stages(plan: Plan) -> Iterator[tuple[int, int, int]]:
    start = 0
    for s, n in enumerate(plan.balance):
        yield s, start, start + n
        start += n


def _check_plan(model: CostModel, plan: Plan) -> None:
    m, p = plan.microbatches, len(plan.balance)
    if sum(plan.balance) != len(model.layers) or min(plan.balance) < 1:
        raise ConfigError(f"balance {list(plan.balance)} does not cut {len(model.layers)} layers")
    if len(plan.replicas) != p or min(plan.replicas) < 1 or any(m % r for r in plan.replicas):
        raise ConfigError(f"replicas {list(plan.replicas)} do not give {p} stages dividing m = {m}")
    if m < 1 or plan.global_batch % m:
        raise ConfigError(f"m = {m} does not divide the global batch {plan.global_batch}")


def _in_flight(schedule: str, depth: int, m: int, r: int) -> int:
    """Microbatches a replica holds: ``depth`` is ``p − s``."""
    return m // r if schedule == "gpipe" else min(depth, m // r)


def memory(plan: Plan, model: CostModel) -> list[float]:
    """Per stage, the activation bytes one replica holds at its peak under the model."""
    _check_plan(model, plan)
    scale = plan.microbatch_size / model.batch
    p = len(plan.balance)
    return [
        _in_flight(model.schedule, p - s, plan.microbatches, plan.replicas[s])
        * scale
        * sum(x.output_bytes for x in model.layers[a:b])
        for s, a, b in _stages(plan)
    ]


def microbatch_counts(model: CostModel, global_batch: int) -> list[int]:
    """The microbatch counts m the planner and its baselines consider (ascending): the divisors of
    the global batch whose microbatches hold at least the smallest measured size (the module's
    "layer costs"), up to :data:`MAX_MICROBATCHES`; one microbatch when the whole batch is
    smaller than that."""
    out = [
        m for m in _divisors(global_batch) if global_batch // m >= model.smallest and m <= MAX_MICROBATCHES
    ]
    return out or [1]


def _channel(model: CostModel, scale: float, i: int, j: int) -> float:
    """``c`` of a stage of layers i .. j-1: its per-microbatch channel time, each way."""
    layers, n = model.layers, len(model.layers)
    nbytes = (layers[i - 1].output_bytes if i > 0 else 0) + (layers[j - 1].output_bytes if j < n else 0)
    return model.network.beta * scale * nbytes


def predict(plan: Plan, model: CostModel) -> float:
    """The cost model's step time of ``plan`` (the module docstring's formula), memory ignored.

    Raises:
        ConfigError: the plan does not fit the layers, or m does not divide B or is not a
            multiple of every replica count.
    """
    _check_plan(model, plan)
    layers, net, m = model.layers, model.network, plan.microbatches
    scale = plan.microbatch_size / model.batch
    tau = model.stage_times(plan.microbatch_size)
    p = len(plan.balance)
    total = float(tau.sum())
    worst_x = worst_y = sends = 0.0
    for s, a, b in _stages(plan):
        r = plan.replicas[s]
        params = sum(x.params for x in layers[a:b])
        t = float(tau[a:b].sum()) + model.accumulate_s * params
        worst_x = max(worst_x, (m // r - 1) * max(t, _channel(model, scale, a, b)))
        worst_y = max(worst_y, net.allreduce(r, model.itemsize * params))
        if s < p - 1:
            sends += 2 * net.transfer(scale * layers[b - 1].output_bytes)
    return total + worst_x + sends + worst_y


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


class _Tables:
    """For one microbatch count m: every segment's X, Y and activation bytes, per replica count
    (``rs``, the divisors of m up to N, ascending: X falls and Y rises along them)."""

    def __init__(self, model: CostModel, ranks: int, global_batch: int, m: int) -> None:
        layers, net = model.layers, model.network
        self.n = n = len(layers)
        self.m, self.ranks, self.model = m, ranks, model
        scale = (global_batch // m) / model.batch
        self.rs = rs = np.array([r for r in _divisors(m) if r <= ranks])
        time = np.concatenate([[0.0], np.cumsum(model.stage_times(global_batch // m))])
        act = np.concatenate([[0.0], np.cumsum([scale * x.output_bytes for x in layers])])
        count = np.concatenate([[0.0], np.cumsum([float(x.params) for x in layers])])
        par = model.itemsize * count
        self.total = float(time[-1])
        # send[j]: a stage ending before layer j < n sends layer j-1's output, gets its gradient
        self.send = [
            2 * net.transfer(scale * layers[j - 1].output_bytes) if 0 < j < n else 0.0 for j in range(n + 1)
        ]
        seg_t = time[None, :] - time[:, None]  # [i, j]: layers i .. j-1
        seg_t = seg_t + model.accumulate_s * (count[None, :] - count[:, None])
        out = np.array([0.0] + [scale * x.output_bytes for x in layers])  # [j]: layer j-1's output
        into, away = out.copy(), out.copy()
        away[n] = 0.0  # the last stage sends nothing on; the first gets its input locally (out[0] = 0)
        seg_c = net.beta * (into[:, None] + away[None, :])  # [i, j]: c of the stage i .. j-1
        self.act = act[None, :] - act[:, None]
        self.x = (m // rs - 1)[None, None, :] * np.maximum(seg_t, seg_c)[:, :, None]  # [i, j, q]
        alpha, beta = net.ring()  # Network.allreduce's formula, term for term
        seg_p = (par[None, :] - par[:, None])[:, :, None]
        self.y = 2 * (rs - 1) / rs * seg_p * beta + 2 * (rs - 1) * alpha  # [i, j, q]; 0 at r = 1
        self.real = np.triu(np.ones((n + 1, n + 1), dtype=bool), 1)  # [i, j]: i < j, a segment
        self.depths = min(n, m) if model.schedule == "1f1b" and model.memory_limit else 1

    def lowest(self, limit: float) -> np.ndarray:
        """[d, i, j]: the first replica index fitting ``limit`` at 1F1B depth d + 1 (len(rs): none);
        non-decreasing in d."""
        q = len(self.rs)
        out = np.full((self.depths, self.n + 1, self.n + 1), 0, dtype=np.int64)
        if not limit:
            return out
        for d in range(self.depths):
            depth = d + 1 if self.depths > 1 else self.n  # GPipe: m / r whatever the depth
            held = np.array([_in_flight(self.model.schedule, depth, self.m, int(r)) for r in self.rs])
            fits = held[None, None, :] * self.act[:, :, None] <= limit
            out[d] = np.where(fits.any(axis=2), fits.argmax(axis=2), q)
        return out

    def candidates(self, values: np.ndarray, lowest: np.ndarray) -> np.ndarray:
        """The sorted distinct values of ``values[i, j, q]`` over segments and replica counts that
        fit memory at some depth."""
        keep = (np.arange(len(self.rs)) >= lowest[0][:, :, None]) & self.real[:, :, None]
        return np.unique(values[keep])

    def measure(self, found: Plan) -> tuple[float, float, float]:
        """A plan's own ``max X``, ``max Y`` and ``Σ A``, read from the tables."""
        x = y = a = 0.0
        for s, i, j in _stages(found):
            q = int(np.searchsorted(self.rs, found.replicas[s]))
            x, y, a = max(x, float(self.x[i, j, q])), max(y, float(self.y[i, j, q])), a + self.send[j]
        return x, y, a


def _dp(tab: _Tables, lowest: np.ndarray, xmax: float, ymax: float) -> tuple[float, Plan | None]:
    """Least Σ A over plans whose every stage has X_s ≤ xmax, Y_s ≤ ymax and fits memory, and
    one such plan (None: there is none).

    ``g[i, c]`` over ranks k: the least Σ A of layers i .. n-1 cut into at most c + 1 stages on
    k ranks (the last c standing for any number: past it, memory allows what it allows). A
    stage i .. j-1 at 1F1B depth c + 1 with replica index q is allowed when ``lo[c, i, j] ≤ q ≤
    hi[i, j]``: X falls as r rises, memory needs more replicas deeper (``lo``), Y rises (``hi``). It is
    followed by at most c stages, so checking its memory at depth c + 1 admits every plan of
    ``g[i, c]`` and nothing that does not fit. Stages are built from the last layer back; the
    rank dimension is a NumPy vector, shifted once per replica count.
    """
    n, N, rs = tab.n, tab.ranks, tab.rs
    nq = len(rs)
    lo = np.maximum(lowest, (tab.x > xmax).sum(axis=2))  # [c, i, j]
    hi = (tab.y <= ymax).sum(axis=2) - 1  # [i, j]
    changed = np.flatnonzero((lo[1:] != lo[:-1]).any(axis=(1, 2)))
    D = int(changed[-1]) + 2 if len(changed) else 1  # deeper allows what depth D allows
    lo = lo[:D]
    inf = math.inf
    g = np.full((n + 1, D, N + 1), inf)
    g[n, :, 0] = 0.0
    shifted = np.empty((D, nq, N + 1))  # [c, q, k]: what may follow, at k - rs[q] ranks
    qs = np.arange(nq)
    for j in range(n, 0, -1):
        top = 0 if j == n else min(D - 1, n - j)  # a stage ending at j has at most n - j after it
        u = _after(g[j], j == n)
        for q, r in enumerate(rs):
            shifted[: top + 1, q, :r] = inf
            shifted[: top + 1, q, r:] = u[: top + 1, : N + 1 - r]
        for i in range(j):
            qa, qb = lo[0, i, j], hi[i, j]
            if qa > qb:
                continue
            block = shifted[: top + 1, qa : qb + 1]
            if top:  # memory: replica indices below lo[c] do not fit at depth c + 1
                unfit = qs[None, qa : qb + 1] < lo[: top + 1, i, j, None]
                block = block + np.where(unfit, inf, 0.0)[..., None]
            np.minimum(g[i, : top + 1], block.min(axis=1) + tab.send[j], out=g[i, : top + 1])
        np.minimum.accumulate(g[j - 1], axis=0, out=g[j - 1])  # at most c + 1 stages
    value = float(g[0, D - 1, N])
    if value == inf:
        return inf, None
    balance, replicas, i, c, k = [], [], 0, D - 1, N
    while i < n:  # the plan, from its first stage: a candidate that gave g[i, c, k]
        target = g[i, c, k]
        c = int(np.argmax(g[i, : c + 1, k] == target))  # the depth it entered at
        j, q = next(
            (j, q)
            for j in range(i + 1, n + 1)
            for q in range(lo[c, i, j], hi[i, j] + 1)
            if rs[q] <= k and _after(g[j], j == n)[c, k - rs[q]] + tab.send[j] == target
        )
        c = c if j == n or D == 1 else (c - 1 if c < D - 1 else D - 1)
        balance.append(j - i)
        replicas.append(int(rs[q]))
        i, k = j, k - int(rs[q])
    return value, Plan(tuple(balance), tuple(replicas), tab.m, 0)


def _after(gj: np.ndarray, last: bool) -> np.ndarray:
    """[c, k]: what may follow a stage that ends before layer j at depth index c: nothing when
    j = n, else plans of layers j .. of at most c stages (none at c = 0; any at the last c)."""
    D = gj.shape[0]
    if last or D == 1:
        return gj
    return np.concatenate([np.full((1, gj.shape[1]), math.inf), gj[: D - 2], gj[D - 1 :]])


def _first(lo: int, hi: int, ok: Callable[[int], bool]) -> int:
    """The least index in [lo, hi] where ``ok`` holds, ``ok`` monotone and true at hi."""
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


class _Space:
    """One m's thresholds: the X and Y values a plan's max X and max Y can take (ascending),
    memory's lowest replica indices, and the work bound on max X, ``W / N − Σ t``."""

    def __init__(
        self, tab: _Tables, lowest: np.ndarray, xs: np.ndarray, ys: np.ndarray, work_x: float
    ) -> None:
        self.tab, self.lowest, self.xs, self.ys, self.work_x = tab, lowest, xs, ys, work_x
        self.tx = np.searchsorted(xs, tab.x)  # [i, j, q]: X below xs[t] iff tx <= t (falls along q)
        self.ty = np.searchsorted(ys, tab.y)  # rises along q

    def bound(self, xa: int, ya: int, a: float) -> float:
        """The least step of a plan with max X ≥ xs[xa], max Y ≥ ys[ya] and Σ A ≥ a."""
        return self.tab.total + max(float(self.xs[xa]), self.work_x) + float(self.ys[ya]) + a

    def shrink(self, xa: int, xb: int, ya: int, yb: int, room: float) -> tuple[int, int, int, int] | None:
        """The rectangle cut down to the plans that may take less than ``tab.total + room``
        (None: none may): max X and max Y above the bounds of a relaxation of the DP, and below
        where, with the other's bound, they reach ``room``."""
        xs, ys = self.xs, self.ys

        def caps(xa: int, ya: int) -> tuple[int, int]:  # last indices below room with the other's bound
            xcap = int(np.searchsorted(xs, room - float(ys[ya]))) - 1
            ycap = int(np.searchsorted(ys, room - max(float(xs[xa]), self.work_x))) - 1
            return min(xb, xcap), min(yb, ycap)

        xb, yb = caps(xa, ya)
        first = self._first(0, xa, xb, yb)
        if first is None:
            return None
        xa = first
        xb, yb = caps(xa, ya)
        first = self._first(1, ya, yb, xb)
        if first is None:
            return None
        ya = first
        xb, yb = caps(xa, ya)
        return (xa, xb, ya, yb) if xa <= xb and ya <= yb else None

    def _first(self, axis: int, a: int, b: int, other: int) -> int | None:
        """The least threshold index t in [a, b] of X (axis 0; Y at most ys[other]) or Y (axis 1;
        X at most xs[other]) at which the relaxation (:meth:`_fits`) has a plan (it has one at
        every larger t: the allowed stages and replica counts only grow), by bisection."""
        if a > b or not self._fits(axis, b, other):
            return None
        return _first(a, b, lambda t: self._fits(axis, t, other))

    def _fits(self, axis: int, t: int, other: int) -> bool:
        """Whether some partition into stages allowed at the thresholds ``(t, other)`` (axis 0) or
        ``(other, t)`` (axis 1), memory at depth 1, has least replica counts adding up to at
        most N, and some has most adding up to at least N: a plan's partition does both, so
        where this fails no plan is (the DP without its rank dimension, relaxed)."""
        tab, memory = self.tab, self.lowest[0]
        n, rs = tab.n, tab.rs
        xb, yb = (t, other) if axis == 0 else (other, t)
        lo = np.maximum(memory, (self.tx > xb).sum(axis=2))  # [i, j]
        hi = (self.ty <= yb).sum(axis=2) - 1
        allowed = (lo <= hi) & tab.real
        fewest = np.where(allowed, rs[np.minimum(lo, len(rs) - 1)], math.inf)
        most = np.where(allowed, rs[np.maximum(hi, 0)], -math.inf)
        few, many = np.zeros(n + 1), np.zeros(n + 1)  # [i]: over layers i .., least and most sums
        for i in range(n - 1, -1, -1):
            few[i] = (fewest[i, i + 1 :] + few[i + 1 :]).min()
            many[i] = (most[i, i + 1 :] + many[i + 1 :]).max()
        return bool(few[0] <= tab.ranks <= many[0])


def _search(tabs: list[_Tables], best: float) -> tuple[float, Plan | None]:
    """The least step over the m of ``tabs`` and its plan if below ``best`` (else ``best`` and
    None): rectangles of thresholds, lowest bound first (see the module)."""
    found = None
    spaces: list[_Space] = []
    # bound, order, space, rectangle xa, xb, ya, yb (indices into its xs, ys), a bound on Σ A
    heap: list[tuple[float, int, int, int, int, int, int, float]] = []

    order = itertools.count()  # ties in the bound go first in, first out

    def push(k: int, xa: int, xb: int, ya: int, yb: int, a: float) -> None:
        if xa <= xb and ya <= yb:
            low = spaces[k].bound(xa, ya, a)
            if low < best:
                heapq.heappush(heap, (low, next(order), k, xa, xb, ya, yb, a))

    for tab in tabs:
        lowest = tab.lowest(tab.model.memory_limit)
        xs, ys = tab.candidates(tab.x, lowest), tab.candidates(tab.y, lowest)
        if len(xs):  # rounding must not lift the work bound over a plan's own step
            work = tab.m * tab.total  # W: the m microbatches' layer work, over the N ranks
            spaces.append(_Space(tab, lowest, xs, ys, work / tab.ranks * (1 - 1e-12) - tab.total))
            push(len(spaces) - 1, 0, len(xs) - 1, 0, len(ys) - 1, 0.0)
    while heap:
        low, _, k, xa, xb, ya, yb, a_low = heapq.heappop(heap)
        if low >= best:
            break
        sp = spaces[k]
        shrunk = sp.shrink(xa, xb, ya, yb, best * (1 + 1e-12) - sp.tab.total - a_low)
        if shrunk is None:  # no plan in the rectangle, or none below the best step
            continue
        xa, xb, ya, yb = shrunk
        a, p = _dp(sp.tab, sp.lowest, float(sp.xs[xb]), float(sp.ys[yb]))
        if p is None:  # no plan at all under (xs[xb], ys[yb]): none in the rectangle
            continue
        x, y, _ = sp.tab.measure(p)
        if sp.tab.total + x + y + a < best:
            best, found = sp.tab.total + x + y + a, p
        ix, iy = int(np.searchsorted(sp.xs, x)), int(np.searchsorted(sp.ys, y))
        push(k, xa, min(xb, ix - 1), ya, yb, a)  # max X below p's
        push(k, max(xa, ix), xb, ya, min(yb, iy - 1), a)  # max X at least p's, max Y below p's
    return best, found


def plan(model: CostModel, ranks: int, global_batch: int) -> tuple[Plan, float]:
    """The plan of least predicted step time for ``ranks`` ranks and a global batch of
    ``global_batch`` samples, and that time (exact for the module's cost model).

    Raises:
        ConfigError: no plan fits the memory limit (one line naming the least activation
            memory any plan needs), no plan exists at all (the replica counts cannot divide
            any allowed m), or fewer than one rank or sample.
    """
    if ranks < 1 or global_batch < 1:
        raise ConfigError(
            f"the planner needs ranks >= 1 and a global batch >= 1 (got {ranks}, {global_batch})"
        )
    best, found = math.inf, None
    for seed in baselines(model, ranks, global_batch).values():  # an incumbent: a bound to prune by
        if seed is not None and seed[1] < best:
            (found, best) = seed
    tabs = [_Tables(model, ranks, global_batch, m) for m in reversed(microbatch_counts(model, global_batch))]
    best, p = _search([t for t in tabs if t.total < best], best)
    if p is not None:
        found = Plan(p.balance, p.replicas, p.microbatches, global_batch)
    if found is None:
        need = _least_memory(model, ranks, global_batch)
        if need == math.inf:
            raise ConfigError(
                f"no plan of {ranks} ranks for a global batch of {global_batch} in microbatches of at least "
                f"{model.smallest} samples: each stage's replicas must divide the microbatch count and "
                f"{len(model.layers)} layers make at most {len(model.layers)} stages; use fewer ranks or a "
                "global batch with more divisors"
            )
        raise ConfigError(
            f"no plan of {ranks} ranks for a global batch of {global_batch} fits the activation limit of "
            f"{model.memory_limit / 2**20:.4g} MiB per rank; the least any plan needs is "
            f"{need / 2**20:.4g} MiB"
        )
    return found, best


def _least_memory(model: CostModel, ranks: int, global_batch: int) -> float:
    """The least, over plans, of the largest per-replica activation memory: per m, a binary
    search on the candidate values with the DP as the feasibility test."""
    best = math.inf
    for m in microbatch_counts(model, global_batch):
        tab = _Tables(_with_limit(model, 1.0), ranks, global_batch, m)  # a limit: DP keeps the 1F1B depth
        held = sorted({_in_flight(model.schedule, d, m, int(r)) for d in range(1, tab.n + 1) for r in tab.rs})
        cands = np.unique(np.multiply.outer(held, tab.act[tab.real]))

        def fits(k: int, tab: _Tables = tab, cands: np.ndarray = cands) -> bool:
            limit = float(cands[k]) or 1e-300
            return _dp(tab, tab.lowest(limit), math.inf, math.inf)[1] is not None

        if fits(len(cands) - 1):
            best = min(best, float(cands[_first(0, len(cands) - 1, fits)]))
    return best


def _with_limit(model: CostModel, limit: float) -> CostModel:
    return dataclasses.replace(model, memory_limit=limit or 1e-300)


def _best_m(
    model: CostModel, balance: Sequence[int], replicas: Sequence[int], global_batch: int
) -> tuple[Plan, float] | None:
    best = None
    for m in microbatch_counts(model, global_batch):
        if any(m % r for r in replicas):
            continue
        p = Plan(tuple(balance), tuple(replicas), m, global_batch)
        if model.memory_limit and max(memory(p, model)) > model.memory_limit:
            continue
        t = predict(p, model)
        if best is None or t < best[1]:
            best = (p, t)
    return best


def baselines(model: CostModel, ranks: int, global_batch: int) -> dict[str, tuple[Plan, float] | None]:
    """What a user would otherwise pick, each with its best m (None where it does not apply or
    does not fit): ``uniform`` (N stages of equal layer counts, no replication),
    ``time`` (N time-balanced stages, no replication), ``data`` (one stage, N replicas),
    ``replicated`` (the best d ≥ 2 with p = N / d ≥ 2 time-balanced stages of d replicas each)."""
    n = len(model.layers)
    times = [x.forward_s + x.backward_s for x in model.layers]
    out: dict[str, tuple[Plan, float] | None] = {}
    out["uniform"] = (
        _best_m(model, balance_by_cost([1.0] * n, ranks), [1] * ranks, global_batch) if ranks <= n else None
    )
    out["time"] = (
        _best_m(model, balance_by_cost(times, ranks), [1] * ranks, global_batch) if ranks <= n else None
    )
    out["data"] = _best_m(model, [n], [ranks], global_batch)
    rep = None
    for d in _divisors(ranks):
        p = ranks // d
        if d < 2 or p < 2 or p > n:
            continue
        cand = _best_m(model, balance_by_cost(times, p), [d] * p, global_batch)
        if cand is not None and (rep is None or cand[1] < rep[1]):
            rep = cand
    out["replicated"] = rep
    return out
