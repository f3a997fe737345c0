"""Full-accuracy training of the digits presets (slow: `make test-slow`).

Targets: digits-mlp >= 97% and digits-cnn >= 98% test accuracy, single-process here
and under mpiexec (-n 2 and -n 4) in the MPI variant below. Durations are printed for
the record, never asserted.
"""

from __future__ import annotations

import pytest

from hpcdl.comm import world
from hpcdl.config import load_config
from hpcdl.train import run

TARGETS = {"digits-mlp": 0.97, "digits-cnn": 0.98}


def _train_and_check(preset: str) -> None:
    comm = world()
    result = run(load_config(preset), comm)
    if comm.Get_rank() == 0:
        print(f"\n{result.summary()}")
    assert result.test_accuracy >= TARGETS[preset], result.summary()


@pytest.mark.slow
@pytest.mark.parametrize("preset", sorted(TARGETS))
def test_preset_reaches_target_single_process(preset: str) -> None:
    _train_and_check(preset)


@pytest.mark.slow
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("preset", sorted(TARGETS))
def test_preset_reaches_target_data_parallel(preset: str) -> None:
    _train_and_check(preset)
