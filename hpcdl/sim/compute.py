"""Compute-time models: how many virtual ticks a rank's compute costs (measured, none, or a cost table).

Between two communicator calls a virtual rank's code runs for real (a *compute segment*);
the engine measures its wall time and asks the model for the ticks to charge
(:meth:`ComputeModel.segment`). A cost-table model charges nothing there and instead
charges each layer's tabled cost through the per-layer hook of :mod:`hpcdl.nn.hooks`
(:meth:`ComputeModel.layer_observer`).

Modes (:func:`make_compute`):

* ``measured``: ``ticks(measured_s / speed * straggler[rank] * jitter * contention[rank])``.
  The reductions inside collectives run in the segments, so they count as compute here.
  ``contention[rank]`` is the network file's slow-down for the number of ranks on the
  rank's node (:class:`Contention`; 1 when the file gives none): the virtual ranks run
  one at a time, each alone on a core, while real ranks of one node compute at once and
  share its memory bandwidth and caches.
* ``none``: compute takes no virtual time (pure communication studies).
* ``table:FILE``: per-layer forward/backward costs (``/ speed * straggler[rank] * jitter``),
  charged as each outermost layer starts, and the ops announced through
  :func:`hpcdl.nn.hooks.op` (K-FAC's factors, eigendecompositions, preconditioning), charged
  as each starts from the table's op rows, interpolated in their size
  (:class:`~hpcdl.store.costs.OpCosts`); everything else (loss, an elementwise optimizer
  step, packing, the reductions inside collectives) costs 0. An op the table has no row for
  stops the run (:class:`CostTableError`), as a missing layer does. ``FILE`` is a run file
  (``.h5``) with a ``profile/`` group (``profile.layers = true``), or a TOML or CSV table
  (:func:`load_cost_table` and :func:`~hpcdl.store.costs.load_op_costs` document the
  formats). Contention does not apply: a table's costs are charged as they are.

Jitter is a lognormal factor with mean 1 and relative standard deviation ``jitter``
(``sigma^2 = ln(1 + jitter^2)``, ``mu = -sigma^2 / 2``), one draw per segment (measured)
or per layer call (table), from the rank's own stream ``generator(seed, rank, "sim-jitter")``.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hpcdl.errors import ConfigError
from hpcdl.rng import generator
from hpcdl.sim.ticks import TICKS_PER_SECOND

# the table format lives with the run file (the pipeline's planner reads it too); its names stay here
from hpcdl.store.costs import CostTableError, LayerCost, OpCosts, load_cost_table, load_op_costs

if TYPE_CHECKING:
    from hpcdl.nn.hooks import LayerObserver
    from hpcdl.nn.layer import Layer

__all__ = [
    "ComputeModel",
    "Contention",
    "CostTableError",
    "LayerCost",
    "MeasuredCompute",
    "NoCompute",
    "OpCosts",
    "TableCompute",
    "load_cost_table",
    "make_compute",
    "parse_stragglers",
]

MODES = ("measured", "none", "table:FILE")


@dataclass(frozen=True)
class Contention:
    """Memory-bandwidth contention: a node's ranks compute slower when they compute at once.

    A rank on a node of ``k`` ranks has each measured segment multiplied by
    ``factors[k - 1]`` (the last entry when ``k`` is past the list), as if all the node's
    ranks always computed at the same time. Nodes are the network's: ``ranks_per_node``
    consecutive ranks, the last node holding those left over (``nranks = 10``,
    ``ranks_per_node = 4``: nodes of 4, 4 and 2 ranks); ``ranks_per_node = 0`` puts all
    ``nranks`` on one node. No factors: no contention (every factor 1).

    Attributes:
        factors: slow-down by ranks on a node, each ``>= 1`` (a network file's
            ``compute.contention``).
        ranks_per_node: consecutive ranks per node, as the network's (0: one node).
        nranks: ranks in the run.

    Raises:
        ConfigError: a factor below 1, or a negative ``ranks_per_node`` or ``nranks < 1``.
    """

    factors: tuple[float, ...] = ()
    ranks_per_node: int = 0
    nranks: int = 1

    def __post_init__(self) -> None:
        factors = tuple(_as_float(f) for f in self.factors)
        if any(not (math.isfinite(f) and f >= 1.0) for f in factors):
            raise ConfigError(f"contention factors must be numbers >= 1 ({list(self.factors)!r})")
        if self.ranks_per_node < 0 or self.nranks < 1:
            raise ConfigError(
                f"contention needs ranks_per_node >= 0 and nranks >= 1 ({self.ranks_per_node}, {self.nranks})"
            )
        object.__setattr__(self, "factors", factors)

    @classmethod
    def of_network(cls, network: Any, nranks: int) -> Contention:
        """The contention of a network model (its ``contention`` and ``ranks_per_node``) on ``nranks``."""
        return cls(tuple(getattr(network, "contention", ())), getattr(network, "ranks_per_node", 0), nranks)

    def ranks_on_node(self, rank: int) -> int:
        """How many ranks share ``rank``'s node (``rank`` included)."""
        if not 0 <= rank < self.nranks:
            raise ValueError(f"rank {rank} is outside [0, {self.nranks})")
        if self.ranks_per_node == 0:
            return self.nranks
        first = rank - rank % self.ranks_per_node
        return min(self.ranks_per_node, self.nranks - first)

    def factor(self, rank: int) -> float:
        """The factor on ``rank``'s measured compute: ``factors[min(k, len(factors)) - 1]`` for k ranks."""
        k = self.ranks_on_node(rank)
        return self.factors[min(k, len(self.factors)) - 1] if self.factors else 1.0

    def describe(self) -> dict[str, Any]:
        """The factors and which ones this run uses (by ranks on a node; none without factors), JSON-able."""
        used = {self.ranks_on_node(r): self.factor(r) for r in range(self.nranks)} if self.factors else {}
        return {
            "factors": list(self.factors),
            "ranks_per_node": self.ranks_per_node,
            "factor_by_ranks_on_node": {str(k): f for k, f in sorted(used.items())},
        }


# -- the models -------------------------------------------------------------------------------


class ComputeModel:
    """Turns a rank's compute into virtual ticks; the base of the three modes.

    Args:
        speed: device speed factor; ``> 1`` stands for a faster device (costs are divided by it).
        seed: seed of the per-rank jitter streams.
        jitter: relative standard deviation of the lognormal jitter factor (0: none).
        stragglers: slow-down factor by rank, e.g. ``{3: 2.0}`` (rank 3 twice as slow).

    Attributes:
        name: the mode as given: ``"measured"``, ``"none"`` or ``"table:<path>"``.
    """

    name = ""

    def __init__(
        self,
        *,
        speed: float = 1.0,
        seed: int = 0,
        jitter: float = 0.0,
        stragglers: Mapping[int, float] | None = None,
    ) -> None:
        self.speed = _check_speed(speed)
        self.seed = _check_seed(seed)
        self.jitter = _check_jitter(jitter)
        self.stragglers = _check_stragglers(stragglers)
        #: ranks a program slows down itself (``debug.slowdown``, :meth:`slow_down`), times their straggler
        self.slowdowns: dict[int, float] = {}
        self._sigma = math.sqrt(math.log1p(self.jitter**2))
        self._mu = -0.5 * self._sigma**2
        self._rngs: dict[int, np.random.Generator] = {}  # per rank, created on first use

    def segment(self, rank: int, measured_s: float) -> int:
        """Ticks to charge ``rank`` for a compute segment that took ``measured_s`` wall seconds."""
        return 0

    @property
    def charges_segments(self) -> bool:
        """Whether :meth:`segment` can charge anything: the engine does not call it when not."""
        return type(self).segment is not ComputeModel.segment

    def layer_observer(self, rank: int, charge: Callable[[int], None]) -> LayerObserver | None:
        """An observer for :mod:`hpcdl.nn`'s per-layer hook on ``rank`` (``None``: not used).

        Args:
            rank: the virtual rank (world rank) the observer is for.
            charge: adds ticks to the rank's virtual clock.
        """
        return None

    def describe(self) -> dict[str, Any]:
        """The model's settings, JSON-able (for the run file's attributes)."""
        return {
            "mode": self.name,
            "speed": self.speed,
            "seed": self.seed,
            "jitter": self.jitter,
            "jitter_distribution": "lognormal(mean 1, relative std = jitter)",
            "stragglers": {str(r): f for r, f in sorted(self.stragglers.items())},
        }

    def scale(self, rank: int) -> float:
        """The factor for one charge on ``rank``: ``straggler / speed`` times a jitter draw."""
        factor = self.stragglers.get(rank, 1.0) * self.slowdowns.get(rank, 1.0) / self.speed
        if self.jitter > 0.0:
            rng = self._rngs.get(rank)
            if rng is None:
                rng = self._rngs[rank] = generator(self.seed, rank, "sim-jitter")
            factor *= float(rng.lognormal(self._mu, self._sigma))
        return factor

    def slow_down(self, rank: int, factor: float) -> None:
        """Make ``rank``'s compute ``factor`` times as costly (on top of its straggler factor).

        What :func:`hpcdl.comm.slow_down` asks of a simulated world for ``debug.slowdown``:
        a table's layer costs and measured segments alike, so that a modelled straggler
        and a slowed rank behave the same.
        """
        self.slowdowns[rank] = float(factor)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, speed={self.speed}, jitter={self.jitter})"


class MeasuredCompute(ComputeModel):
    """Charges each segment its measured wall time ``/ speed * straggler * jitter * contention``.

    Args:
        contention: the slow-down of ranks sharing a node (default: none).
        **kwargs: as :class:`ComputeModel`.
    """

    name = "measured"

    def __init__(self, *, contention: Contention | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.contention = contention if contention is not None else Contention()
        # by rank, read only when some factor is not 1 (then a rank outside the contention's
        # run is an IndexError, never silently 1)
        self._contention = tuple(self.contention.factor(r) for r in range(self.contention.nranks))
        self._contended = any(f != 1.0 for f in self._contention)

    def segment(self, rank: int, measured_s: float) -> int:
        if measured_s <= 0.0:
            return 0
        factor = self.scale(rank)
        if self._contended:
            factor *= self._contention[rank]
        return round(measured_s * factor * TICKS_PER_SECOND)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "contention": self.contention.describe()}


class NoCompute(ComputeModel):
    """Compute takes no virtual time: only communication moves the clocks."""

    name = "none"

    def describe(self) -> dict[str, Any]:
        return {"mode": self.name}


class TableCompute(ComputeModel):
    """Charges each layer's tabled forward/backward cost; segments cost 0.

    A layer's cost is charged when its forward or backward *starts* (in ``before``), so
    every other observer's ``after`` for that layer (an overlapping exchange starting a
    bucket) already sees it, however the observers are nested. Only outermost layers are
    charged: a layer run inside another (a residual block's projection shortcut) is part
    of its parent's measured time, and the table may omit it. A cost measured at batch
    ``b`` is scaled by ``n / b`` for an input of ``n`` samples (evaluation batches,
    pipeline micro-batches); that linear rule ignores fixed per-call overheads.

    Ops (:func:`hpcdl.nn.hooks.op`: K-FAC's work) are charged as they start, whether inside a
    layer's call or not, from ``ops`` (:class:`~hpcdl.store.costs.OpCosts`: the seconds at the
    op's dimensions, interpolated between the measured ones), scaled like a layer's cost but
    never by the batch (an op's dimensions already say its size).

    Args:
        path: the table file (shown in errors and in :meth:`describe`).
        rows: the table, by layer name (:func:`load_cost_table`).
        ops: the table's op rows (:func:`~hpcdl.store.costs.load_op_costs`; default: none).
        **kwargs: as :class:`ComputeModel`.
    """

    def __init__(
        self, path: str | Path, rows: Mapping[str, LayerCost], ops: OpCosts | None = None, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.path = str(path)
        self.name = f"table:{self.path}"
        self.rows = dict(rows)
        self.ops = ops if ops is not None else OpCosts()
        # base costs in ticks: exact sums when nothing scales them
        self._ticks = {
            name: (round(c.forward_s * TICKS_PER_SECOND), round(c.backward_s * TICKS_PER_SECOND))
            for name, c in self.rows.items()
        }
        self._sha256 = hashlib.sha256(Path(path).read_bytes()).hexdigest() if Path(path).is_file() else ""

    def layer_observer(self, rank: int, charge: Callable[[int], None]) -> _TableObserver:
        return _TableObserver(self, rank, charge)

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "table": self.path,
            "table_sha256": self._sha256,
            "layers": len(self.rows),
            "ops": len(self.ops),
        }

    def op_cost(self, rank: int, op: str, dims: tuple[int, ...]) -> int:
        """Ticks for one call of ``op`` at ``dims`` on ``rank``.

        Raises:
            CostTableError: the table has no row for ``op``.
        """
        sec = self.ops.seconds(op, dims)
        if sec is None:
            raise CostTableError(
                f"compute table {self.path} has no row for op {op!r} (here at dims "
                f"{'x'.join(map(str, dims))}); "
                "profile this model with the same optimizer (profile.layers = true), or add [[ops]] rows "
                "(python -m hpcdl.bench ops)"
            )
        t = round(sec * TICKS_PER_SECOND)
        factor = self.scale(rank)
        return t if factor == 1.0 else round(t * factor)

    def cost(self, rank: int, phase: str, layer: Layer, x: Any) -> int:
        """Ticks for one ``phase`` call of ``layer`` on ``rank`` with input (or output gradient) ``x``.

        Raises:
            CostTableError: the table has no row for the layer, or the row is of another kind.
        """
        name = layer.name
        base = self._ticks.get(name)
        if base is None:
            raise CostTableError(
                f"compute table {self.path} has no row for layer {name!r} ({type(layer).__name__}); "
                "profile this model (a run with profile.layers = true) or add the row"
            )
        row = self.rows[name]
        if row.kind is not None and row.kind != type(layer).__name__:
            raise CostTableError(
                f"layer {name!r} is a {type(layer).__name__} here but a {row.kind} in compute table "
                f"{self.path}; the table was made for another model: profile this one"
            )
        t = base[0] if phase == "forward" else base[1]
        factor = self.scale(rank)
        shape = getattr(x, "shape", None)
        if row.batch and shape:
            factor *= shape[0] / row.batch
        return t if factor == 1.0 else round(t * factor)


class _TableObserver:
    """One rank's per-layer and op observer for :class:`TableCompute` (holds its nesting stack)."""

    def __init__(self, model: TableCompute, rank: int, charge: Callable[[int], None]) -> None:
        self.model, self.rank, self.charge = model, rank, charge
        self._open: list[tuple[str, int]] = []  # (phase, id(layer)) of the layers running

    def before(self, phase: str, layer: Layer, x: Any) -> None:
        if not self._open:
            self.charge(self.model.cost(self.rank, phase, layer, x))
        self._open.append((phase, id(layer)))

    def after(self, phase: str, layer: Layer, y: Any) -> None:
        key = (phase, id(layer))
        while self._open:  # pops to the matching entry (a layer that raised leaves no trace)
            if self._open.pop() == key:
                break

    def before_op(self, op: str, dims: tuple[int, ...]) -> None:
        self.charge(self.model.op_cost(self.rank, op, dims))

    def after_op(self, op: str, dims: tuple[int, ...]) -> None:
        pass


# -- the factory ------------------------------------------------------------------------------


def make_compute(
    spec: str,
    *,
    speed: float = 1.0,
    seed: int = 0,
    jitter: float = 0.0,
    stragglers: Mapping[int, float] | None = None,
    contention: Contention | None = None,
) -> ComputeModel:
    """The compute model named by ``spec``: ``"measured"``, ``"none"`` or ``"table:FILE"``.

    Args:
        spec: the mode (``--compute``).
        speed: device speed factor (``> 1``: faster); ignored by ``none``.
        seed: seed of the per-rank jitter streams.
        jitter: relative standard deviation of the lognormal jitter factor (0: none).
        stragglers: slow-down factor by rank (``{3: 2.0}``: rank 3 twice as slow).
        contention: the slow-down of ranks sharing a node (:meth:`Contention.of_network`);
            only ``measured`` applies it (``none`` and tables stay exact).

    Returns:
        A :class:`ComputeModel`.

    Raises:
        ConfigError: unknown mode, invalid speed/jitter/stragglers, or a table file that is
            missing or malformed (:class:`CostTableError`).
    """
    kwargs: dict[str, Any] = {"speed": speed, "seed": seed, "jitter": jitter, "stragglers": stragglers}
    spec = str(spec).strip()
    if spec == "measured":
        return MeasuredCompute(contention=contention, **kwargs)
    if spec == "none":
        return NoCompute(**kwargs)
    if spec.startswith("table:") or spec == "table":
        path = spec.partition(":")[2].strip()
        if not path:
            raise ConfigError(
                "compute 'table' needs a file: --compute table:FILE (a run file with a profile/ group, "
                "or a TOML/CSV table)"
            )
        return TableCompute(path, load_cost_table(path), load_op_costs(path), **kwargs)
    raise ConfigError(f"unknown compute model {spec!r}; use one of {', '.join(MODES)}")


def parse_stragglers(text: str) -> dict[int, float]:
    """Parse ``"RANK:FACTOR,RANK:FACTOR"`` (e.g. ``"3:2.0,7:1.5"``) into ``{3: 2.0, 7: 1.5}``.

    Raises:
        ConfigError: an item is not ``RANK:FACTOR`` with a non-negative integer rank and a
            positive factor.
    """
    out: dict[int, float] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        rank_s, sep, factor_s = item.partition(":")
        try:
            if not sep:
                raise ValueError
            rank, factor = int(rank_s), float(factor_s)
        except ValueError:
            raise ConfigError(
                f"straggler {item!r} is not RANK:FACTOR; write e.g. 3:2.0 (rank 3 twice as slow)"
            ) from None
        out[rank] = factor
    return _check_stragglers(out)


# -- validation -------------------------------------------------------------------------------


def _as_float(value: Any) -> float:
    """``float(value)``, or NaN when it is not a number (the checks then refuse it)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return float("nan")


def _check_speed(speed: float) -> float:
    s = _as_float(speed)
    if not (math.isfinite(s) and s > 0):
        raise ConfigError(
            f"compute speed must be a positive number ({speed!r}); e.g. --speed 2 for a 2x device"
        )
    return s


def _check_jitter(jitter: float) -> float:
    j = _as_float(jitter)
    if not (math.isfinite(j) and j >= 0):
        raise ConfigError(f"compute jitter must be a relative std >= 0 ({jitter!r}); e.g. 0.05 for 5%")
    return j


def _check_seed(seed: int) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
        raise ConfigError(f"compute seed must be a non-negative integer ({seed!r})")
    return int(seed)


def _check_stragglers(stragglers: Mapping[int, float] | None) -> dict[int, float]:
    out: dict[int, float] = {}
    for rank, factor in (stragglers or {}).items():
        if isinstance(rank, bool) or not isinstance(rank, int | np.integer) or rank < 0:
            raise ConfigError(f"straggler rank must be a non-negative integer ({rank!r}); e.g. {{3: 2.0}}")
        f = _as_float(factor)
        if not (math.isfinite(f) and f > 0):
            raise ConfigError(
                f"straggler factor of rank {rank} must be a positive number ({factor!r}); 2.0 = twice as slow"
            )
        out[int(rank)] = f
    return out
