"""Seeded random streams keyed by purpose (and by rank where ranks must differ)."""

from __future__ import annotations

import zlib

import numpy as np

__all__ = ["generator"]


def _key(part: int | str) -> int:
    if isinstance(part, str):
        return zlib.crc32(part.encode())  # stable across processes, unlike hash()
    if part < 0:
        raise ValueError(f"stream key parts must be non-negative ({part} < 0)")
    return int(part)


def generator(seed: int, *key: int | str) -> np.random.Generator:
    """A NumPy generator from ``seed`` and a key such as ``("init",)`` or ``(rank, "dropout")``.

    Streams that all ranks must agree on (weight initialisation, the epoch
    permutation) take a key without the rank; streams that must differ between
    ranks (dropout, the ``random`` sampler) put the rank in the key. The same
    (seed, key) gives the same stream in every process and in the simulator.
    """
    return np.random.Generator(
        np.random.PCG64(np.random.SeedSequence(entropy=_key(seed), spawn_key=[_key(k) for k in key]))
    )
