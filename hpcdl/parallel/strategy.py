"""The seam between the training driver and a way of spreading training: :class:`Strategy`.

A strategy is the driver's *updater* (Chainer's ``Updater``): it owns the roles of the
ranks and the communicators it splits for them, what each rank holds, what a step is,
when ranks meet, what each step records, how the model is evaluated, and its own part of
a checkpoint. The driver (:mod:`hpcdl.driver`) owns what every strategy shares — the
config and the objects built from it, the run file, checkpoint files and ``--resume``,
stops, progress, the summary — and fires its periodic work (log flushes, evaluation,
checkpoints, the stop vote, progress) at meetings: the strategy's own, and those the
driver's work that needs every rank adds (a checkpoint, an evaluation, ``train.stop_at``:
:mod:`hpcdl.driver.loop`), so a strategy whose ranks meet rarely is never forced into a
per-step collective, and a checkpoint is never late.

Placement is data (:class:`Placement`): before anything is built, a strategy says what
each rank does and holds, which ranks read which batches, and the batch arithmetic; the
learning-rate scaling rule and the global batch use its data-parallel width, not the
world size. ``python -m hpcdl.train --plan`` prints it; checkpoints record it.

A strategy lives in one module of :mod:`hpcdl.parallel` (with the small modules of its own
it uses) and is registered in :data:`hpcdl.components.STRATEGIES` under the name
``parallel.strategy`` gives; an outside one is named by ``module:Class``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from hpcdl.comm import Communicator
from hpcdl.components import Declares, load, strategy_names, strategy_target
from hpcdl.errors import ConfigError
from hpcdl.parallel.placement import Placement, RankPlace

__all__ = [
    "Agreement",
    "FreeRunningStrategy",
    "LockstepStrategy",
    "PhaseAgreement",
    "Batches",
    "PhaseStats",
    "PlanInputs",
    "Placement",
    "RankPlace",
    "RankState",
    "RunContext",
    "StepStats",
    "Strategy",
    "check_keys",
    "crossed",
    "differing_parameters",
    "ignored_keys",
    "strategy_class",
]


def __getattr__(name: str) -> Any:
    if name == "STRATEGIES":  # moved: the registry is hpcdl.components's
        import warnings  # noqa: PLC0415

        from hpcdl import components  # noqa: PLC0415

        warnings.warn("hpcdl.parallel.strategy.STRATEGIES is hpcdl.components.STRATEGIES now",
                      DeprecationWarning, stacklevel=2)  # fmt: skip
        return components.STRATEGIES
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _reads(cls: type[Strategy], key: str) -> bool:
    """True when ``key`` is one of the keys ``cls`` declares as its own (:attr:`Strategy.keys`)."""
    return any(key == own or (own.endswith(".") and key.startswith(own)) for own in cls.keys)


def elementwise_only(cfg: Any, strategy: str, splits: str) -> None:
    """Refuse an optimizer that is not elementwise (K-FAC) under a strategy that ``splits`` the
    model's parameters (a parameter server's shards, a pipeline's stages).

    Raises:
        ConfigError: one line naming the optimizer and what to use instead.
    """
    from hpcdl.optim import elementwise  # noqa: PLC0415  (the optimizers' registry, at use)

    name = cfg["optimizer.name"]
    if not elementwise(name):
        raise ConfigError(
            f"optimizer.name = {name!r} updates whole layers, not parameter by parameter: "
            f"parallel.strategy = {strategy!r} {splits}; use parallel.strategy = 'sync'"
        )


def check_keys(cfg: Any) -> None:
    """Refuse a config that sets a key ``parallel.strategy`` cannot honour.

    Raises:
        ConfigError: one line naming the key, the strategy, why and what to set instead
            (:attr:`Strategy.cannot_honour`).
    """
    name = cfg["parallel.strategy"]
    cls = strategy_class(name)
    for key, why in cls.cannot_honour.items():
        if cfg.is_set(key):
            raise ConfigError(f"{key} = {cfg[key]!r} with parallel.strategy = {name!r}: {why}")
    if not cls.faults:
        for key in [k for k in cfg.changed() if k.startswith("fault.")]:
            raise ConfigError(
                f"{key} = {cfg[key]!r} with parallel.strategy = {name!r}: it does not model faults "
                "(hpcdl.parallel.fault); use parallel.strategy = 'local' (or 'sync', which waits)"
            )


def ignored_keys(cfg: Any) -> list[str]:
    """One line for each key of another strategy that ``cfg`` sets: this run ignores it.

    A key is another strategy's when that strategy declares it (:attr:`Strategy.keys`) and
    the running one does not, such as ``pipeline.microbatches`` under ``sync``.
    """
    name = cfg["parallel.strategy"]
    mine = strategy_class(name)
    others = [(other, strategy_class(other)) for other in strategy_names() if other != name]
    lines = []
    for key in cfg.changed():
        owners = [other for other, cls in others if _reads(cls, key)]
        if owners and not _reads(mine, key) and key not in mine.cannot_honour:
            of = " or ".join(repr(o) for o in owners)
            lines.append(
                f"{key} = {cfg[key]!r} is a key of parallel.strategy = {of}: this {name!r} run ignores it"
            )
    return lines


def crossed(before: int, now: int, period: int) -> bool:
    """True when a multiple of ``period`` lies in ``(before, now]`` (a checkpoint, an evaluation due)."""
    return period > 0 and now // period > before // period


def differing_parameters(model: Any, params: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """Up to three (name, shape) pairs in which ``model``'s parameters and a piece's differ."""
    mine = {name: tuple(p.shape) for name, p in model.named_parameters()}
    theirs = {name: tuple(a.shape) for name, a in params.items()}
    return sorted(set(mine.items()) ^ set(theirs.items()))[:3]


def strategy_class(name: str) -> type[Strategy]:
    """The strategy ``name`` selects: a registered one (:mod:`hpcdl.components`) or ``module:Class``.

    Raises:
        ConfigError: no strategy has that name, or its module cannot be imported.
    """
    cls = load(strategy_target(name))
    if not (isinstance(cls, type) and issubclass(cls, Strategy)):
        raise ConfigError(f"parallel.strategy = {name!r} names {cls!r}, which is not a hpcdl Strategy class")
    return cls


class Batches:
    """A sampler's batches one at a time, from one epoch into the next (the sampler keeps the
    position, for resume: after its ``load_state``, call :meth:`restart`)."""

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler
        self._epoch: Any = None  # the rest of the sampler's current epoch

    def next(self) -> Any:
        """The indices of the next batch."""
        if self._epoch is not None:
            for _, indices in self._epoch:
                return indices
        self._epoch = iter(self.sampler)  # the rest of the current epoch, or the next one
        _, indices = next(self._epoch)
        return indices

    def restart(self) -> None:
        """Continue from where the sampler now stands."""
        self._epoch = None


# -- what a strategy reports ---------------------------------------------------------------------


@dataclass
class StepStats:
    """What one step did on this rank (the driver keeps them until the next meeting).

    Attributes:
        loss: this rank's training loss for the step (NaN when it computed none).
        correct: correctly classified samples of its batch.
        samples: samples it trained on (0 when it reads no batches).
        lr: the learning rate it used.
        comm_s: seconds in communication.
        exposed_s: the part of ``comm_s`` that nothing overlapped (after backward).
        bytes_sent: bytes this rank has sent since the run began (a running total).
        series: this rank's values of the strategy's own per-rank series
            (:attr:`Strategy.rank_series`) for the step: a pipeline stage's bubble.
    """

    loss: float = float("nan")
    correct: int = 0
    samples: int = 0
    lr: float = float("nan")
    comm_s: float = 0.0
    exposed_s: float = 0.0
    bytes_sent: int = 0
    series: dict[str, float] = field(default_factory=dict)


@dataclass
class PhaseStats:
    """What a free-running strategy did on this rank between two meetings (:meth:`Strategy.run_until`).

    Attributes:
        comm_s: seconds in communication, waiting for messages included.
        bytes_sent: bytes this rank has sent since the run began (a running total).
        series: this rank's values of the strategy's own per-rank series
            (:attr:`Strategy.rank_series`) over the phase.
        ended: on the row rank (:attr:`Strategy.row_rank`), when each step of the phase
            ended on its clock (:func:`hpcdl.comm.wtime`); empty elsewhere.
    """

    comm_s: float = 0.0
    bytes_sent: int = 0
    series: dict[str, float] = field(default_factory=dict)
    ended: list[float] = field(default_factory=list)


@dataclass
class Agreement:
    """What the ranks agreed on at a meeting: one row per step since the last one, and the stop.

    Attributes:
        rows: per step, the global metrics (``loss``, ``train_accuracy`` and the metric
            columns the strategy declares: :attr:`Strategy.declares`), the same on every rank.
        stop_votes: how many ranks asked to stop (a signal); > 0 stops every rank.
        comm_s: seconds this rank communicated at the meeting beyond agreeing (weights
            averaged, say): counted as the last step's communication.
        bytes_sent: this rank's running total of bytes sent after the meeting, when the
            meeting sent some (None: the last step's total stands).
        tables: rows of the row groups the strategy declares (``staleness``: one row per
            applied push and shard), as columns, on rank 0.
    """

    rows: list[dict[str, float]]
    stop_votes: int
    comm_s: float = 0.0
    bytes_sent: int | None = None
    tables: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass
class PhaseAgreement(Agreement):
    """A free-running strategy's meeting (:meth:`FreeRunningStrategy.meet`): also what the phase did.

    Attributes:
        steps: the steps done in the phase; its rows (with ``lr``) are rank 0's only, to spare
            every rank a copy of every row.
        evaluated: ``(index of the step in the phase, test accuracy, test loss)`` of each
            evaluation the phase finished, on every rank.
        bad: the index of the phase's first step whose loss is not finite, on every rank; -1: none.
    """

    steps: int = 0
    evaluated: list[tuple[int, float, float]] = field(default_factory=list)
    bad: int = -1


@dataclass
class RankState:
    """One rank's part of a checkpoint.

    Attributes:
        pieces: the pieces this rank holds (``Placement.holders``), name -> group ->
            arrays: the ``params`` and ``optimizer`` arrays of a model, a shard, a stage.
            Only their first holder's copy is written; every holder gets it back.
        arrays: this rank's own arrays (BatchNorm statistics: local to each rank).
        meta: this rank's own small values (random streams, sampler position, counters),
            JSON-compatible.
    """

    pieces: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    arrays: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)


class RunContext(Protocol):
    """What the driver hands a strategy: the config, the world, the placement and builders.

    The builders make the objects a strategy asks for — a data set, a model, an optimizer,
    a learning-rate schedule scaled by the placement's width, a sampler for a data-parallel
    member — so that a strategy names what it needs and the driver knows how to build it.
    """

    cfg: Any
    comm: Communicator
    placement: Placement
    steps_per_epoch: int
    total_steps: int

    @property
    def rank(self) -> int:
        """This rank's number in the world."""
        ...

    def data(self) -> Any:
        """The config's data set (shared read-only within a process)."""
        ...

    def build_model(self) -> Any:
        """The config's model, initialised alike on every rank; dropout from this rank's stream."""
        ...

    def optimizer(self, params: Any, model: Any = None) -> Any:
        """The config's optimizer over ``params``; one that observes the layers (K-FAC) needs the
        ``model`` (refused without it, in one line)."""
        ...

    def schedule(self) -> Any:
        """The learning-rate schedule, scaled for the placement's data-parallel width."""
        ...

    def sampler(self, member: int) -> Any:
        """The batches of data-parallel member ``member`` (of the placement's width)."""
        ...

    def batch(self, indices: Any) -> tuple[Any, Any]:
        """Training samples and labels at ``indices``, on the config's device and dtype."""
        ...

    def labels(self, indices: Any) -> Any:
        """Training labels at ``indices``, on the config's device (a last pipeline stage's)."""
        ...

    def evaluate(self, model: Any, comm: Communicator) -> tuple[float, float]:
        """Test accuracy and loss of ``model``, the test set sharded over ``comm`` (collective)."""
        ...

    def evaluation_parts(self, model: Any, batch: int) -> Any:
        """Test accuracy and loss of ``model`` on this rank alone, ``batch`` images per ``next()``
        (a generator whose value is ``(accuracy, loss)``): for a rank that serves between parts."""
        ...

    def elapsed(self) -> float:
        """Seconds since the run began, on this rank's clock, every segment of a resumed run
        included (a row's ``time``)."""
        ...

    def trace(self, kind: str, start: float, end: float, microbatch: int = -1) -> None:
        """A timeline event of this rank from ``start`` to ``end`` (:func:`hpcdl.comm.wtime` times),
        written to the run file's ``trace/`` (``log.trace``): a pipeline's forward of a microbatch."""
        ...

    def random_state(self) -> dict[str, Any]:
        """This rank's random streams (dropout), for its checkpoint part."""
        ...

    def load_random_state(self, state: dict[str, Any]) -> None:
        """Put back what :meth:`random_state` returned."""
        ...


class PlanInputs(Protocol):
    """What the driver hands :meth:`Strategy.settle`: a model, the data set, a network file's
    α-β numbers and, on a resume, the config the run was started with."""

    #: the config the run being resumed ran with (dotted key -> value), or None
    stored: Mapping[str, Any] | None

    def model(self) -> Any:
        """The config's model, built on a stream of its own."""
        ...

    def data(self) -> Any:
        """The config's data set."""
        ...

    def network(self, spec: str, ranks: int) -> tuple[float, float]:
        """``(alpha, beta)``: seconds per message and per byte between two of ``ranks`` ranks
        under the simulator's network file ``spec`` (a packaged name or a path)."""
        ...

    def batch(self, indices: Any) -> tuple[Any, Any]:
        """Training samples and labels at ``indices`` as a step gathers them (in the config's
        dtype): what a stage's input gather costs."""
        ...


class Strategy:
    """A way of spreading training over ranks: the driver's updater. Subclass one of its two kinds:
    :class:`LockstepStrategy` (the ranks step together: sync, pipeline) or
    :class:`FreeRunningStrategy` (the ranks run their own loops between meetings: ps).

    Every strategy sets :attr:`name`, implements :meth:`plan` (pure), builds what its rank
    holds in ``__init__``, and gives its part of a checkpoint (:meth:`state`,
    :meth:`load_state`, :meth:`check_state`) and an evaluation (:meth:`evaluate`) at a
    meeting; :meth:`close` releases what it owns. What it owns beyond the driver — its
    config section, fit keys, metric columns, row tables, plots — it declares
    (:attr:`declares`).

    Attributes a driver or a benchmark may read when a strategy has them: ``model`` and
    ``optimizer`` (this rank's).
    """

    #: the name ``parallel.strategy`` selects it by
    name: ClassVar[str] = ""
    #: True for a :class:`FreeRunningStrategy` (set by the two kinds, read by benchmarks and the report)
    runs_free: ClassVar[bool] = False
    #: the strategy's own per-rank series (``ranks/``), from ``StepStats.series`` (a row per
    #: step) or, running free, ``PhaseStats.series`` (a row per meeting); a strategy may set
    #: its instance's in ``__init__`` when a run has more (sync under faults: ``online``)
    rank_series: tuple[str, ...] = ()
    #: config keys this strategy reads and the driver's common ones are not: a key, or a
    #: section as ``"pipeline."``; set under another strategy they would do nothing, so the
    #: driver says so once (:func:`ignored_keys`)
    keys: ClassVar[tuple[str, ...]] = ()
    #: what the strategy owns beyond the driver's: its config section, fit keys, metric columns,
    #: row tables, plots and legend (:class:`hpcdl.components.Declares`)
    declares: ClassVar[Declares] = Declares()
    #: how the conformance suite (``tests/strategies/``) exercises the strategy: a small run, where
    #: it is deterministic, its reference (:class:`hpcdl.parallel.conformance.Conformance`);
    #: None: the suite only checks its plan
    conformance: ClassVar[Any] = None
    #: keys of other strategies whose meaning this one cannot give, set to anything but the
    #: default -> why not and what to set instead: refused (:func:`check_keys`)
    cannot_honour: ClassVar[dict[str, str]] = {}
    #: True when the strategy honours the instability model's ``fault.*`` keys
    #: (:mod:`hpcdl.parallel.fault`); the others refuse them (:func:`check_keys`)
    faults: ClassVar[bool] = False

    @classmethod
    def plan(cls, cfg: Any, world: int) -> Placement:
        """Each rank's role, piece and data-parallel member for ``world`` ranks (pure).

        Raises:
            ConfigError: the config does not fit ``world`` ranks.
        """
        raise NotImplementedError

    @classmethod
    def settle(cls, cfg: Any, world: int, inputs: PlanInputs) -> dict[str, Any]:
        """Config values the strategy works out from the model before it is placed (the
        pipeline's planner: ``pipeline.balance = "plan"``), as updates; {}: none. The driver
        calls it on rank 0 before :meth:`plan`, hands every rank the result, and the run file
        stores the settled config, which a resume hands back as ``inputs.stored``: a strategy
        reuses what it settled then rather than settle anew.

        Raises:
            ConfigError: nothing fits (one line).
        """
        return {}

    @classmethod
    def advice(cls, cfg: Any, placement: Placement) -> list[str]:
        """Remarks on a config that runs but may not measure what its user wants (pure): the
        driver prints them once, on rank 0, when the strategy is built."""
        return []

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx

    def run_attrs(self) -> dict[str, Any]:
        """What rank 0's strategy records in a new run file's root attributes beside the driver's
        (strings and numbers), decided when it was built: sync's ``auto`` table; {}: nothing."""
        return {}

    def remarks(self) -> list[str]:
        """What rank 0's strategy has to tell its user about how it was built (sync: how its
        ``auto`` table was calibrated), printed once by the driver on rank 0; []: nothing."""
        return []

    @classmethod
    def memory(
        cls, cfg: Any, placement: Placement, probe: Any, test_size: int, eval_batch: int
    ) -> list[Any] | None:
        """What each rank will allocate, estimated before anything is built (``--plan`` prints it;
        the driver refuses a run that cannot fit).

        Args:
            cfg: the config.
            placement: the strategy's placement.
            probe: a :class:`~hpcdl.nn.MemoryProbe` of a model of the config's: the parameters and
                the measured activations of any slice of its top-level layers.
            test_size: the test images an evaluation runs through.
            eval_batch: the most test images the driver's evaluation (``ctx.evaluate``) runs
                through a model at once.

        Returns:
            One :class:`~hpcdl.parallel.memory.RankMemory` per rank; None: no estimate (nothing
            is checked).
        """
        return None

    @classmethod
    def describe(cls, cfg: Any, placement: Placement, model: Any) -> list[str]:
        """Lines ``--plan`` adds below the placement (a parameter server's shards).

        Args:
            cfg: the config.
            placement: the strategy's placement.
            model: builds the config's model when called (the data set is loaded).
        """
        return []

    def evaluate(self) -> tuple[float, float]:
        """Test accuracy and loss of the trained model (collective, at a meeting)."""
        raise NotImplementedError

    def serialize(self, s: Any) -> None:
        """What this rank holds, described once for saving, loading and checking (Chainer's
        ``serialize``): its piece, its own arrays, its helpers' states and its counters, through
        ``s``, a :class:`~hpcdl.parallel.state.Serializer`. :meth:`state`, :meth:`load_state` and
        :meth:`check_state` derive from it."""
        raise NotImplementedError

    def state(self, pieces: bool) -> RankState:
        """This rank's part of a checkpoint (at a meeting): what :meth:`serialize` describes.

        Args:
            pieces: include the pieces this rank holds (asked of their first holder only:
                the others hold equal copies).
        """
        from hpcdl.parallel.state import Saver  # noqa: PLC0415 (state.py builds on this module)

        saver = Saver(pieces)
        self.serialize(saver)
        return saver.state

    def load_state(self, state: RankState) -> None:
        """Continue from this rank's part of a checkpoint (checked first: :meth:`check_state`)."""
        from hpcdl.parallel.state import Loader  # noqa: PLC0415

        holds = self.ctx.placement.ranks[self.ctx.rank].holds
        self.check_state(state.pieces, held=(holds,) if holds else ())
        self.serialize(Loader(state))

    def check_state(self, pieces: dict[str, dict[str, Any]], held: tuple[str, ...] = ()) -> None:
        """Refuse a checkpoint's pieces this strategy cannot take (on rank 0, before anything changes):
        another model, shards of another size, another cut (what :meth:`serialize` declares), or,
        loading, the lack of a piece in ``held`` (this rank's).

        ``--resume auto`` passes over a checkpoint that fails it, as over a damaged one.

        Raises:
            ConfigError: naming what differs (another model, say).
        """
        from hpcdl.parallel.state import Checker  # noqa: PLC0415

        self.serialize(Checker(pieces, held))

    def close(self) -> None:
        """Release what the strategy owns (communicators it duplicated or split; collective)."""
        return None


class LockstepStrategy(Strategy):
    """A strategy whose ranks step together: the driver calls :meth:`step` on every rank, and after
    the steps :meth:`meets_after` says — and after every step at which the driver needs all
    ranks (a checkpoint, an evaluation, ``train.stop_at``, the end) — every rank calls
    :meth:`agree`, then, when due, :meth:`evaluate` and :meth:`state` (a checkpoint).
    """

    def step(self, step: int) -> StepStats:
        """Step ``step`` (0-based: the steps done before it) on this rank."""
        raise NotImplementedError

    def meets_after(self, step: int) -> bool:
        """True when the ranks meet after ``step`` (1-based) of their own accord (every step by
        default): the driver also makes them meet where its work needs every rank."""
        return True

    def agree(self, stats: Sequence[StepStats], stop: bool) -> Agreement:
        """The global metrics of the steps since the last meeting, and the stop (collective)."""
        raise NotImplementedError


class FreeRunningStrategy(Strategy):
    """A strategy whose ranks run their own loops between meetings (servers and workers): the
    driver calls :meth:`run_until` on every rank up to the next step at which it needs every
    rank (a checkpoint, ``train.stop_at``, the end), then :meth:`meet`. The strategy evaluates
    on its own schedule, and ``ranks/`` gets a row per meeting.
    """

    runs_free: ClassVar[bool] = True
    #: the rank whose clock times the steps (``PhaseStats.ended``)
    row_rank: ClassVar[int] = 0

    def run_until(self, step: int, target: int, stop: Any, early: Any = None) -> PhaseStats:
        """Run free from ``step`` steps done until ``target`` or a stop, then quiesce (``runs_free``).

        Args:
            step: steps done when the call begins (the same on every rank).
            target: the step of the next meeting; a strategy whose steps come in rounds may
                end past it, at the end of the round that reaches it.
            stop: this rank's stop flag (``requested``): asked, the strategy ends early.
            early: on the row rank, ``early(rows, ended, tables)`` takes the phase's first
                rows that are final (every ``log.flush_every``, in order, none past a
                non-finite loss), with when each step ended and their row groups, so that
                the run file grows during a long phase; :meth:`meet` then gives the rows
                again, all of them, and the row groups not given yet.

        Returns:
            What this rank did; the ranks then meet (:meth:`meet`).
        """
        raise NotImplementedError

    def meet(self, phase: PhaseStats, stop: bool) -> PhaseAgreement:
        """After :meth:`run_until`: the phase's steps and rows, its evaluations, the stop (collective)."""
        raise NotImplementedError
