"""A toy strategy for the tests (not shipped): two roles, and ranks that meet every k steps.

Rank 0 is a *keeper*: it reads no batches and holds the average of the workers' weights.
Ranks 1..N-1 are *workers*: each trains its own replica on its own batches with no
communication at all, and every ``toy.every`` steps (a meeting) the workers' weights are
summed over the world (the keeper adds zeros), every worker continues from their mean, and
the keeper keeps it. This is local SGD with a keeper; what matters here is that it is not
sync data parallel: ranks with different roles and pieces, batches only on some ranks,
and the driver's periodic work at meetings only.

It also shows everything a strategy declares of its own, in this one module: a config key
(``toy.every``, which fixes the trajectory: a fit key), a metric column (``meetings``), a
row table (``spread/``: how far the workers' weights drifted apart before each averaging,
cut by its ``step`` on resume) and a figure of the report (``spread.png``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from hpcdl import comm as ops
from hpcdl.comm import wtime
from hpcdl.comm.pack import Packer
from hpcdl.components import Declares, Key, Plot, Table
from hpcdl.nn import SoftmaxCrossEntropy
from hpcdl.parallel import Agreement, LockstepStrategy, Placement, RankPlace, StepStats
from hpcdl.parallel.common import forward_backward, mean_over_contributors
from hpcdl.parallel.conformance import Case, Conformance

#: steps between meetings, by default
TOY_K = 4


def spread_figure(runs: list[tuple[Any, str]]) -> Any:
    """The workers' spread before each averaging, per run (None: no run has ``spread/`` rows)."""
    shown = [(r, n) for r, n in runs if len(r.tables.get("spread", {}).get("step", ()))]
    if not shown:
        return None
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for run, name in shown:
        ax.plot(run.tables["spread"]["step"], run.tables["spread"]["spread"], "o-", label=name)
    ax.set_xlabel("step of the meeting")
    ax.set_ylabel("largest |worker weight - mean| before averaging")
    ax.legend(fontsize="small")
    return fig


#: what the toy declares: its key, fit key, metric column, row table and figure
DECLARES = Declares(
    keys={"toy.every": Key(int, TOY_K, "toy: steps between the workers' averaging", minimum=1)},
    fit_keys=("toy.every",),
    metrics={"meetings": "int64"},
    tables={"spread": Table({"step": "int64", "spread": "float64"}, cut_by="step")},
    plots=(Plot("spread", spread_figure),),
)


def one_worker_is_one_process(cfg: Any, world: int) -> tuple[dict[str, Any], int] | None:
    """With one worker (2 ranks) the average is the worker's own weights: one process training
    alone, step for step. More workers average local SGD: no simpler run to compare with."""
    return ({"parallel.strategy": "sync"}, 1) if world == 2 else None


class KeeperAveraging(LockstepStrategy):
    """Workers step alone; every :data:`TOY_K` steps their weights are averaged (the keeper keeps it)."""

    name = "toy"
    keys = ("toy.",)
    declares = DECLARES
    conformance = Conformance({"toy": Case(reference=one_worker_is_one_process)}, min_ranks=2)

    @classmethod
    def plan(cls, cfg: Any, world: int) -> Placement:
        if world < 2:
            from hpcdl.errors import ConfigError

            raise ConfigError(f"the toy strategy needs a keeper and a worker: 2 ranks or more ({world})")
        ranks = [RankPlace("keeper", "average")]
        ranks += [RankPlace("worker", f"replica {w}", w) for w in range(world - 1)]
        notes = (f"the ranks meet every {cfg['toy.every']} steps",)
        return Placement(cls.name, tuple(ranks), cfg["data.batch_size"], notes=notes)

    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        self.comm = ctx.comm
        self.member = ctx.placement.ranks[ctx.rank].member
        self.model = ctx.build_model()
        self.params = self.model.parameters()
        self.packer = Packer([p.data for p in self.params])
        self.lr = ctx.schedule()
        self.optimizer = ctx.optimizer(self.params) if self.member >= 0 else None
        self.sampler = ctx.sampler(self.member) if self.member >= 0 else None
        self.loss_fn = SoftmaxCrossEntropy()
        self.meetings = 0
        self.done = 0
        self.bytes_sent = 0
        self._epoch_batches: Any = None

    def meets_after(self, step: int) -> bool:
        return step % self.ctx.cfg["toy.every"] == 0

    def step(self, step: int) -> StepStats:
        self.done = step + 1  # the steps done after this one (a meeting's step)
        if self.member < 0:
            return StepStats()  # the keeper waits for the meeting
        if self._epoch_batches is None:
            self._epoch_batches = iter(self.sampler)
        batch = next(self._epoch_batches, None)
        if batch is None:  # the epoch is over
            self._epoch_batches = iter(self.sampler)
            batch = next(self._epoch_batches)
        indices = batch[1]
        x, y = self.ctx.batch(indices)
        self.optimizer.lr = self.lr(step)
        loss, correct = forward_backward(self.model, self.loss_fn, x, y)
        self.optimizer.step()
        return StepStats(loss=loss, correct=correct, samples=len(indices), lr=self.optimizer.lr)

    def agree(self, stats: Sequence[StepStats], stop: bool) -> Agreement:
        """The meeting: average the workers' weights over the world, then the metrics."""
        self.meetings += 1
        mine = self.packer.pack([p.data for p in self.params])
        if self.member < 0:
            mine = np.zeros_like(mine)
        total = np.empty_like(mine)
        t0 = wtime()
        self.comm.Allreduce(mine, total, op=ops.SUM)
        averaging = wtime() - t0
        self.bytes_sent += int(mine.nbytes)
        mean = total / self.ctx.placement.width
        drift = float(np.abs(mine - mean).max()) if self.member >= 0 else 0.0
        spread = self.comm.allreduce(drift, op=ops.MAX)
        self.packer.unpack(total, [p.data for p in self.params], scale=1.0 / self.ctx.placement.width)
        agreed = mean_over_contributors(self.comm, stats, stop)
        agreed.comm_s, agreed.bytes_sent = averaging, self.bytes_sent  # the averaging is the meeting's
        for row in agreed.rows:
            row["meetings"] = self.meetings
        agreed.tables = {"spread": {"step": [self.done], "spread": [spread]}}
        return agreed

    def evaluate(self) -> tuple[float, float]:
        """The keeper's average on the whole test set (every rank holds it after a meeting)."""
        return self.ctx.evaluate(self.model, self.comm)

    def serialize(self, s: Any) -> None:
        """The rank's piece (the keeper's average, a worker's replica and optimizer), the sampler's
        position (workers), the random streams and the counters."""
        holds = self.ctx.placement.ranks[self.ctx.rank].holds
        s.piece(holds, model=self.model, optimizer=self.optimizer)
        s.random(self.ctx)
        if self.sampler is not None:  # the keeper reads no batches
            s.stateful("sampler", self.sampler)
        self.meetings = int(s.value("meetings", self.meetings))
        self.bytes_sent = int(s.value("bytes_sent", self.bytes_sent))
        if s.loading:
            self._epoch_batches = None
