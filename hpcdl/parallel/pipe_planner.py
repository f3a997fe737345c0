"""The hybrid pipeline planner: partition, replicas per stage and microbatch cut, exactly.

Pure (docs/design.md's "plans are data"): per-layer costs, the network's α-β numbers and
N are handed in; nothing here runs a model or communicates.

**The cost model.** Layers ``l = 0 .. n-1`` with forward ``f_l``, backward ``w_l`` and output
bytes ``o_l`` measured at the reference microbatch of ``batch`` samples, ``P_l``
parameters of ``itemsize`` bytes. A plan cuts the layers into p contiguous stages, gives
stage s ``r_s`` replicas (``Σ r_s = N``, every ``r_s`` divides m) and the global batch B
into m microbatches of ``b = B / m`` samples (an integer). With ``σ = b / batch``::

    t_s    = σ · Σ_{l ∈ s} (f_l + w_l)              one microbatch through stage s
    X_s    = (m / r_s − 1) · t_s                     the rest of a replica's m / r_s microbatches
    A_s    = 2 (α + β · σ · o_last(s))   (s < p−1)   its activation forward, gradient back
    Y_s    = allreduce(r_s, itemsize · Σ_{l ∈ s} P_l)
    allreduce(r, x) = 2 (r − 1) / r · x · β_ar + 2 (r − 1) · α_ar    (ring; 0 when r = 1)

    step   = Σ_s t_s  +  max_s X_s  +  Σ_{s<p−1} A_s  +  max_s Y_s

the first microbatch's way through every stage (fill and drain), the busiest replica's
remaining microbatches, each boundary crossed once forward and once backward on the
critical path, and the stages' concurrent gradient allreduces after the last backward.
Unreplicated equal stages give GPipe's ``(m + p − 1) t``; one stage of N replicas gives
``(m / N) t``. GPipe and 1F1B take the same time; they differ in memory: a replica of
stage s holds ``h_s`` microbatches' activations, ``h_s = m / r_s`` (GPipe) or
``min(p − s, m / r_s)`` (1F1B), and a plan fits when ``h_s · σ · Σ_{l ∈ s} o_l ≤ limit``
for every stage (limit 0: no limit).

**The search, and why it is exact.** ``Σ_s t_s = σ Σ_l (f_l + w_l)`` depends on m alone.
For each m (the divisors of B) the rest, ``max X + Σ A + max Y``, is found by
enumerating the two bottlenecks: for thresholds ``(X*, Y*)`` taken from the finite sets of
values ``X`` and ``Y`` any (segment, replicas) pair takes, a dynamic program over
(first layer of the remaining stages, stages after it, ranks used) — stages built from the
last layer back, so a stage's 1F1B depth ``p − s`` is the DP's stage count — gives the
least ``Σ A`` over plans whose every stage has ``X_s ≤ X*``, ``Y_s ≤ Y*`` and fits in
memory. The optimum's own ``(max X, max Y)`` is one of the pairs, where the DP finds a
``Σ A`` no larger than its own; every DP answer is a real plan whose step is at most
``Σ t + X* + Y* + Σ A``. So the least ``Σ t + X* + Y* + DP(X*, Y*)`` over pairs is the
optimum. Pairs are visited in increasing ``X*`` then ``Y*`` and the loops stop when
``Σ t + X* + Y*`` alone reaches the best step found (``Σ A ≥ 0``): a bound, not a
heuristic. The DP's rank dimension is a NumPy vector, one shift per allowed replica count.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from hpcdl.errors import ConfigError
from hpcdl.parallel.pipe_plan import LayerInfo, balance_by_cost

__all__ = ["CostModel", "Network", "Plan", "baselines", "memory", "plan", "predict"]

_SCHEDULES = ("gpipe", "1f1b")


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

    def allreduce(self, ranks: int, nbytes: float) -> float:
        """A ring allreduce of ``nbytes`` over ``ranks`` ranks (0 for one rank)."""
        if ranks <= 1:
            return 0.0
        a = self.alpha if self.allreduce_alpha is None else self.allreduce_alpha
        b = self.beta if self.allreduce_beta is None else self.allreduce_beta
        return 2 * (ranks - 1) / ranks * nbytes * b + 2 * (ranks - 1) * a


@dataclass(frozen=True)
class CostModel:
    """The planner's inputs but N and B: costs per layer at ``batch`` samples, the network,
    the schedule (``gpipe`` or ``1f1b``), a per-rank activation limit in bytes (0: none) and
    the bytes of one parameter."""

    layers: tuple[LayerInfo, ...]
    batch: int
    network: Network = Network()
    schedule: str = "1f1b"
    memory_limit: float = 0
    itemsize: int = 4

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        if self.schedule not in _SCHEDULES:
            raise ConfigError(
                f"the planner knows the schedules {', '.join(_SCHEDULES)}, not {self.schedule!r}"
            )
        if not self.layers or self.batch < 1:
            raise ConfigError(f"the planner needs layers and a reference batch >= 1 (got {self.batch})")


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


def predict(plan: Plan, model: CostModel) -> float:
    """The cost model's step time of ``plan`` (the module docstring's formula), memory ignored.

    Raises:
        ConfigError: the plan does not fit the layers, or m does not divide B or is not a
            multiple of every replica count.
    """
    _check_plan(model, plan)
    layers, net, m = model.layers, model.network, plan.microbatches
    scale = plan.microbatch_size / model.batch
    p = len(plan.balance)
    total = scale * sum(x.forward_s + x.backward_s for x in layers)
    worst_x = worst_y = sends = 0.0
    for s, a, b in _stages(plan):
        r = plan.replicas[s]
        t = scale * sum(x.forward_s + x.backward_s for x in layers[a:b])
        worst_x = max(worst_x, (m // r - 1) * t)
        worst_y = max(worst_y, net.allreduce(r, model.itemsize * sum(x.params for x in layers[a:b])))
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
        self.rs = np.array([r for r in _divisors(m) if r <= ranks])
        time = np.concatenate([[0.0], np.cumsum([scale * (x.forward_s + x.backward_s) for x in layers])])
        act = np.concatenate([[0.0], np.cumsum([scale * x.output_bytes for x in layers])])
        par = np.concatenate([[0.0], np.cumsum([model.itemsize * x.params for x in layers])])
        self.total = float(time[-1])
        # send[j]: a stage ending before layer j < n sends layer j-1's output, gets its gradient
        self.send = [
            2 * net.transfer(scale * layers[j - 1].output_bytes) if 0 < j < n else 0.0 for j in range(n + 1)
        ]
        seg_t = time[None, :] - time[:, None]  # [i, j]: layers i .. j-1
        self.act = act[None, :] - act[:, None]
        self.x = (m // self.rs - 1)[None, None, :] * seg_t[:, :, None]  # [i, j, q]
        self.y = np.array(
            [
                [[net.allreduce(int(r), par[j] - par[i]) for r in self.rs] for j in range(n + 1)]
                for i in range(n + 1)
            ]
        )
        self.segments = [(i, j) for i in range(n) for j in range(i + 1, n + 1)]
        self.depths = min(n, m) if model.schedule == "1f1b" and model.memory_limit else 1

    def lowest(self, limit: float) -> np.ndarray:
        """[d, i, j]: the first replica index fitting ``limit`` at 1F1B depth d + 1 (len(rs): none)."""
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
        q = np.arange(len(self.rs))
        low = lowest.min(axis=0)
        keep = np.zeros(values.shape, dtype=bool)
        for i, j in self.segments:
            keep[i, j] = q >= low[i, j]
        return np.unique(values[keep])


def _dp(tab: _Tables, lowest: np.ndarray, xmax: float, ymax: float) -> tuple[float, Plan | None]:
    """Least Σ A over plans with every X_s ≤ xmax and Y_s ≤ ymax that fit memory; one such plan.

    ``f[i][d]`` over ranks k: the least Σ A of layers i .. n-1 cut into stages (d + 1 of them,
    the last depth standing for all deeper) on k ranks. A stage i .. j-1 with replica index q
    is allowed when ``lo ≤ q ≤ hi``: X falls with r (``lo`` from xmax and memory), Y rises
    (``hi`` from ymax), so the allowed replica counts are an interval.
    """
    n, N, rs, depths = tab.n, tab.ranks, tab.rs, tab.depths
    nq = len(rs)
    lo_x = np.where((tab.x <= xmax).any(axis=2), (tab.x <= xmax).argmax(axis=2), nq)
    hi_y = np.where(tab.y <= ymax, np.arange(nq), -1).max(axis=2)
    inf = math.inf
    f: list[list[np.ndarray]] = [[] for _ in range(n + 1)]
    end = np.full(N + 1, inf)
    end[0] = 0.0
    f[n] = [end]
    shifted: list[list[np.ndarray]] = [[] for _ in range(n + 1)]  # [j][d]: (nq, N+1), row q shifted by rs[q]

    def shift(src: np.ndarray) -> np.ndarray:
        out = np.full((nq, N + 1), inf)
        for q, r in enumerate(rs):
            out[q, r:] = src[: N + 1 - r]
        return out

    shifted[n] = [shift(end)]
    how: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}  # stage end, q, next d
    for i in range(n - 1, -1, -1):
        best = [np.full(N + 1, inf) for _ in range(depths)]
        how_j = [np.zeros(N + 1, dtype=np.int64) for _ in range(depths)]
        how_q = [np.zeros(N + 1, dtype=np.int64) for _ in range(depths)]
        how_d = [np.zeros(N + 1, dtype=np.int64) for _ in range(depths)]
        for j in range(i + 1, n + 1):
            hi = hi_y[i, j]
            for dprev, mat in enumerate(shifted[j]):
                depth = 0 if j == n else dprev + 1  # this stage's p − s, minus one
                d = min(depth, depths - 1)
                lo = max(lo_x[i, j], lowest[d, i, j])
                if lo > hi:
                    continue
                block = mat[lo : hi + 1]
                q = block.argmin(axis=0)
                cand = block[q, np.arange(N + 1)] + tab.send[j]
                better = cand < best[d]
                if better.any():
                    best[d][better] = cand[better]
                    how_j[d][better] = j
                    how_q[d][better] = q[better] + lo
                    how_d[d][better] = dprev
        f[i] = best
        shifted[i] = [shift(b) for b in best]
        for d in range(depths):
            how[i, d] = (how_j[d], how_q[d], how_d[d])
    final = [f[0][d][N] for d in range(depths)]
    d = int(np.argmin(final))
    value = float(final[d])
    if value == inf:
        return inf, None
    balance, replicas, i, k = [], [], 0, N
    while i < n:
        hj, hq, hd = how[i, d]
        j, r, d = int(hj[k]), int(rs[hq[k]]), int(hd[k])
        balance.append(j - i)
        replicas.append(r)
        i, k = j, k - r
    return value, Plan(tuple(balance), tuple(replicas), tab.m, 0)


def _first(lo: int, hi: int, ok: Callable[[int], bool]) -> int:
    """The least index in [lo, hi] where ``ok`` holds, ``ok`` monotone and true at hi."""
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _staircase(
    values: np.ndarray, solve: Callable[[float], tuple[float, Plan | None]], cap: float
) -> tuple[float, Plan | None]:
    """min over thresholds v in ``values`` (ascending) of ``v + solve(v)``, where ``solve`` is
    non-increasing in v (its set of allowed plans grows): only the left end of each of its
    steps can be the minimum, found by binary search; stops once ``v + solve(inf)`` reaches
    ``cap`` or the best so far."""
    floor, _ = solve(math.inf)
    if floor == math.inf:
        return math.inf, None
    last = len(values) - 1
    idx = _first(0, last, lambda k: solve(float(values[k]))[1] is not None)
    best, found = math.inf, None
    while True:
        v = float(values[idx])
        if v + floor >= min(best, cap):
            break
        g, p = solve(v)
        if v + g < best:
            best, found = v + g, p
        if g <= floor or idx == last:
            break
        idx = _first(idx + 1, last, lambda k, g=g: solve(float(values[k]))[0] < g)
    return best, found


def _search_m(tab: _Tables, bound: float) -> tuple[float, Plan | None]:
    """The least ``Σ t + max X + max Y + Σ A`` for one m below ``bound``, and its plan: a
    staircase over X*, each step a staircase over Y*, each probe a DP (see the module)."""
    lowest = tab.lowest(tab.model.memory_limit)
    xs = tab.candidates(tab.x, lowest)
    ys = tab.candidates(tab.y, lowest)
    if not len(xs):
        return math.inf, None

    def inner(xmax: float) -> tuple[float, Plan | None]:
        return _staircase(ys, lambda ymax: _dp(tab, lowest, xmax, ymax), math.inf)  # exact h(X*): monotone

    value, found = _staircase(xs, inner, bound - tab.total)
    return tab.total + value, found


def plan(model: CostModel, ranks: int, global_batch: int) -> tuple[Plan, float]:
    """The plan of least predicted step time for ``ranks`` ranks and a global batch of
    ``global_batch`` samples, and that time (exact for the module's cost model).

    Raises:
        ConfigError: no plan fits the memory limit (one line naming the least activation
            memory any plan needs), or fewer than one rank or sample.
    """
    if ranks < 1 or global_batch < 1:
        raise ConfigError(
            f"the planner needs ranks >= 1 and a global batch >= 1 (got {ranks}, {global_batch})"
        )
    best, found = math.inf, None
    for seed in baselines(model, ranks, global_batch).values():  # an incumbent: a bound to prune by
        if seed is not None and seed[1] < best:
            (found, best) = seed
    for m in sorted(_divisors(global_batch), reverse=True):
        tab = _Tables(model, ranks, global_batch, m)
        if tab.total >= best:
            continue
        value, p = _search_m(tab, best)
        if p is not None and value < best:
            best, found = value, Plan(p.balance, p.replicas, m, global_batch)
    if found is None:
        need = _least_memory(model, ranks, global_batch)
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
    for m in _divisors(global_batch):
        tab = _Tables(_with_limit(model, 1.0), ranks, global_batch, m)  # a limit: DP keeps the 1F1B depth
        held = {_in_flight(model.schedule, d, m, int(r)) for d in range(1, tab.n + 1) for r in tab.rs}
        cands = np.unique([h * a for h in held for i, j in tab.segments for a in [tab.act[i, j]]])

        def fits(k: int, tab: _Tables = tab, cands: np.ndarray = cands) -> bool:
            limit = float(cands[k]) or 1e-300
            return _dp(tab, tab.lowest(limit), math.inf, math.inf)[1] is not None

        if fits(len(cands) - 1):
            best = min(best, float(cands[_first(0, len(cands) - 1, fits)]))
    return best


def _with_limit(model: CostModel, limit: float) -> CostModel:
    return CostModel(
        model.layers, model.batch, model.network, model.schedule, limit or 1e-300, model.itemsize
    )


def _best_m(
    model: CostModel, balance: Sequence[int], replicas: Sequence[int], global_batch: int
) -> tuple[Plan, float] | None:
    best = None
    for m in _divisors(global_batch):
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
