"""The ``local`` strategy with its rounds recorded, for the tests (not shipped): loaded as
``local_recording:RecordingLocal``. Each rank appends, for every round it attends, the step,
the round's members and contributors, and its weights before and after (packed, copies)."""

from __future__ import annotations

from typing import Any

import numpy as np

from hpcdl.parallel.local import LocalAveraging

#: rank -> its rounds: (step, members, contributors, weights before, weights after); the
#: simulator's virtual ranks share one process, so a test sees every rank's (under MPI: its own)
ROUNDS: dict[int, list[tuple[int, tuple[int, ...], tuple[int, ...], np.ndarray, np.ndarray]]] = {}


def packed(arrays: list[Any]) -> np.ndarray:
    return np.concatenate([np.asarray(a).ravel() for a in arrays])


class RecordingLocal(LocalAveraging):
    """:class:`LocalAveraging` recording its rounds in :data:`ROUNDS`."""

    def average(self, step: int) -> None:
        members, contributors = self.contributors(step)
        before = packed(self.arrays)
        super().average(step)
        if self.rank in members:
            after = packed(self.arrays)
            ROUNDS.setdefault(self.rank, []).append((step, members, contributors, before, after))


def check_rounds(rounds: dict[int, list], tau: int, steps: int) -> dict[int, dict[int, tuple]]:
    """Every round's members hold the mean of exactly its contributors' weights before it, computed here."""
    by_step: dict[int, dict[int, tuple]] = {}
    for rank, mine in rounds.items():
        for step, members, contributors, before, after in mine:
            by_step.setdefault(step, {})[rank] = (members, contributors, before, after)
    assert sorted(by_step) == list(range(tau - 1, steps, tau))
    for step, ranks in by_step.items():
        members, contributors, _, _ = next(iter(ranks.values()))
        assert tuple(sorted(ranks)) == members, (step, sorted(ranks), members)
        want = np.mean([ranks[r][2] for r in contributors], axis=0)
        for r in members:
            np.testing.assert_allclose(ranks[r][3], want, rtol=1e-13, atol=1e-13, err_msg=f"rank {r}, {step}")
    return by_step
