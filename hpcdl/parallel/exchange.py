"""Gradient exchange for synchronous data parallelism: one packed ``Allreduce`` per step."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from hpcdl import comm as ops  # ops.SUM resolved at use: importing this module starts no MPI
from hpcdl.backend import get_array_module, synchronize, to_numpy
from hpcdl.comm import Communicator, wtime
from hpcdl.comm.pack import Packer
from hpcdl.components import Declares, Key
from hpcdl.errors import HpcdlError
from hpcdl.nn.parameter import Parameter

__all__ = [
    "DECLARES",
    "EXCHANGE_NAMES",
    "AllreduceExchange",
    "ExchangeError",
    "GradientExchange",
    "LocalExchange",
    "broadcast_parameters",
]


#: ``exchange.name`` values (``hpcdl.parallel.EXCHANGES`` maps each to its class)
EXCHANGE_NAMES = ("allreduce", "bucketed", "switch")

#: the gradient exchange's config section (sync's; a pipeline's per-stage exchange reads it too)
DECLARES = Declares(
    keys={
        "exchange.name": Key(
            str,
            "bucketed",
            "gradient exchange under mpiexec: bucketed (overlaps backward), allreduce (one flat), or "
            "switch (buckets summed in int32 by an aggregation switch: exchange.switch, switch.*)",
            choices=EXCHANGE_NAMES,
        ),
        "exchange.switch": Key(
            str,
            "spawn",
            "switch: where the aggregation switch is, HOST:PORT (a running python -m hpcdl.switch) or "
            "spawn (rank 0 starts one on loopback for the job)",
        ),
        "exchange.bucket_mb": Key(float, 25.0, "bucketed: bucket size in MiB (0: one bucket)", minimum=0.0),
        "exchange.algorithm": Key(
            str,
            "auto",
            "bucketed: allreduce algorithm (hpcdl's own, mpi: the library's, shm: in the memory of one "
            "node, auto: by size)",
            choices=("auto", "ring", "doubling", "rabenseifner", "mpi", "shm"),
        ),
        "exchange.auto_table": Key(
            str,
            "",
            "auto: the table of algorithms by size and rank count (bench allreduce --calibrate); "
            "'': calibrated where the run is (exchange.auto_calibrate), else packaged",
        ),
        "exchange.auto_calibrate": Key(
            str,
            "first",
            "auto: time the algorithms at the run's bucket sizes where it runs and cache the result, "
            "first (on a cache miss), always (time again), never (the packaged or named table)",
            choices=("first", "always", "never"),
        ),
        "exchange.auto_cache": Key(
            str,
            "",
            "auto: the calibration cache file ('': $XDG_CACHE_HOME/hpcdl/auto-tables.json, else under "
            "~/.cache)",
        ),
        "exchange.auto_threshold_kb": Key(
            float,
            0.0,
            "auto: if > 0, MPI's own allreduce below this bucket size and the ring above, not the table",
            minimum=0.0,
        ),
        "exchange.compression": Key(
            str,
            "none",
            "bucketed: gradients on the wire as float16/bfloat16 (summed in float32) or int32 "
            "(quantized: exchange.int32_scale)",
            choices=("none", "float16", "bfloat16", "int32"),
        ),
        "exchange.int32_scale": Key(
            str,
            "pow2",
            "int32: the scale rule, pow2 (SwitchML's block floating point: a power of two from the ranks' "
            "max exponent, what an aggregation switch applies) or max (from the global max |g|)",
            choices=("pow2", "max"),
            legacy="max",
        ),
        "exchange.in_place": Key(
            bool,
            True,
            "bucketed, no compression: the gradients live in their buckets' memory, so nothing is packed "
            "(false: copied into the buckets, as before; the same sums)",
        ),
        "exchange.accumulate": Key(
            int,
            1,
            "micro-steps of data.batch_size per optimizer step, one exchange each (gradient accumulation)",
            minimum=1,
        ),
        "exchange.debug": Key(
            bool, False, "check buffer sizes and finite gradients across ranks before exchange"
        ),
    },
    fit_keys=("exchange.accumulate",),
)


class ExchangeError(HpcdlError, RuntimeError):
    """Ranks disagree on what they exchange, or a gradient is not finite."""


class GradientExchange(Protocol):
    """What a data-parallel strategy offers the training loop.

    ``comm_time`` accumulates the seconds spent inside the exchange (from
    :func:`hpcdl.comm.wtime`), for the run's metrics; ``exposed_time`` the part of it that
    nothing overlapped (the wait in :meth:`exchange`, after backward).
    """

    comm_time: float
    exposed_time: float
    bytes_sent: int

    def broadcast_parameters(self, root: int = 0) -> None:
        """Make every rank's parameters equal to those of ``root``."""

    def accumulate(self) -> None:
        """Keep this micro-step's gradients, to be averaged in by the next :meth:`exchange`."""

    def exchange(self) -> None:
        """Replace every parameter's ``.grad`` by its average over the ranks (and micro-steps)."""

    def free(self) -> None:
        """Release what the exchange owns (duplicated communicators; collective)."""


class LocalExchange:
    """One process: gradients are already the average; nothing to send.

    Also the base of the multi-rank exchanges, holding **gradient accumulation**: after
    each micro-step but the last of an optimizer step, the training loop calls
    :meth:`accumulate` (layers overwrite ``.grad`` in backward, so the sum is kept here);
    the exchange after the last micro-step adds the sum back (:meth:`_fold`) and averages
    over ranks and micro-steps (:meth:`_average_scale`). Nothing is communicated for the
    earlier micro-steps, as with PyTorch DDP's ``no_sync()``.
    """

    def __init__(self, comm: Communicator, params: Sequence[Parameter], debug: bool = False) -> None:
        self.comm = comm
        self.params = list(params)
        self.debug = debug
        self.comm_time = 0.0
        self.exposed_time = 0.0
        self.bytes_sent = 0
        self._acc: list[Any] | None = None
        self._accumulated = 0  # micro-steps held in _acc

    def broadcast_parameters(self, root: int = 0) -> None:
        return None

    def free(self) -> None:
        """Nothing to release (the multi-rank exchanges free their communicators)."""
        return None

    def accumulate(self) -> None:
        """Keep this micro-step's gradients; the next :meth:`exchange` averages them in."""
        if self._acc is None:
            self._acc = [get_array_module(p.grad).empty_like(p.grad) for p in self.params]
        for a, p in zip(self._acc, self.params):
            if self._accumulated:
                a += p.grad
            else:
                get_array_module(a).copyto(a, p.grad)
        self._accumulated += 1

    def _fold(self, i: int) -> None:
        """Add the accumulated gradients of parameter ``i`` to its ``.grad`` (before sending)."""
        if self._accumulated:
            assert self._acc is not None
            self.params[i].grad += self._acc[i]

    def _average_scale(self) -> float:
        """The factor turning the sum over ranks and micro-steps into the mean."""
        return 1.0 / (self.comm.Get_size() * (self._accumulated + 1))

    def exchange(self) -> None:
        if self.debug:
            self._check_ready()
        if self._accumulated:
            scale = self._average_scale()
            for i, p in enumerate(self.params):
                self._fold(i)
                p.grad *= p.grad.dtype.type(scale)
            self._accumulated = 0

    def _check_ready(self) -> None:
        """Check sizes agree across ranks and every gradient is finite (debug mode)."""
        rank = self.comm.Get_rank()
        mine = (sum(p.size for p in self.params), str(self.params[0].dtype))
        every = self.comm.allgather(mine)
        if any(e != every[0] for e in every):
            detail = ", ".join(f"rank {r}: {n} {dt}" for r, (n, dt) in enumerate(every))
            raise ExchangeError(
                f"gradient buffers differ across ranks ({detail}): every rank must build the same model"
            )
        bad = _non_finite(self.params, rank)
        if self.comm.allreduce(int(bad is not None), op=ops.MAX):
            raise ExchangeError(bad or "a gradient on another rank is not finite (see that rank's message)")


class AllreduceExchange(LocalExchange):
    """Packs all gradients into one buffer, sums it with ``Allreduce``, unpacks with scale 1/N.

    Packing (the Cython kernel in ``ext/pack.pyx``) follows the parameters'
    fixed order, which is the same on every rank. With ``debug``, the ranks
    first check that they agree on the buffer size and that every gradient is
    finite (an extra small collective per step: ChainerMN's
    ``_check_ready_to_allreduce``).
    """

    def __init__(self, comm: Communicator, params: Sequence[Parameter], debug: bool = False) -> None:
        super().__init__(comm, params, debug)
        grads = [p.grad for p in self.params]
        self._grads = Packer(grads)
        xp = get_array_module(grads[0])
        self._recv = xp.empty_like(self._grads.pack(grads))

    def broadcast_parameters(self, root: int = 0) -> None:
        broadcast_parameters(self.comm, self.params, root)

    def exchange(self) -> None:
        if self.debug:
            self._check_ready()
        t0 = wtime()
        for i in range(len(self.params)):
            self._fold(i)
        scale = self._average_scale()
        self._accumulated = 0
        grads = [p.grad for p in self.params]
        send = self._grads.pack(grads)
        synchronize(send)
        self.comm.Allreduce(send, self._recv, op=ops.SUM)
        self._grads.unpack(self._recv, grads, scale=scale)
        dt = wtime() - t0
        self.comm_time += dt
        self.exposed_time += dt  # blocking, after backward: nothing overlaps it
        self.bytes_sent += int(send.nbytes)


def broadcast_parameters(comm: Communicator, params: Sequence[Parameter], root: int = 0) -> None:
    """Make every rank's parameters equal to ``root``'s: one packed ``Bcast``."""
    arrays = [p.data for p in params]
    packer = Packer(arrays)
    buf = packer.pack(arrays)
    synchronize(buf)
    comm.Bcast(buf, root=root)
    packer.unpack(buf, arrays)


def _non_finite(params: Sequence[Parameter], rank: int) -> str | None:
    """A message naming the first parameter whose gradient has NaN or inf values, or None."""
    for p in params:
        finite = get_array_module(p.grad).isfinite(p.grad)
        if not bool(finite.all()):
            n_bad = int((~to_numpy(finite)).sum())
            return f"rank {rank}: gradient of {p.name!r} has {n_bad} non-finite values (NaN or inf)"
    return None
