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


def _train_and_check(preset: str, sets: tuple[str, ...] = ()) -> None:
    comm = world()
    result = run(load_config(preset, list(sets)), comm)
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


@pytest.mark.slow
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("compression", ["float16", "int32"])
def test_compressed_exchange_reaches_target(compression: str) -> None:
    """Gradients on the wire in 2 bytes (summed in float32) or quantized int32 still reach the target."""
    _train_and_check("digits-mlp", (f'exchange.compression="{compression}"',))


@pytest.mark.slow
def test_accumulation_reaches_target_single_process() -> None:
    """Two micro-steps of 16 per step (global batch 32, as the preset): the same target."""
    _train_and_check("digits-mlp", ("data.batch_size=16", "exchange.accumulate=2"))
