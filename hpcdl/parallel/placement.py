"""Placement: what every rank of a run does and holds, and the batch arithmetic, as data.

Before anything is built, a strategy says (:meth:`hpcdl.parallel.Strategy.plan`) what each
rank does and holds, which ranks read which batches, and the batch arithmetic; the
learning-rate scaling rule and the global batch use its data-parallel width, not the
world size. ``python -m hpcdl.train --plan`` prints it; checkpoints record it, and a resume
under another placement is refused.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from hpcdl.errors import ConfigError

__all__ = ["Placement", "RankPlace"]


@dataclass(frozen=True)
class RankPlace:
    """One rank's place in a strategy.

    Attributes:
        role: what the rank does (``worker``, ``server``, ``stage 2``, ``switch``, ...).
        holds: the piece of training state it holds (``model``, ``shard 1``, ...); ranks
            holding the same piece hold equal copies of it, and a checkpoint stores it once
            (from its first holder). ``""``: none.
        member: the data-parallel member whose batches this rank processes (the index of
            its stream of samples, ``0 <= member < width``); -1: it reads no batches.
    """

    role: str
    holds: str = ""
    member: int = -1


@dataclass(frozen=True)
class Placement:
    """What every rank of a run does, before anything is built (pure data).

    Attributes:
        strategy: the strategy's name.
        ranks: one :class:`RankPlace` per world rank.
        batch_size: samples per data-parallel member and micro-step (``data.batch_size``).
        micro_steps: micro-steps per optimizer step (``exchange.accumulate`` for sync).
        notes: lines a strategy adds to the ``--plan`` printout (a partition, a schedule).
        step_batches: batches of ``batch_size`` one step (one row of the run file) processes;
            0: ``width x micro_steps`` (a global batch). A parameter server's step is one
            push: 1.
        update_batches: batches one optimizer update averages, which ``schedule.scale``
            scales the learning rate by; 0: ``width x micro_steps``. A parameter server's
            asynchronous push: 1; its synchronous round: the W workers' batches.
        step_multiple: steps come in groups of this many (a synchronous round of W
            pushes): an epoch is a whole number of groups.
    """

    strategy: str
    ranks: tuple[RankPlace, ...]
    batch_size: int
    micro_steps: int = 1
    notes: tuple[str, ...] = field(default=())
    step_batches: int = 0
    update_batches: int = 0
    step_multiple: int = 1

    @property
    def world(self) -> int:
        """Number of ranks."""
        return len(self.ranks)

    @property
    def width(self) -> int:
        """Data-parallel width: the number of members whose batches make one global batch."""
        return len({p.member for p in self.ranks if p.member >= 0})

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step: width x micro-steps x batch."""
        return self.width * self.micro_steps * self.batch_size

    @property
    def step_samples(self) -> int:
        """Training samples one step processes (the unit of ``train.steps`` and of epochs)."""
        return (self.step_batches or self.width * self.micro_steps) * self.batch_size

    @property
    def scale_batches(self) -> int:
        """Batches one optimizer update averages (what ``schedule.scale`` scales by)."""
        return self.update_batches or self.width * self.micro_steps

    def holders(self, piece: str) -> list[int]:
        """The ranks holding ``piece``, in rank order (the first writes it to checkpoints)."""
        return [r for r, p in enumerate(self.ranks) if p.holds == piece]

    def pieces(self) -> list[str]:
        """The pieces of state held, in order of their first holder."""
        return list(dict.fromkeys(p.holds for p in self.ranks if p.holds))

    def __post_init__(self) -> None:
        if self.ranks and self.width < 1:
            raise ConfigError(f"strategy {self.strategy!r} has no rank read batches: nothing would train")

    def same_as(self, other: Placement) -> bool:
        """The same roles, pieces, members and batch arithmetic (``notes`` are only words)."""
        return self._key() == other._key()

    def _key(self) -> tuple[Any, ...]:
        return (self.strategy, self.ranks, self.batch_size, self.micro_steps, self.step_samples,
                self.scale_batches, self.step_multiple)  # fmt: skip

    def to_json(self) -> str:
        """The placement as JSON text (stored in checkpoints)."""
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Placement:
        """The placement :meth:`to_json` wrote."""
        d = json.loads(text)
        return cls(
            strategy=d["strategy"],
            ranks=tuple(RankPlace(**p) for p in d["ranks"]),
            batch_size=int(d["batch_size"]),
            micro_steps=int(d.get("micro_steps", 1)),
            notes=tuple(d.get("notes", ())),
            step_batches=int(d.get("step_batches", 0)),
            update_batches=int(d.get("update_batches", 0)),
            step_multiple=int(d.get("step_multiple", 1)),
        )

    def summary(self) -> str:
        """One line: ``sync on 3 ranks: ranks 0-2 worker holding model``."""
        groups = ", ".join(
            f"{_ranks(rs)} {place.role}" + (f" holding {place.holds}" if place.holds else "")
            for place, rs in self._runs()
        )
        return f"{self.strategy} on {self.world} rank{'s' * (self.world > 1)}: {groups}"

    def table(self) -> str:
        """The placement as a table (``--plan``): runs of like ranks on one line each."""
        if self.step_batches:  # steps that are not global batches (a push)
            arithmetic = (
                f"data-parallel width {self.width}, one step = {self.step_batches} batch"
                f"{'es' * (self.step_batches > 1)} of {self.batch_size} ({self.step_samples} samples), "
                f"one update averages {self.scale_batches} batch{'es' * (self.scale_batches > 1)}"
            )
        else:
            arithmetic = (
                f"data-parallel width {self.width}, global batch {self.global_batch} = {self.width} x "
                f"{self.micro_steps} micro-step{'s' * (self.micro_steps > 1)} x {self.batch_size}"
            )
        lines = [
            f"strategy {self.strategy} on {self.world} rank{'s' * (self.world > 1)}: {arithmetic}",
            "",
        ]
        runs = self._runs()
        wide = max([13, *(len(_ranks(rs)) for _, rs in runs), *(len(p.role) for p, _ in runs)]) + 1
        lines.append(f"{'ranks':<{wide}}{'role':<{wide}}{'holds':<24}data-parallel member")
        for place, rs in runs:
            members = [self.ranks[r].member for r in rs]
            member = "-" if members[0] < 0 else _span(sorted(set(members)))
            lines.append(f"{_ranks(rs):<{wide}}{place.role:<{wide}}{place.holds or '-':<24}{member}")
        return "\n".join([*lines, *(["", *self.notes] if self.notes else [])])

    def _runs(self) -> list[tuple[RankPlace, list[int]]]:
        """Consecutive ranks with the same role and piece, whose members count up with them (or
        are one member: a pipeline stage's replicas)."""
        runs: list[tuple[RankPlace, list[int]]] = []
        for r, place in enumerate(self.ranks):
            if runs:
                head, rs = runs[-1]
                last = self.ranks[rs[-1]]
                steps_with = place.member == last.member or place.member == last.member + 1
                if (place.role, place.holds) == (head.role, head.holds) and steps_with:
                    rs.append(r)
                    continue
            runs.append((place, [r]))
        return runs


def _span(values: Sequence[int]) -> str:
    """``3``, ``0-7`` (consecutive), ``1,4,9``."""
    if len(values) == 1:
        return str(values[0])
    if list(values) == list(range(values[0], values[-1] + 1)):
        return f"{values[0]}-{values[-1]}"
    return ",".join(map(str, values))


def _ranks(ranks: Sequence[int]) -> str:
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {_span(ranks)}"
