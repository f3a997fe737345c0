"""Synchronous data parallel with gradient buckets reduced while backward runs (DDP-style)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from hpcdl import comm as ops  # ops.MAX resolved at use: importing this module starts no MPI
from hpcdl.backend import synchronize
from hpcdl.comm import Communicator, notes, waitall, wtime
from hpcdl.comm.buckets import Buckets
from hpcdl.comm.collectives import NODE_ALGORITHMS, Collectives, CollRequest
from hpcdl.comm.collectives.auto import AutoTable
from hpcdl.comm.pack import INT32_NONFINITE_EXPONENT, int32_exponent, int32_pow2_scale, int32_scale
from hpcdl.errors import ConfigError, NodeMemoryError
from hpcdl.nn.layer import Layer
from hpcdl.nn.parameter import Parameter
from hpcdl.parallel.exchange import ExchangeError, LocalExchange, broadcast_parameters

__all__ = ["BucketedExchange", "COMPRESSIONS", "DEFAULT_BUCKET_MB", "INT32_SCALES"]

#: bucket size in MiB when the config does not say (PyTorch DDP's default is 25)
DEFAULT_BUCKET_MB = 25.0

#: wire formats of the buckets: ``none`` (the gradients' dtype), ``float16`` and
#: ``bfloat16`` (2 bytes, summed in float32), ``int32`` (quantized with a shared scale)
COMPRESSIONS: tuple[str, ...] = ("none", "float16", "bfloat16", "int32")

#: rules for the scale of ``int32`` compression (:mod:`hpcdl.comm.pack`): ``pow2`` (SwitchML's
#: block floating point, a MAX allreduce of int32 exponents) or ``max`` (a MAX allreduce of
#: ``max |g|``, the rule before ``pow2``)
INT32_SCALES: tuple[str, ...] = ("pow2", "max")


class BucketedExchange(LocalExchange):
    """Gradients are packed into buckets as backward produces them, last layers first.

    The exchange is a per-layer observer (:mod:`hpcdl.nn.hooks`): after each layer's
    backward, its parameters' gradients are final; when that completes a bucket, the
    bucket is packed and its nonblocking allreduce (hpcdl's own collectives, no
    threads) starts at once. Between layers every request in flight is advanced with
    ``Test()``. :meth:`exchange`, called after backward, waits for what is left and
    unpacks with scale 1/N (in place, the allreduce itself takes the mean: each rank scales
    the chunk it completes): only that wait is *exposed* communication.

    Buckets are released in bucket order on every rank (:meth:`Buckets.mark_ready`),
    so all ranks start their collectives in the same order, as MPI requires.

    ``compression`` sets the buckets' wire format (:data:`COMPRESSIONS`):

    - ``float16``/``bfloat16``: gradients are rounded to 2 bytes while packing, and each
      bucket is summed with :mod:`~hpcdl.comm.collectives.widening` (every contribution
      added in float32 on the rank that owns a chunk, one rounding, then an allgather),
      whatever ``algorithm`` says. Values beyond float16's range (65504) become inf, which
      the training loop reports as a non-finite loss.
    - ``int32``: when a bucket is complete, one small blocking MAX allreduce gives the
      scale at which a sum over the ranks cannot overflow; the quantized bucket is then
      summed exactly in int32 (the form a switch aggregates, for in-network aggregation).
      ``int32_scale`` is the rule (:data:`INT32_SCALES`): ``pow2`` reduces the int32 binary
      exponents of the ranks' ``max |g|`` (:func:`int32_exponent`) and quantizes with the
      power of two :func:`int32_pow2_scale`, the rule an aggregation switch applies
      (SwitchML), so both sum the same integers; ``max`` reduces ``max |g|`` itself
      (:func:`int32_scale`).

    With gradient accumulation (:meth:`accumulate` after each micro-step but the last),
    the observer must be active only in the last micro-step's backward: the exchange adds
    the kept sum to each gradient just before packing it.
    """

    def __init__(
        self,
        comm: Communicator,
        params: Sequence[Parameter],
        debug: bool = False,
        *,
        bucket_mb: float = DEFAULT_BUCKET_MB,
        algorithm: str = "auto",
        auto: AutoTable | None = None,
        compression: str = "none",
        int32_scale: str = "pow2",
        in_place: bool = True,
    ) -> None:
        super().__init__(comm, params, debug)
        if compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {COMPRESSIONS} (got {compression!r})")
        if int32_scale not in INT32_SCALES:
            raise ValueError(f"int32_scale must be one of {INT32_SCALES} (got {int32_scale!r})")
        self.compression = compression
        self.int32_scale = int32_scale
        self.index = {id(p): i for i, p in enumerate(self.params)}
        mode = "plain" if compression == "none" else compression
        self.buckets = Buckets([p.grad for p in self.params], int(bucket_mb * 2**20) or None, mode=mode)
        #: the plain wire format: each gradient lives in its bucket's buffer (``p.grad`` is a view),
        #: so backward writes straight into what is sent: nothing to pack, the mean taken inside the
        #: allreduce. On one node the buffers are node memory, which ``shm`` reduces where it lies.
        #: Between a bucket's start and :meth:`exchange` its gradients hold partial sums. Not with
        #: ``debug``, whose check names the rank of a non-finite gradient before any is summed
        # (and not over gradients already in another exchange's buckets: they stay where they are)
        own = all(getattr(p.grad, "base", None) is None for p in self.params)
        self.in_place = in_place and mode == "plain" and not debug and own
        if algorithm == "shm" and not self.in_place:
            raise ConfigError(
                "exchange.algorithm = 'shm' reduces the gradients where they lie, in their buckets: it "
                "needs exchange.in_place = true, no compression and exchange.debug = false"
            )
        self.coll = Collectives(comm, algorithm, auto=auto)
        #: what the exchange has to tell the user (node memory it could not have), printed once
        self.node_memory_notes: list[str] = []
        #: the buckets lie in node memory (every rank on one node, NumPy, in place): what the
        #: algorithm ``shm`` reduces where it lies
        self.node_memory = False
        if self.in_place:
            if self._wants_node_memory():
                self.node_memory = self._to_node_memory()
            self._bind_grads()
        self._qscales: list[float | None] = [None] * len(self.buckets)
        self._maxabs = np.zeros(1)  # the MAX allreduce of int32 compression, in place (max rule)
        self._exponent = np.zeros(1, np.int32)  # ... of the pow2 rule
        self.exposed_time = 0.0
        #: seconds inside the exchange by kind (``bench train``'s breakdown): ``pack`` (packing and
        #: unpacking buckets, or the in-place average), ``progress`` (starting allreduces and
        #: advancing them between layers, during backward), ``wait`` (waiting after backward)
        self.times = {"pack": 0.0, "progress": 0.0, "wait": 0.0}
        self._layer_params: dict[int, list[int]] = {}
        self._reqs: list[CollRequest | None] = []
        self._marked: set[int] = set()  # gradients final in this backward
        #: ``tracer(kind, start, end, bucket)``: timeline events (``log.trace``); None: none
        self.tracer: Callable[..., None] | None = None
        notes()["buckets"] = _InFlight(self)  # read by stall reports only: no cost per step

    @property
    def _grads(self) -> list[Any]:
        """The gradients as they are now (another exchange over the same parameters may have
        moved them into its buckets)."""
        return [p.grad for p in self.params]

    def _wants_node_memory(self) -> bool:
        """Whether a bucket may be summed by a node algorithm: ``shm`` named, or ``auto`` whose
        table picks it at some bucket's size (node memory costs a shared window, which a
        small ``/dev/shm`` may refuse: none is taken that no algorithm would use)."""
        algorithm = self.coll.algorithm
        if algorithm == "auto":
            size = self.comm.Get_size()
            return any(
                self.coll.auto.choose(int(self.buckets.buffer(b).nbytes), size) in NODE_ALGORITHMS
                for b in range(len(self.buckets))
            )
        return algorithm in NODE_ALGORITHMS

    def _to_node_memory(self) -> bool:
        """Move the buckets' buffers into one block of node memory (collective), each bucket at a
        64-byte boundary; False (buffers kept) off NumPy or when the ranks span nodes.

        Raises:
            ConfigError: ``algorithm = "shm"`` and no node memory.
            NodeMemoryError: ``algorithm = "shm"`` and too little of it (with ``auto``: a
                remark, and the buffers kept).
        """
        plan, wire = self.buckets.plan.buckets, self.buckets.wire_dtype
        if not plan:  # no gradient to exchange
            return False
        align = max(64 // wire.itemsize, 1)
        starts, total = [], 0
        for b in range(len(plan)):
            starts.append(total)
            total += -(-self.buckets.packer(b).total // align) * align
        try:
            block = self.coll.node_empty(total, wire) if self.buckets.xp is np else None
        except NodeMemoryError as err:  # on every rank
            if self.coll.algorithm == "shm":
                self.coll.free()
                raise NodeMemoryError(f"{err}, or choose another exchange.algorithm than 'shm'") from None
            self.node_memory_notes.append(
                f"{err}; until then the buckets stay in ordinary memory, where auto runs the fastest "
                "of the message algorithms in place of shm"
            )
            return False
        if block is None:
            if self.coll.algorithm == "shm":
                self.coll.free()
                raise ConfigError(
                    "exchange.algorithm = 'shm' reduces in memory the ranks of one node share: these "
                    "ranks span nodes (or the gradients are not NumPy arrays); choose another algorithm"
                )
            return False
        for b, start in enumerate(starts):
            packer = self.buckets.packer(b)
            packer.place(block[start : start + packer.total])
        return True

    def _bind_grads(self) -> None:
        """Make every ``p.grad`` a view of its place in its bucket's buffer (values kept)."""
        for b, bucket in enumerate(self.buckets.plan.buckets):
            buf = self.buckets.buffer(b)
            for k, i in enumerate(bucket.arrays):
                p = self.params[i]
                view = buf[bucket.offsets[k] : bucket.offsets[k + 1]].reshape(p.grad.shape)
                view[...] = p.grad
                p.grad = view

    @property
    def auto(self) -> AutoTable:
        """The table ``algorithm="auto"`` chooses from (recorded in the run file and in checkpoints;
        a resume sets it back to the one its run started with)."""
        return self.coll.auto

    @auto.setter
    def auto(self, table: AutoTable) -> None:
        """Collective when the new table needs node memory the buckets are not in yet (a resume)."""
        self.coll.auto = table
        if self.in_place and not self.node_memory and self._wants_node_memory():
            self.node_memory = self._to_node_memory()
            self._bind_grads()

    def broadcast_parameters(self, root: int = 0) -> None:
        broadcast_parameters(self.comm, self.params, root)

    # -- the per-layer observer --------------------------------------------------------
    def before(self, phase: str, layer: Layer, x: Any) -> None:
        return None

    def after(self, phase: str, layer: Layer, y: Any) -> None:
        if phase != "backward":
            return
        t0 = wtime()
        for i in self._indices(layer):
            self._fold(i)
            self._marked.add(i)
            for b in self.buckets.mark_ready(i):
                self._start(b)
        t1 = wtime()
        for req in self._reqs:  # progress what is in flight while backward goes on
            if req:
                req.Test()
        t2 = wtime()
        self.times["progress"] += t2 - t1
        self.comm_time += t2 - t0

    def _indices(self, layer: Layer) -> list[int]:
        key = id(layer)
        found = self._layer_params.get(key)
        if found is None:
            found = [self.index[id(p)] for p in layer.parameters() if id(p) in self.index]
            self._layer_params[key] = found
        return found

    def _start(self, b: int) -> None:
        """Pack bucket ``b`` in the wire format and start its allreduce."""
        t0 = wtime()
        qscale = self._int32_scale(b) if self.compression == "int32" else None
        self._qscales[b] = qscale
        if self.in_place:  # backward wrote it there
            buf = self.buckets.buffer(b)
        else:
            buf = self.buckets.pack_bucket(b, self._grads, qscale=qscale)
        synchronize(buf)
        t1 = wtime()
        narrow = self.compression if self.compression in ("float16", "bfloat16") else None
        # in place, the mean is taken inside the allreduce (each rank scales the chunk it completes)
        scale = self._average_scale() if self.in_place else None
        self._reqs.append(self.coll.Iallreduce(buf, buf, narrow=narrow, scale=scale))
        self.bytes_sent += int(buf.nbytes)
        t2 = wtime()
        self.times["pack"] += t1 - t0
        self.times["progress"] += t2 - t1
        if self.tracer is not None:
            self.tracer("pack", t0, t2, b)

    def _int32_scale(self, b: int) -> float:
        """The quantization scale of bucket ``b`` under the ``int32_scale`` rule (a MAX allreduce).

        Raises:
            ExchangeError: a gradient of the bucket is NaN or infinite on some rank (the
                same on every rank, since they all see the same maximum).
        """
        members = self.buckets.plan.buckets[b].arrays
        grads = self._grads
        local = self.buckets.packer(b).maxabs([grads[i] for i in members])
        size = self.comm.Get_size()
        if self.int32_scale == "pow2":
            self._exponent[0] = int32_exponent(local)
            self.coll.Allreduce(self._exponent, self._exponent, op=ops.MAX, algorithm="mpi")
            if int(self._exponent[0]) != INT32_NONFINITE_EXPONENT:
                return int32_pow2_scale(int(self._exponent[0]), size)
        else:
            # a NaN goes as inf: MPI's MAX over a NaN depends on the order, and some ranks would go on
            self._maxabs[0] = math.inf if math.isnan(local) else local
            self.coll.Allreduce(self._maxabs, self._maxabs, op=ops.MAX, algorithm="mpi")
            if math.isfinite(self._maxabs[0]):
                return int32_scale(float(self._maxabs[0]), size)
        names = ", ".join(self.params[i].name for i in members[:3])
        raise ExchangeError(
            f"a gradient in the bucket of {names}{', ...' * (len(members) > 3)} is not finite on some "
            "rank: int32 compression cannot quantize it (lower optimizer.lr; exchange.debug = true "
            "names the parameter and rank)"
        )

    # -- after backward ------------------------------------------------------------------
    def _wait_all(self) -> None:
        """Complete every bucket's request (``waitall``; a subclass may wait otherwise)."""
        waitall(self._reqs)

    def exchange(self) -> None:
        """Finish every bucket's allreduce and unpack the averages into ``.grad``."""
        if self.debug:
            self._check_ready()
        t0 = wtime()
        for i in range(len(self.params)):  # parameters no observed layer reported (e.g. unused)
            if i not in self._marked:
                self._fold(i)
                for b in self.buckets.mark_ready(i):
                    self._start(b)
        t_wait = wtime()
        self._wait_all()
        t_unpack = wtime()
        scale = self._average_scale()
        self._accumulated = 0
        grads = self._grads
        for b in range(len(self.buckets)):
            if not self.in_place:  # in place, the allreduce left the mean (in the gradients' dtype)
                buf = self.buckets.buffer(b)
                self.buckets.unpack_bucket(b, buf, grads, scale=scale, qscale=self._qscales[b])
        t_end = wtime()
        if self.tracer is not None:
            self.tracer("wait", t_wait, t_unpack)
            self.tracer("unpack", t_unpack, t_end)
        self.times["wait"] += t_unpack - t_wait
        self.times["pack"] += t_end - t_unpack  # the unpacking (a late parameter's packing: in _start)
        self._reqs = []
        self._marked.clear()
        self.buckets.reset()
        dt = wtime() - t0
        self.exposed_time += dt
        self.comm_time += dt

    def free(self) -> None:
        """Release the duplicated communicator of the collectives (collective). Gradients in node
        memory are copied out first (the memory is unmapped), so ``p.grad`` stays readable and
        another exchange can take it in place."""
        if self.node_memory:
            for p in self.params:
                p.grad = p.grad.copy()
            for b in range(len(self.buckets)):  # nothing left pointing into the unmapped window
                packer = self.buckets.packer(b)
                packer.place(np.empty(packer.total, self.buckets.wire_dtype))
            self.node_memory = False
        self.coll.free()


class _InFlight:
    """``2 of 4 in flight (1, 3)``: the buckets whose allreduce has not completed, for stall reports."""

    def __init__(self, exchange: BucketedExchange) -> None:
        self.exchange = exchange

    def __str__(self) -> str:
        reqs = self.exchange._reqs
        waiting = [b for b, r in enumerate(reqs) if r is not None and not r.finished]
        started = len(reqs)
        total = len(self.exchange.buckets)
        if not waiting:
            return f"{started} of {total} started, none in flight"
        return f"{started} of {total} started, in flight: {', '.join(map(str, waiting))}"
