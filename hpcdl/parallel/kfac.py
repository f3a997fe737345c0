"""The optimizer's slot in a data-parallel step, and distributed K-FAC (KAISA's layout).

A data-parallel step is: gradients → the exchange → **the optimizer's own communication** →
precondition → update (kfac-pytorch's ``step()``). :func:`make_update` gives a strategy the
object that fills the slot: for an elementwise optimizer (SGD, Adam) just its ``step()``; for
:class:`~hpcdl.optim.kfac.KFAC`, :class:`DistributedKfac` over the communicator the strategy
hands it (sync: every rank).

**Distributed K-FAC** (Pauloski et al., KAISA, SC'21), over N ranks:

* **Factors.** On a collecting step every rank's batch factors (``[A_0, G_0, A_1, ...]``,
  each the mean over its micro-steps) are averaged over the ranks with hpcdl's own
  allreduce (:class:`~hpcdl.comm.collectives.Collectives`), packed into buckets of
  ``exchange.bucket_mb`` by the Cython kernels (:class:`~hpcdl.comm.buckets.Buckets`), all
  buckets started nonblocking and then waited for; then folded into the running averages.
  With equal samples per rank this is one process's mean over N micro-steps.
* **Eigendecompositions** are assigned once, by a cost every rank computes alike: a layer
  costs ``d_A³ + d_G³``, layers are taken largest first (ties: earlier layer) and each goes to
  the least-loaded rank so far (ties: the lower rank) — KAISA's LPT. Each rank decomposes
  only its own (:attr:`owner`).
* **Gradient workers** (``kfac.grad_workers = k``, dividing N; 0 means N): the ranks are
  cut into k blocks of ``N / k`` consecutive ranks; layer i's workers are the k ranks
  congruent to its owner modulo ``N / k`` (one in each block). The owner broadcasts its
  eigenbases and eigenvalues to the other workers (over the communicator of ranks with the
  same ``rank mod N / k``); each worker preconditions the layer's gradient and broadcasts
  the result over its block (the communicator of ranks with the same ``rank // (N / k)``).
  ``k = N`` is COMM-OPT (eigenbases to every rank, no gradient broadcast), ``k = 1``
  MEM-OPT (the owner alone preconditions and broadcasts the gradient), in between HYBRID.
* **Checkpoints.** A rank holds the eigenbases of the layers it works on only; before the
  state is saved, every layer's are sent to rank 0 (:meth:`DistributedKfac.gather`), whose
  piece the checkpoint stores, so a resumed run is bitwise an uninterrupted one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from hpcdl.backend import get_array_module
from hpcdl.comm import Communicator, waitall, wtime
from hpcdl.comm.buckets import Buckets
from hpcdl.comm.collectives import Collectives
from hpcdl.errors import ConfigError

__all__ = ["DistributedKfac", "Update", "assign", "make_update"]

#: the tag of the eigenbases sent to rank 0 before a checkpoint (on a duplicate of ``comm``)
_GATHER_TAG = 7001


class Update(Protocol):
    """A strategy's update slot: the optimizer's observer (None: none) and its step."""

    observer: Any

    def step(self) -> None:
        """The optimizer's communication, then its update (collective over the strategy's ranks)."""

    def gather(self) -> None:
        """Before a checkpoint is saved: whatever rank 0 must hold of the optimizer (collective)."""

    def close(self) -> None:
        """Free what it split or duplicated (collective)."""


class LocalUpdate:
    """An elementwise optimizer's slot: its ``step()``; nothing to communicate."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        self.observer = getattr(optimizer, "observer", None)

    def step(self) -> None:
        self.optimizer.step()

    def gather(self) -> None:
        pass

    def close(self) -> None:
        pass


def assign(costs: Sequence[float], ranks: int) -> list[int]:
    """KAISA's greedy assignment: layers by cost, largest first (ties: earlier layer), each to
    the least-loaded rank so far (ties: the lower rank). Returns each layer's rank."""
    load = [0.0] * ranks
    owner = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += costs[i]
    return owner


def make_update(optimizer: Any, comm: Communicator, cfg: Any) -> Any:
    """The update slot of ``optimizer`` over ``comm``: :class:`DistributedKfac` for K-FAC, else
    the optimizer's own step (:class:`LocalUpdate`).

    Raises:
        ConfigError: ``kfac.grad_workers`` does not divide the ranks.
    """
    if getattr(optimizer, "elementwise", True):
        return LocalUpdate(optimizer)
    return DistributedKfac(
        optimizer, comm, cfg["kfac.grad_workers"], bucket_mb=cfg["exchange.bucket_mb"],
        algorithm=cfg["exchange.algorithm"] if cfg["exchange.algorithm"] != "auto" else "ring",
    )  # fmt: skip


def grad_workers(requested: int, ranks: int) -> int:
    """k: ``requested``, or N when 0.

    Raises:
        ConfigError: k does not divide N (naming the divisors).
    """
    k = requested or ranks
    if k < 1 or ranks % k:
        divisors = [d for d in range(1, ranks + 1) if ranks % d == 0]
        raise ConfigError(
            f"kfac.grad_workers = {requested} does not divide the {ranks} ranks: use one of {divisors} "
            "(N: eigenbases to every rank; 1: one rank per layer preconditions)"
        )
    return k


class DistributedKfac:
    """K-FAC's communication and update over ``comm`` (module docstring).

    Args:
        kfac: the rank's :class:`~hpcdl.optim.kfac.KFAC` (the same model on every rank).
        comm: the data-parallel ranks.
        workers: ``kfac.grad_workers`` (0: every rank).
        bucket_mb: the factors' bucket size for the allreduce (0: one bucket, as the exchange's).
        algorithm: hpcdl's allreduce algorithm for the factors.

    Raises:
        ConfigError: ``workers`` does not divide the ranks.
    """

    def __init__(self, kfac: Any, comm: Communicator, workers: int, *, bucket_mb: float = 25.0,
                 algorithm: str = "ring") -> None:  # fmt: skip
        self.kfac, self.comm = kfac, comm
        self.n, self.rank = comm.Get_size(), comm.Get_rank()
        self.k = grad_workers(workers, self.n)
        self.per = self.n // self.k  # ranks per block
        self.observer = kfac.observer
        dims = [e.dims for e in kfac.layers]
        self.costs = [float(a) ** 3 + float(g) ** 3 for a, g in dims]
        self.owner = assign(self.costs, self.n)
        #: bytes this rank sent: the factors' allreduce, eigenbases (as a root), preconditioned gradients
        self.bytes_factors = self.bytes_eigen = self.bytes_grads = 0
        #: steps taken, and those that decomposed (``t mod inv_every = 0``)
        self.steps = self.inversions = 0
        # every time of K-FAC's on one clock, the world's (virtual in the simulator): beside the
        # optimizer's own parts, the factors' allreduce, the two broadcasts and the whole slot
        # (``step``: the optimizer's part of a step, less factor collection in forward and backward)
        kfac.clock = wtime
        for key in ("exchange", "broadcast_eigen", "broadcast_grads", "step"):
            kfac.seconds.setdefault(key, 0.0)
        self._coll = self._col = self._row = self._p2p = None
        if self.n > 1:
            self._p2p = comm.Dup()  # the eigenbases sent to rank 0 before a checkpoint
            self._coll = Collectives(comm, algorithm=algorithm)
            dtype = kfac.params[0].data.dtype
            shapes = [s for a, g in dims for s in ((a, a), (g, g))]
            self._buckets = Buckets(shapes, round(bucket_mb * 2**20) or None, dtype)  # 0: one bucket
            self._col = comm.Split(self.rank % self.per, self.rank)  # a layer's workers
            self._row = comm.Split(self.rank // self.per, self.rank)  # a worker's block

    def works_on(self, i: int) -> bool:
        """Whether this rank preconditions layer ``i`` (it is congruent to its owner mod N / k)."""
        return self.rank % self.per == self.owner[i] % self.per

    # -- the step ----------------------------------------------------------------------------
    def step(self) -> None:
        """Average the factors → fold → decompose (own layers) → share eigenbases → precondition
        (worked-on layers) → share gradients → update; each part timed into ``kfac.seconds``."""
        kfac = self.kfac
        start = wtime()
        self.steps += 1
        if self.n == 1:
            self.inversions += int(kfac.inverting or kfac.layers[0].QA is None)  # as kfac.step() decides
            kfac.step()
            kfac.seconds["step"] += wtime() - start
            return
        self.inversions += int(kfac.inverting)
        t0 = wtime()
        self._average(kfac.batch_factors())
        kfac.seconds["exchange"] += wtime() - t0
        kfac.update_factors()
        if kfac.inverting:
            for i, r in enumerate(self.owner):
                if r == self.rank:
                    kfac.decompose(i)
            t0 = wtime()
            for i in range(len(kfac.layers)):
                if self.works_on(i) and self.k > 1:
                    self._share_eigen(i)
            kfac.seconds["broadcast_eigen"] += wtime() - t0
        for i, e in enumerate(kfac.layers):
            if self.works_on(i):
                kfac.precondition(i)
            else:
                a, g = e.dims
                e.grad = self._empty((g, a))
            if self.per > 1:
                t0 = wtime()
                self._row.Bcast(e.grad, root=self.owner[i] % self.per)
                kfac.seconds["broadcast_grads"] += wtime() - t0
                if self.works_on(i):
                    self.bytes_grads += e.grad.nbytes * (self.per - 1)
        kfac.apply()
        kfac.seconds["step"] += wtime() - start

    def _average(self, factors: list[Any]) -> None:
        """Average this step's batch factors over the ranks (nothing when none were collected)."""
        if not factors:
            return
        buckets, reqs = self._buckets, []
        for b in range(len(buckets)):
            buf = buckets.pack_bucket(b, factors)
            reqs.append(self._coll.Iallreduce(buf, buf))
            self.bytes_factors += 2 * buf.nbytes * (self.n - 1) // self.n  # a ring's bytes sent
        waitall(reqs)
        scale = 1.0 / self.n
        for b in range(len(buckets)):
            buckets.unpack_bucket(b, buckets.buffer(b), factors, scale)

    def _empty(self, shape: tuple[int, ...]) -> Any:
        data = self.kfac.params[0].data
        return get_array_module(data).empty(shape, dtype=data.dtype)

    def _receive_eigen(self, i: int) -> None:
        """Buffers for layer ``i``'s eigenbases and eigenvalues (to receive them into)."""
        e = self.kfac.layers[i]
        a, g = e.dims
        e.QA, e.dA, e.QG, e.dG = (
            self._empty((a, a)),
            self._empty((a,)),
            self._empty((g, g)),
            self._empty((g,)),
        )

    def _share_eigen(self, i: int) -> None:
        """Broadcast layer ``i``'s eigenbases and eigenvalues from its owner to its workers."""
        e, comm = self.kfac.layers[i], self._col
        root = self.owner[i] // self.per
        if comm.Get_rank() != root:
            self._receive_eigen(i)
        for arr in (e.QA, e.dA, e.QG, e.dG):
            comm.Bcast(arr, root=root)
        if comm.Get_rank() == root:
            self.bytes_eigen += sum(x.nbytes for x in (e.QA, e.dA, e.QG, e.dG)) * (comm.Get_size() - 1)

    # -- checkpoints -------------------------------------------------------------------------
    def gather(self) -> None:
        """Send rank 0 the eigenbases of every layer it does not work on (collective)."""
        if self.n == 1 or self.kfac.t == 0:  # nothing decomposed yet (the same on every rank)
            return
        for i, e in enumerate(self.kfac.layers):
            owner = self.owner[i]
            if owner % self.per == 0:
                continue  # rank 0 works on layer i: it holds them
            if self.rank == owner:
                for arr in (e.QA, e.dA, e.QG, e.dG):
                    self._p2p.Send(arr, dest=0, tag=_GATHER_TAG)
            elif self.rank == 0:
                self._receive_eigen(i)
                for arr in (e.QA, e.dA, e.QG, e.dG):
                    self._p2p.Recv(arr, source=owner, tag=_GATHER_TAG)

    def close(self) -> None:
        for c in (self._col, self._row, self._p2p):
            if c is not None:
                c.Free()
        if self._coll is not None:
            self._coll.free()
