"""``hpcdl.nn.hooks``: the profiler's rows and nested observers."""

from __future__ import annotations

import numpy as np

from hpcdl.nn import LayerProfiler, Linear, ReLU, Sequential, current_observers, observe


class Recorder:
    """Records ``(tag, event, phase, layer name)`` into a shared list."""

    def __init__(self, tag: str, log: list) -> None:
        self.tag, self.log = tag, log

    def before(self, phase, layer, x):
        self.log.append((self.tag, "before", phase, layer.name))

    def after(self, phase, layer, y):
        self.log.append((self.tag, "after", phase, layer.name))


def mlp() -> Sequential:
    rng = np.random.default_rng(0)
    return Sequential([Linear(3, 5, rng=rng), ReLU(), Linear(5, 2, rng=rng)])


def step(model: Sequential, n: int = 4) -> None:
    y = model.forward(np.ones((n, 3), np.float32))
    model.backward(np.ones_like(y))


def test_profiler_one_row_per_layer_with_output_sizes():
    model = mlp()
    with observe(LayerProfiler()) as prof:
        for _ in range(3):
            step(model)
    rows = prof.table()
    assert [r["layer"] for r in rows] == ["0", "1", "2"]
    assert [r["output_shape"] for r in rows] == [(4, 5), (4, 5), (4, 2)]
    assert [r["output_bytes"] for r in rows] == [80, 80, 32]
    assert all(r["calls"] == 3 and r["forward_s"] >= 0 and r["backward_s"] >= 0 for r in rows)


def test_observers_nest_and_are_removed():
    log: list = []
    model = mlp()
    assert current_observers() == ()
    with observe(Recorder("outer", log)):
        step(model)
        n_outer = len(log)
        with observe(Recorder("inner", log)):
            assert len(current_observers()) == 2
            model.forward(np.ones((2, 3), np.float32))
    assert current_observers() == ()
    step(model)  # no observer: nothing recorded
    assert n_outer == 12  # 3 layers x (forward, backward) x (before, after)
    assert log[:4] == [
        ("outer", "before", "forward", "0"),
        ("outer", "after", "forward", "0"),
        ("outer", "before", "forward", "1"),
        ("outer", "after", "forward", "1"),
    ]
    assert log[n_outer - 2 : n_outer] == [
        ("outer", "before", "backward", "0"),
        ("outer", "after", "backward", "0"),
    ]
    # Nested: befores outermost first, afters innermost first.
    assert log[n_outer : n_outer + 4] == [
        ("outer", "before", "forward", "0"),
        ("inner", "before", "forward", "0"),
        ("inner", "after", "forward", "0"),
        ("outer", "after", "forward", "0"),
    ]
    assert len(log) == n_outer + 12


def test_stage_reports_model_names():
    log: list = []
    stage = mlp()[1:]
    with observe(Recorder("r", log)):
        stage.forward(np.ones((2, 5), np.float32))
    assert [e[3] for e in log] == ["1", "1", "2", "2"]


def test_profiler_sees_a_residual_block_as_one_layer():
    """A projection shortcut is a Sequential inside the block: the hook must not fire inside it."""
    from hpcdl.nn import BasicBlock, GlobalAvgPool2d

    rng = np.random.default_rng(0)
    model = Sequential([BasicBlock(2, 4, stride=2, rng=rng), GlobalAvgPool2d()])
    x = rng.standard_normal((2, 2, 6, 6)).astype(np.float32)
    with observe(LayerProfiler()) as prof:
        y = model.forward(x)
        model.backward(np.ones_like(y))
    rows = prof.table()
    assert [(r["layer"], r["kind"]) for r in rows] == [("0", "BasicBlock"), ("1", "GlobalAvgPool2d")]
    assert [r["calls"] for r in rows] == [1, 1]
    assert sorted(prof.times) == [("0", "backward"), ("0", "forward"), ("1", "backward"), ("1", "forward")]
