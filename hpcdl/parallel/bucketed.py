"""Synchronous data parallel with gradient buckets reduced while backward runs (DDP-style)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hpcdl.backend import synchronize
from hpcdl.comm import Communicator, waitall, wtime
from hpcdl.comm.buckets import Buckets
from hpcdl.comm.collectives import Collectives, CollRequest
from hpcdl.nn.layer import Layer
from hpcdl.nn.parameter import Parameter
from hpcdl.parallel.exchange import LocalExchange, broadcast_parameters

__all__ = ["BucketedExchange", "DEFAULT_BUCKET_MB"]

#: bucket size in MiB when the config does not say (PyTorch DDP's default is 25)
DEFAULT_BUCKET_MB = 25.0


class BucketedExchange(LocalExchange):
    """Gradients are packed into buckets as backward produces them, last layers first.

    The exchange is a per-layer observer (:mod:`hpcdl.nn.hooks`): after each layer's
    backward, its parameters' gradients are final; when that completes a bucket, the
    bucket is packed and its nonblocking allreduce (hpcdl's own collectives, no
    threads) starts at once. Between layers every request in flight is advanced with
    ``Test()``. :meth:`exchange`, called after backward, waits for what is left and
    unpacks with scale 1/N: only that wait is *exposed* communication.

    Buckets are released in bucket order on every rank (:meth:`Buckets.mark_ready`),
    so all ranks start their collectives in the same order, as MPI requires.
    """

    def __init__(
        self,
        comm: Communicator,
        params: Sequence[Parameter],
        debug: bool = False,
        *,
        bucket_mb: float = DEFAULT_BUCKET_MB,
        algorithm: str = "auto",
        auto_threshold_kb: float = 512.0,
    ) -> None:
        super().__init__(comm, params, debug)
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self.buckets = Buckets([p.grad for p in self.params], int(bucket_mb * 2**20) or None)
        self.coll = Collectives(comm, algorithm, auto_threshold=int(auto_threshold_kb * 1024))
        self.exposed_time = 0.0
        self._grads = [p.grad for p in self.params]
        self._layer_params: dict[int, list[int]] = {}
        self._reqs: list[CollRequest | None] = []
        self._marked: set[int] = set()  # gradients final in this backward

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
            self._marked.add(i)
            for b in self.buckets.mark_ready(i):
                self._start(b)
        for req in self._reqs:  # progress what is in flight while backward goes on
            if req:
                req.Test()
        self.comm_time += wtime() - t0

    def _indices(self, layer: Layer) -> list[int]:
        key = id(layer)
        found = self._layer_params.get(key)
        if found is None:
            found = [self.index[id(p)] for p in layer.parameters() if id(p) in self.index]
            self._layer_params[key] = found
        return found

    def _start(self, b: int) -> None:
        buf = self.buckets.pack_bucket(b, self._grads)
        synchronize(buf)
        self._reqs.append(self.coll.Iallreduce(buf, buf))
        self.bytes_sent += int(buf.nbytes)

    # -- after backward ------------------------------------------------------------------
    def exchange(self) -> None:
        """Finish every bucket's allreduce and unpack the averages into ``.grad``."""
        if self.debug:
            self._check_ready()
        t0 = wtime()
        for i in range(len(self.params)):  # parameters no observed layer reported (e.g. unused)
            if i not in self._marked:
                for b in self.buckets.mark_ready(i):
                    self._start(b)
        waitall(self._reqs)
        scale = 1.0 / self.comm.Get_size()
        for b in range(len(self.buckets)):
            self.buckets.unpack_bucket(b, self.buckets.buffer(b), self._grads, scale=scale)
        self._reqs = []
        self._marked.clear()
        self.buckets.reset()
        dt = wtime() - t0
        self.exposed_time += dt
        self.comm_time += dt

    def free(self) -> None:
        """Release the duplicated communicator of the collectives (collective)."""
        self.coll.free()
