"""Weight initialisation: the simulator's shared draws give what drawing does."""

from __future__ import annotations

import copy

import numpy as np

from hpcdl.models import build_model
from hpcdl.nn.init import kaiming_normal, shared_draws


def test_shared_draws_are_the_draws_and_move_the_stream_alike() -> None:
    alone = np.random.default_rng(7)
    drawn = [kaiming_normal((5, 3), 3, rng=alone), kaiming_normal((4,), 2, rng=alone)]
    with shared_draws():
        ranks = [np.random.default_rng(7) for _ in range(3)]
        shared = [[kaiming_normal((5, 3), 3, rng=r), kaiming_normal((4,), 2, rng=r)] for r in ranks]
    for weights, rng in zip(shared, ranks):
        for w, d in zip(weights, drawn):
            assert w.dtype == d.dtype and np.array_equal(w, d)
        assert rng.bit_generator.state == alone.bit_generator.state  # as if it had drawn
        assert rng.standard_normal() == copy.deepcopy(alone).standard_normal()
    shared[0][0][0, 0] += 1.0  # each rank's copy is its own
    assert shared[1][0][0, 0] == drawn[0][0, 0]


def test_shared_draws_other_states_draw_their_own() -> None:
    with shared_draws():
        a = kaiming_normal((3, 3), 3, rng=np.random.default_rng(1))
        b = kaiming_normal((3, 3), 3, rng=np.random.default_rng(2))
        c = kaiming_normal((3, 3), 9, rng=np.random.default_rng(1))  # another std
    assert np.array_equal(a, kaiming_normal((3, 3), 3, rng=np.random.default_rng(1)))
    assert np.array_equal(b, kaiming_normal((3, 3), 3, rng=np.random.default_rng(2)))
    assert np.array_equal(c, kaiming_normal((3, 3), 9, rng=np.random.default_rng(1)))


def test_a_model_built_under_shared_draws_is_the_model() -> None:
    def build() -> list[np.ndarray]:
        model = build_model("mlp", (1, 4, 4), 3, rng=np.random.default_rng(0), depth=3, width=8)
        return [p.data for p in model.parameters()]

    with shared_draws():
        first, second = build(), build()
    for a, b, c in zip(build(), first, second):
        assert np.array_equal(a, b) and np.array_equal(a, c)
