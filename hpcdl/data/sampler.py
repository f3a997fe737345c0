"""Which samples each rank trains on: the epoch permutation, strided shards, resumable position.

Shuffle (the default, ``torch.utils.data.DistributedSampler`` with ``drop_last``): each
epoch draws ONE permutation of the ``n`` training samples from
``generator(seed, "epoch", epoch)``, the same on every rank. Only the first
``total = steps * N * B`` entries are used (``steps = n // (N * B)``, the incomplete last
global batch is dropped); rank ``r`` takes the strided shard ``perm[:total][r::N]`` and
cuts it into consecutive batches of ``B``. At step ``k`` rank ``r`` therefore gets
``perm[k*N*B + r + N*j]`` for ``j < B``, and the union of the N ranks' batches is exactly
the global batch ``perm[k*N*B:(k+1)*N*B]`` -- the batch a single rank with batch size
``N * B`` takes at step ``k``. N-rank data-parallel training is thus one-rank training
with the N-times larger batch, on the same samples::

    perm      = [p0 p1 p2 p3 p4 p5 p6 p7 | p8 ...]     N=2, B=4: steps = n // 8
    rank 0    step 0: p0 p2 p4 p6   rank 1 step 0: p1 p3 p5 p7
    1 rank, B=8: step 0: p0 .. p7

Random (``kind="random"``): each rank draws every batch with replacement from its own
stream ``generator(seed, rank, "sampler", epoch)``; any N works (1,024 simulated ranks
on 1,437 samples), ``steps = max(1, n // (N * B))``.

A sampler's position (epoch, step) is what a checkpoint stores: `state` and
`load_state`. Every batch is a pure function of (seed, epoch, step) (and rank), so a
resumed run gets the same batches as one that never stopped.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from hpcdl.errors import DataError
from hpcdl.rng import generator

__all__ = ["DistributedSampler", "KINDS"]

KINDS = ("shuffle", "random")


class DistributedSampler:
    """The batches (sample indices) of one rank, epoch after epoch.

    Typical loop (resumes correctly after ``load_state``)::

        sampler = DistributedSampler(len(ds.y_train), batch_size, comm.rank, comm.size, seed=seed)
        while sampler.epoch < epochs:
            epoch = sampler.epoch
            for step, idx in sampler:        # the rest of this epoch
                x, y = gather_batch(ds.x_train, ds.y_train, idx, xp)
                ...

    Args:
        n_samples: Size of the training set.
        batch_size: Samples per rank and step (``data.batch_size``; the global batch is
            ``size * batch_size``).
        rank: This rank's number, ``0 <= rank < size``.
        size: Number of data-parallel ranks.
        seed: The run's seed.
        kind: ``"shuffle"`` (a shared permutation, disjoint shards) or ``"random"``
            (per-rank draws with replacement).

    Raises:
        DataError: ``size * batch_size > n_samples`` with ``kind="shuffle"`` (the message
            names the numbers and the fixes), or an argument is out of range.
    """

    def __init__(
        self, n_samples: int, batch_size: int, rank: int, size: int, *, seed: int, kind: str = "shuffle"
    ) -> None:
        if kind not in KINDS:
            raise DataError(f"data.sampler must be one of {', '.join(map(repr, KINDS))} (got {kind!r})")
        if n_samples < 1:
            raise DataError(f"the training set is empty (n_samples = {n_samples})")
        if batch_size < 1:
            raise DataError(f"data.batch_size must be a positive integer ({batch_size} < 1)")
        if not 0 <= rank < size:
            raise DataError(f"rank {rank} out of range for {size} ranks")
        global_batch = size * batch_size
        if kind == "shuffle" and global_batch > n_samples:
            fix = (
                f"use data.batch_size <= {n_samples // size}"
                if n_samples >= size
                else f"use at most {n_samples} ranks"
            )
            raise DataError(
                f"{size} ranks x data.batch_size {batch_size} = global batch {global_batch} exceeds "
                f"the {n_samples} training samples: {fix}, or set data.sampler = 'random'"
            )
        self.n_samples, self.batch_size, self.rank, self.size = n_samples, batch_size, rank, size
        self.seed, self.kind = seed, kind
        self.steps_per_epoch = max(1, n_samples // global_batch)
        self._epoch, self._step = 0, 0
        self._table: tuple[int, np.ndarray] | None = None  # (epoch, its index table), reused

    # -- pure: batches as functions of (epoch, step) -------------------------------------

    def epoch_table(self, epoch: int) -> np.ndarray:
        """This rank's indices for a whole epoch, shape (steps_per_epoch, batch_size), read-only."""
        if epoch < 0:
            raise DataError(f"epoch must be non-negative ({epoch} < 0)")
        if self._table is not None and self._table[0] == epoch:
            return self._table[1]
        steps, n, b = self.steps_per_epoch, self.size, self.batch_size
        if self.kind == "shuffle":
            perm = generator(self.seed, "epoch", epoch).permutation(self.n_samples)  # same on all ranks
            table = perm[: steps * n * b][self.rank :: n].reshape(steps, b)  # strided shard
        else:
            rng = generator(self.seed, self.rank, "sampler", epoch)
            table = rng.integers(0, self.n_samples, size=(steps, b), dtype=np.int64)
        table.flags.writeable = False
        self._table = (epoch, table)
        return table

    def indices(self, epoch: int, step: int) -> np.ndarray:
        """This rank's sample indices (int64, length ``batch_size``) at ``step`` of ``epoch``."""
        if not 0 <= step < self.steps_per_epoch:
            raise DataError(f"step {step} out of range: an epoch has {self.steps_per_epoch} steps")
        return self.epoch_table(epoch)[step]

    def epoch_batches(self, epoch: int, start: int = 0) -> Iterator[np.ndarray]:
        """The batches of ``epoch`` from step ``start`` on (does not move the position)."""
        table = self.epoch_table(epoch)
        yield from table[start:]

    # -- stateful: the position a checkpoint stores -----------------------------------------

    @property
    def epoch(self) -> int:
        """The epoch of the next batch."""
        return self._epoch

    @property
    def step(self) -> int:
        """The step (within `epoch`) of the next batch."""
        return self._step

    def __len__(self) -> int:
        return self.steps_per_epoch

    def __iter__(self) -> Iterator[tuple[int, np.ndarray]]:
        """Yield ``(step, indices)`` for the rest of the current epoch, advancing the position.

        A batch counts as taken once yielded: while it is being used, `state` already
        points past it (where a checkpoint written after this step must resume). After
        the last batch the position is (epoch + 1, 0).
        """
        epoch = self._epoch
        while self._epoch == epoch:
            step = self._step
            idx = self.indices(epoch, step)
            if step + 1 == self.steps_per_epoch:
                self._epoch, self._step = epoch + 1, 0
            else:
                self._step = step + 1
            yield step, idx

    def state(self) -> dict[str, Any]:
        """The position and the settings it is valid for; the same on every rank."""
        return {
            "epoch": self._epoch,
            "step": self._step,
            "kind": self.kind,
            "seed": self.seed,
            "size": self.size,
            "batch_size": self.batch_size,
            "n_samples": self.n_samples,
        }

    def load_state(self, state: dict[str, Any]) -> None:
        """Resume at a position from `state`.

        Only ``epoch`` and ``step`` are required; the settings that are present must
        match this sampler's, since a position means nothing under other settings.

        Raises:
            DataError: A setting differs, or the position is out of range.
        """
        mine = self.state()
        settings = [k for k in mine if k not in ("epoch", "step") and k in state]
        differ = [f"{k} {state[k]!r} (now {mine[k]!r})" for k in settings if state[k] != mine[k]]
        if differ:
            raise DataError(
                f"cannot resume the sampler: the checkpoint was written with {', '.join(differ)}; "
                f"resume with the same settings and rank count"
            )
        epoch, step = int(state["epoch"]), int(state["step"])
        if epoch < 0 or not 0 <= step < self.steps_per_epoch:
            raise DataError(
                f"sampler position (epoch {epoch}, step {step}) out of range: an epoch has "
                f"{self.steps_per_epoch} steps"
            )
        self._epoch, self._step = epoch, step
