"""The run context the driver hands a strategy: the config, the world, the placement, builders."""

from __future__ import annotations

from collections.abc import Generator, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import numpy as np

from hpcdl.backend import array_module
from hpcdl.comm import Communicator, sleep, wtime
from hpcdl.config import Config
from hpcdl.data import Dataset, DistributedSampler, gather_batch
from hpcdl.driver.factory import build, evaluate, evaluation_parts, load_data, make_optimizer, make_schedule
from hpcdl.errors import ConfigError, DataError
from hpcdl.nn import LayerProfiler, Parameter, Sequential, observe
from hpcdl.optim import Optimizer, Schedule
from hpcdl.parallel import Placement
from hpcdl.rng import generator

__all__ = ["Context", "Slowdown", "arithmetic", "slowdown_factor"]


class Context:
    """What a strategy builds from (:class:`hpcdl.parallel.RunContext`), for one rank.

    Loading the data set fixes the epoch arithmetic: ``steps_per_epoch`` global batches of
    the placement's width fit in the training set, and ``total_steps`` is ``train.steps``
    or ``train.epochs`` of them.

    Args:
        cfg: the run's config.
        comm: the world.
        placement: the strategy's placement for the world's size.

    Raises:
        DataError: the data set is missing or malformed.
    """

    def __init__(self, cfg: Config, comm: Communicator, placement: Placement) -> None:
        self.cfg, self.comm, self.placement = cfg, comm, placement
        self.xp = array_module(cfg["device"])
        self.dtype = np.dtype(cfg["dtype"])
        self._data = load_data(cfg)
        self.dropout_rng = generator(cfg["seed"], self.rank, "dropout")  # differs per rank
        samples = len(self._data.y_train)
        self.batches, self.steps_per_epoch, self.total_steps = arithmetic(cfg, placement, samples)
        self._schedule: Schedule | None = None
        self._before = 0.0  # the run's time before this segment (a resumed run's earlier ones)
        self._t_segment = wtime()  # when this segment began on this rank's clock
        #: this rank's timeline events since the last write: (kind, start, end, microbatch)
        self.events: list[tuple[str, float, float, int]] = []

    def elapsed(self) -> float:
        """Seconds since the run began, on this rank's clock, every segment of a resumed run included."""
        return self._before + wtime() - self._t_segment

    def start_segment(self, before: float, at: float) -> None:
        """The run's time is ``before`` at this rank's clock time ``at`` (the driver, when a run or a
        resumed part of it begins training)."""
        self._before, self._t_segment = before, at

    def trace(self, kind: str, start: float, end: float, microbatch: int = -1) -> None:
        """A timeline event of this rank from ``start`` to ``end`` (:func:`hpcdl.comm.wtime`
        times), kept in run time and written to ``trace/`` with the next rows (``log.trace``)."""
        offset = self.elapsed() - wtime()
        self.events.append((kind, start + offset, end + offset, microbatch))

    @property
    def rank(self) -> int:
        """This rank's number in the world."""
        return self.comm.Get_rank()

    def data(self) -> Dataset:
        """The config's data set (a read-only copy shared within the process)."""
        return self._data

    def build_model(self) -> Sequential:
        """The config's model, initialised alike on every rank; its dropout draws from this rank's stream."""
        return build(self.cfg, self._data, self.rank, self.dtype, self.xp, self.dropout_rng)

    def schedule(self) -> Schedule:
        """The learning-rate schedule, scaled by the batches one update averages (``scale_batches``)."""
        if self._schedule is None:
            self._schedule = make_schedule(self.cfg, self.batches, self.steps_per_epoch, self.total_steps)
        return self._schedule

    def optimizer(self, params: Sequence[Parameter], model: Sequential | None = None) -> Optimizer:
        """The config's optimizer over ``params`` (K-FAC: over ``model``'s layers), at the schedule's
        first learning rate."""
        return make_optimizer(self.cfg, params, self.schedule()(0), model)

    def sampler(self, member: int) -> DistributedSampler:
        """The batches of data-parallel member ``member``: micro-steps x ``data.batch_size`` per step.

        Raises:
            DataError: the global batch exceeds the training set (with the sampler's fix).
        """
        micro, batch = self.placement.micro_steps, self.placement.batch_size
        try:
            return DistributedSampler(
                len(self._data.y_train), batch * micro, member, self.placement.width,
                seed=self.cfg["seed"], kind=self.cfg["data.sampler"],
            )  # fmt: skip
        except DataError as err:
            if micro == 1:
                raise
            pipeline = self.cfg["parallel.strategy"] == "pipeline"
            key = "pipeline.microbatches" if pipeline else "exchange.accumulate"
            raise DataError(
                f"{err} (with {key} = {micro}, a rank's batch per step is {micro} x data.batch_size {batch})"
            ) from None

    def batch(self, indices: Any) -> tuple[Any, Any]:
        """Training samples and labels at ``indices``, on the config's device and dtype."""
        x, y = gather_batch(self._data.x_train, self._data.y_train, indices, self.xp)
        return x.astype(self.dtype, copy=False), y

    def labels(self, indices: Any) -> Any:
        """Training labels at ``indices``, on the config's device (without gathering the samples)."""
        return self.xp.asarray(self._data.y_train[np.asarray(indices)])

    def evaluate(self, model: Sequential, comm: Communicator) -> tuple[float, float]:
        """Test accuracy and loss of ``model``, the test set sharded over ``comm`` (collective)."""
        return evaluate(model, self._data, comm, self.xp, self.dtype)

    def evaluation_parts(self, model: Sequential, batch: int) -> Generator[None, None, tuple[float, float]]:
        """Test accuracy and loss of ``model`` on this rank alone, ``batch`` images per ``next()``.

        For a rank that keeps answering messages between the parts (a parameter server);
        the generator's value is ``(accuracy, loss)``.
        """
        parts = evaluation_parts(model, self._data, self.xp, self.dtype, batch=batch)
        correct, loss_sum, count = yield from parts
        return float(correct / max(1, count)), float(loss_sum / max(1, count))

    def random_state(self) -> dict[str, Any]:
        """This rank's random streams (dropout) for its checkpoint part."""
        return {"dropout": self.dropout_rng.bit_generator.state}

    def load_random_state(self, state: dict[str, Any]) -> None:
        """Put back what :meth:`random_state` returned."""
        self.dropout_rng.bit_generator.state = state["dropout"]

    @contextmanager
    def observing(self, profiler: LayerProfiler | None, slowdown: Slowdown | None) -> Iterator[None]:
        """The driver's per-layer observers around a step (the strategy adds its own inside)."""
        if profiler is None and slowdown is None:
            yield
            return
        with (
            observe(profiler) if profiler is not None else nullcontext(),
            observe(slowdown) if slowdown is not None else nullcontext(),
        ):
            yield


def arithmetic(cfg: Config, placement: Placement, samples: int) -> tuple[int, int, int]:
    """The batches one update averages (width x micro-steps; 1 for an asynchronous push), the
    steps per epoch of ``samples`` training samples (whole steps: global batches, or pushes),
    and the run's steps (``train.steps`` or epochs)."""
    group = placement.step_multiple  # steps that come in rounds: whole rounds per epoch
    steps_per_epoch = max(1, samples // (placement.step_samples * group)) * group
    total = cfg["train.steps"] or cfg["train.epochs"] * steps_per_epoch
    return placement.scale_batches, steps_per_epoch, total


class Slowdown:
    """A per-layer observer: after each layer, spend ``factor - 1`` times its compute time.

    ``debug.slowdown = ["RANK:FACTOR"]`` makes that world rank a straggler under mpiexec,
    as the simulator's ``--straggler`` does (:func:`hpcdl.comm.sleep` is a real sleep).
    In the simulator the driver asks the world instead (:func:`hpcdl.comm.slow_down`),
    which scales the rank's modelled compute, cost tables included. Only outermost layers
    are timed (a residual block's inner layers are inside its time), and the ops announced
    outside layers (K-FAC's eigendecompositions and preconditioning, :func:`hpcdl.nn.hooks.op`)
    alike; an op inside a layer's call (K-FAC's factors) is inside the layer's time.
    """

    def __init__(self, factor: float) -> None:
        self.factor = factor
        self._depth = 0
        self._start = 0.0

    def before(self, phase: str, layer: Any, x: Any) -> None:
        if self._depth == 0:
            self._start = wtime()
        self._depth += 1

    def after(self, phase: str, layer: Any, y: Any) -> None:
        self._depth -= 1
        if self._depth == 0:
            sleep((self.factor - 1.0) * (wtime() - self._start))

    def before_op(self, op: str, dims: tuple[int, ...]) -> None:
        self.before("op", None, None)

    def after_op(self, op: str, dims: tuple[int, ...]) -> None:
        self.after("op", None, None)


def slowdown_factor(cfg: Config, rank: int, world: int) -> float:
    """This rank's factor in ``debug.slowdown`` (1.0: none).

    Raises:
        ConfigError: a rank outside the world, a factor below 1, a rank named twice.
    """
    factors: dict[int, float] = {}
    for item in cfg["debug.slowdown"]:
        r, _, f = item.partition(":")
        who, factor = int(r), float(f)
        if not 0 <= who < world:
            raise ConfigError(f"debug.slowdown names rank {who}, outside the {world} ranks of this run")
        if factor < 1:
            raise ConfigError(f"debug.slowdown factor of rank {who} is {factor}: a factor must be >= 1")
        if who in factors:
            raise ConfigError(f"debug.slowdown names rank {who} twice: give each rank one factor")
        factors[who] = factor
    return factors.get(rank, 1.0)
