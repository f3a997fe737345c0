"""``hpcdl.sim.compute``: measured, none and cost-table models, their jitter, contention and errors."""

from __future__ import annotations

import json
import math
import tomllib
from pathlib import Path

import h5py
import numpy as np
import pytest

from hpcdl.config import load_config
from hpcdl.errors import ConfigError
from hpcdl.nn import Linear, ReLU, Sequential, observe
from hpcdl.rng import generator
from hpcdl.sim.compute import (
    Contention,
    CostTableError,
    LayerCost,
    MeasuredCompute,
    TableCompute,
    load_cost_table,
    make_compute,
    parse_stragglers,
)
from hpcdl.sim.network import load_network, parse_network
from hpcdl.sim.ticks import TICKS_PER_SECOND, seconds, ticks
from hpcdl.train import run


class Charges:
    """The ``charge`` callback: records every charge."""

    def __init__(self) -> None:
        self.log: list[int] = []

    def __call__(self, t: int) -> None:
        self.log.append(t)

    @property
    def total(self) -> int:
        return sum(self.log)


def mlp() -> Sequential:
    rng = np.random.default_rng(0)
    return Sequential([Linear(3, 5, rng=rng), ReLU(), Linear(5, 2, rng=rng)])


def step(model: Sequential, n: int = 4) -> None:
    y = model.forward(np.ones((n, 3), np.float32))
    model.backward(np.ones_like(y))


# -- measured and none ------------------------------------------------------------------------


def test_measured_scales_by_speed_and_straggler_exactly():
    m = make_compute("measured", speed=2.0, stragglers={3: 3.0})
    assert m.segment(0, 1e-3) == 500_000_000  # 1 ms at speed 2
    assert m.segment(3, 1e-3) == 1_500_000_000  # x3 straggler
    assert m.segment(1, 0.25) == ticks(0.125)
    assert m.segment(0, 0.0) == 0 and m.segment(0, -1e-6) == 0
    assert make_compute("measured").segment(5, 1e-3) == ticks(1e-3) == 10**9
    slow = make_compute("measured", speed=0.5)
    assert slow.segment(0, 1e-3) == 2 * 10**9


def test_none_charges_nothing_and_has_no_observer():
    m = make_compute("none", speed=3.0, jitter=0.5, stragglers={0: 4.0})
    assert [m.segment(r, s) for r in range(3) for s in (0.0, 1e-3, 10.0)] == [0] * 9
    assert m.layer_observer(0, Charges()) is None
    assert make_compute("measured").layer_observer(0, Charges()) is None
    assert m.name == "none"


def test_jitter_is_the_documented_lognormal_per_seed_and_rank():
    m = make_compute("measured", seed=7, jitter=0.2)
    got = [m.segment(2, 1e-3) for _ in range(50)]
    sigma = math.sqrt(math.log(1 + 0.2**2))
    draws = generator(7, 2, "sim-jitter").lognormal(-0.5 * sigma**2, sigma, size=50)
    assert got == [round(1e-3 * float(d) * TICKS_PER_SECOND) for d in draws]


def test_jitter_reproducible_and_different_across_ranks_and_seeds():
    def seq(seed: int, rank: int) -> list[int]:
        m = make_compute("measured", seed=seed, jitter=0.1)
        return [m.segment(rank, 1e-3) for _ in range(20)]

    assert seq(1, 0) == seq(1, 0)
    assert seq(1, 0) != seq(1, 1)
    assert seq(1, 0) != seq(2, 0)
    # per-rank streams are independent of the order in which ranks draw
    m = make_compute("measured", seed=1, jitter=0.1)
    interleaved = [(m.segment(0, 1e-3), m.segment(1, 1e-3)) for _ in range(20)]
    assert [a for a, _ in interleaved] == seq(1, 0)
    assert [b for _, b in interleaved] == seq(1, 1)


def test_jitter_has_mean_one_and_the_requested_relative_std():
    m = make_compute("measured", seed=3, jitter=0.1)
    f = np.array([m.segment(0, 1.0) for _ in range(20_000)]) / TICKS_PER_SECOND
    assert f.min() > 0
    assert abs(f.mean() - 1.0) < 0.005  # std of the mean ~ 0.0007
    assert abs(f.std() / f.mean() - 0.1) < 0.01


def test_jitter_and_straggler_combine():
    plain = make_compute("measured", seed=4, jitter=0.1)
    slow = make_compute("measured", seed=4, jitter=0.1, speed=2.0, stragglers={1: 4.0})
    for _ in range(10):
        a, b = plain.segment(1, 1e-3), slow.segment(1, 1e-3)
        assert abs(b - 2 * a) <= 2  # x4 / 2, each side rounded once


def test_describe_is_json():
    m = make_compute("measured", speed=2.0, seed=5, jitter=0.05, stragglers={3: 2.0})
    d = json.loads(json.dumps(m.describe()))
    assert d["mode"] == "measured" and d["speed"] == 2.0 and d["seed"] == 5
    assert d["jitter"] == 0.05 and d["stragglers"] == {"3": 2.0} and "lognormal" in d["jitter_distribution"]
    assert json.loads(json.dumps(make_compute("none").describe())) == {"mode": "none"}


# -- contention -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("factors", "rpn", "nranks", "by_rank"),
    [
        ((1.0, 1.5), 0, 2, [1.5, 1.5]),  # one node of 2
        ((1.0, 1.5), 0, 1, [1.0]),  # one rank alone
        ((1.0, 1.5), 0, 5, [1.5] * 5),  # 5 on the node, past the list: the last entry
        ((1.0, 1.2, 1.3, 1.4), 4, 10, [1.4] * 8 + [1.2] * 2),  # nodes of 4, 4 and a partial 2
        ((1.1, 1.2, 1.3), 2, 5, [1.2] * 4 + [1.1]),  # the last node holds one rank
        ((1.0, 1.5), 1, 3, [1.0, 1.0, 1.0]),  # a rank per node
        ((), 0, 4, [1.0] * 4),  # no factors: none
    ],
)
def test_contention_factor_by_ranks_on_the_node(factors, rpn, nranks, by_rank):
    c = Contention(factors, rpn, nranks)
    assert [c.factor(r) for r in range(nranks)] == by_rank
    m = make_compute("measured", contention=c)
    assert [m.segment(r, 1.0) for r in range(nranks)] == [round(f * TICKS_PER_SECOND) for f in by_rank]


def test_contention_node_sizes_and_description():
    c = Contention((1.0, 1.2, 1.3, 1.4), 4, 10)
    assert [c.ranks_on_node(r) for r in range(10)] == [4] * 8 + [2] * 2
    assert Contention((1.5,), 0, 7).ranks_on_node(6) == 7
    d = json.loads(json.dumps(make_compute("measured", contention=c).describe()))
    assert d["contention"] == {
        "factors": [1.0, 1.2, 1.3, 1.4],
        "ranks_per_node": 4,
        "factor_by_ranks_on_node": {"2": 1.2, "4": 1.4},
    }
    none = make_compute("measured").describe()["contention"]  # default: none
    assert none["factors"] == [] and none["factor_by_ranks_on_node"] == {}
    with pytest.raises(ValueError, match=r"rank 10 is outside \[0, 10\)"):
        c.factor(10)


def test_contention_multiplies_the_measured_charge_exactly():
    c = Contention((1.0, 1.5), 0, 2)
    m = make_compute("measured", contention=c, speed=2.0, stragglers={1: 3.0})
    assert m.segment(0, 1e-3) == 750_000_000  # 1 ms / 2 x 1.5
    assert m.segment(1, 1e-3) == 2_250_000_000  # x3 straggler too
    assert m.segment(0, 0.0) == 0
    # jitter draws are the same with and without contention: the factor multiplies them
    plain = make_compute("measured", seed=3, jitter=0.1)
    slow = make_compute("measured", seed=3, jitter=0.1, contention=Contention((1.0, 2.0), 0, 2))
    for _ in range(10):
        assert abs(slow.segment(1, 1e-3) - 2 * plain.segment(1, 1e-3)) <= 1


def test_contention_does_not_touch_none_or_tables(tmp_path):
    c = Contention((1.0, 3.0), 0, 2)
    assert make_compute("none", contention=c).segment(0, 1.0) == 0
    table = write(tmp_path / "t.csv", "layer,forward_s,backward_s\n0,1,2\n1,3,4\n2,5,6\n")
    for contention in (None, c):
        m = make_compute(f"table:{table}", contention=contention)
        charges = Charges()
        with observe(m.layer_observer(1, charges)):
            step(mlp())
        assert charges.total == ticks(21.0) and m.segment(1, 1.0) == 0
        assert "contention" not in m.describe()


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (((0.9,), 0, 2), r"contention factors must be numbers >= 1 \(\[0.9\]\)"),
        (((1.0, float("nan")), 0, 2), r"contention factors must be numbers >= 1"),
        (((1.0,), -1, 2), r"ranks_per_node >= 0 and nranks >= 1 \(-1, 2\)"),
        (((1.0,), 0, 0), r"ranks_per_node >= 0 and nranks >= 1 \(0, 0\)"),
    ],
)
def test_bad_contention(args, match):
    with pytest.raises(ConfigError, match=match):
        Contention(*args)


class FixedSegments(MeasuredCompute):
    """Measured compute whose every segment took exactly 1 ms of wall time (no timing in the test)."""

    def segment(self, rank: int, measured_s: float) -> int:
        return super().segment(rank, 1e-3)


def test_contention_reaches_the_virtual_clock_in_the_engine():
    """Through :func:`hpcdl.sim.engine.simulate`: one segment per rank, x the factor of its node."""
    import hpcdl.comm as hc
    from hpcdl.sim.engine import simulate

    def target() -> float:
        return hc.wtime()  # the one segment: from the start to here

    text = (
        "ranks_per_node = 2\n[intra]\nlatency_us = 1\nbandwidth_GBps = 1\n"
        "[inter]\nlatency_us = 1\nbandwidth_GBps = 1\n[compute]\ncontention = [1.0, 1.5]\n"
    )
    network = parse_network(tomllib.loads(text), "test", where="test network")
    compute = FixedSegments(contention=Contention.of_network(network, 3))
    result = simulate(3, target, network=network, compute=compute)
    assert result.results == [1.5e-3, 1.5e-3, 1e-3]  # ranks 0, 1 share a node; rank 2 is alone

    # the default compute model takes the network's contention (it says so in the run's attributes)
    def described() -> dict:
        return json.loads(hc.world().sim_attrs()["compute"])["contention"]

    result = simulate(3, described, network=network)
    assert result.results[0]["factor_by_ranks_on_node"] == {"1": 1.0, "2": 1.5}
    result = simulate(2, described, network=load_network("eth10g"))
    assert result.results[0]["factors"] == []


def test_a_memory_pass_is_charged_by_the_networks_memory_rate_not_measured():
    """``memory_pass`` (the allreduce shm's pass): at ``intra.memory_GBps`` per byte in place of
    its wall time, the segments before and after it measured as usual; without the rate, it is
    measured compute like any other."""

    import hpcdl.comm as hc
    from hpcdl.sim.engine import simulate

    def target() -> float:
        hc.world().memory_pass(lambda: None, 4_000_000)  # 4 MB at 4 GB/s: 1 ms
        return hc.wtime()

    text = "ranks_per_node = 0\n[intra]\nlatency_us = 1\nbandwidth_GBps = 1\n"
    rated = parse_network(tomllib.loads(text + "memory_GBps = 4.0\n"), "test", where="test network")
    plain = parse_network(tomllib.loads(text), "test", where="test network")
    # every segment 1 ms: with the rate, the segment is cut in two around 1 ms of memory (measured
    # with the work inside a segment it would be 2 ms); without it, the work is in the one segment
    assert simulate(2, target, network=rated, compute=FixedSegments()).results == [3e-3, 3e-3]
    assert simulate(2, target, network=plain, compute=FixedSegments()).results == [1e-3, 1e-3]


# -- cost tables ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def profiled(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Sequential]:
    """A real digits-cnn run with profile.layers on: its run file and its model."""
    path = tmp_path_factory.mktemp("profiled") / "r.h5"
    result = run(
        load_config("digits-cnn", ["train.steps=2", "model.channels=4", "profile.layers=true"]), out=path
    )
    return path, result.model


def test_table_from_a_run_file_charges_the_tabled_costs_exactly(profiled):
    path, model = profiled
    with h5py.File(path, "r") as h5:
        names = [s.decode() for s in h5["profile/layer"][()]]
        fwd, bwd = h5["profile/forward_s"][()], h5["profile/backward_s"][()]
    assert names == [layer.name for layer in model]
    m = make_compute(f"table:{path}")
    assert m.name == f"table:{path}" and m.segment(0, 1.0) == 0
    charges = Charges()
    x = np.zeros((32, 1, 8, 8), np.float32)  # the profiled batch: no scaling
    with observe(m.layer_observer(0, charges)):
        y = model.forward(x)
        assert charges.log == [ticks(float(t)) for t in fwd]
        model.backward(np.ones_like(y))
    assert charges.log == [ticks(float(t)) for t in fwd] + [ticks(float(t)) for t in bwd[::-1]]
    assert charges.total == sum(ticks(float(t)) for t in fwd) + sum(ticks(float(t)) for t in bwd)
    d = json.loads(json.dumps(m.describe()))
    assert d["table"] == str(path) and d["layers"] == len(names) and len(d["table_sha256"]) == 64


def test_table_scales_by_batch_speed_and_straggler(profiled):
    path, model = profiled
    base = load_cost_table(path)
    assert {c.batch for c in base.values()} == {32}
    m = make_compute(f"table:{path}", speed=2.0, stragglers={1: 3.0})
    charges = Charges()
    with observe(m.layer_observer(1, charges)):
        model.forward(np.zeros((16, 1, 8, 8), np.float32))  # half the batch
    assert charges.log == [round(ticks(base[layer.name].forward_s) * 0.75) for layer in model]


def test_table_ticks_do_not_depend_on_wall_time_and_jitter_is_seeded(profiled):
    path, model = profiled
    x = np.zeros((32, 1, 8, 8), np.float32)

    def charged(seed: int, rank: int) -> list[int]:
        m = make_compute(f"table:{path}", seed=seed, jitter=0.1)
        charges = Charges()
        with observe(m.layer_observer(rank, charges)):
            for _ in range(2):
                model.backward(np.ones_like(model.forward(x)))
        return charges.log

    assert charged(1, 0) == charged(1, 0)
    assert charged(1, 0) != charged(1, 1)


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_toml_table_by_hand(tmp_path):
    table = write(
        tmp_path / "t.toml",
        """
batch = 4
[[layers]]
layer = "0"
forward_s = 1e-3
backward_s = 2e-3
[[layers]]
layer = "1"
kind = "ReLU"
forward_s = 1e-4
backward_s = 1e-4
[[layers]]
layer = "2"
forward_s = 3e-3
backward_s = 5e-3
batch = 8
""",
    )
    rows = load_cost_table(table)
    assert rows["0"] == LayerCost(1e-3, 2e-3, 4, None)
    assert rows["1"].kind == "ReLU" and rows["2"].batch == 8
    charges = Charges()
    with observe(make_compute(f"table:{table}").layer_observer(0, charges)):
        step(mlp(), n=4)
    # layer 2 was measured at batch 8: half its cost at 4 samples
    expected = [10**9, 10**8, 15 * 10**8, 25 * 10**8, 10**8, 2 * 10**9]
    assert charges.log == expected


def test_csv_table_by_hand_and_as_pandas_would_write_the_profile(tmp_path):
    table = write(
        tmp_path / "t.csv",
        "layer,forward_s,backward_s\n0,0.001,0.002\n1,0.0001,0.0001\n2,0.003,0.005\n",
    )
    charges = Charges()
    with observe(make_compute(f"table:{table}", speed=4.0).layer_observer(0, charges)):
        step(mlp(), n=7)  # no batch in the table: no scaling
    assert charges.total == ticks((0.001 + 0.002 + 0.0002 + 0.003 + 0.005) / 4)
    profile = write(
        tmp_path / "p.csv",
        ",layer,kind,forward_s,backward_s,calls,output_bytes,output_shape\n"
        "0,0,Linear,0.001,0.002,3,80,2x5\n1,1,ReLU,0.0001,0.0001,3,80,2x5\n2,2,Linear,0.003,0.005,3,32,2x2\n",
    )
    rows = load_cost_table(profile)
    assert rows["2"] == LayerCost(0.003, 0.005, 2, "Linear")


def test_only_outermost_layers_are_charged(tmp_path):
    rng = np.random.default_rng(0)
    model = Sequential([Linear(3, 5, rng=rng), Sequential([ReLU(), Linear(5, 2, rng=rng)])])
    assert [layer.name for layer in model[1]] == ["1.0", "1.1"]
    table = write(tmp_path / "t.csv", "layer,forward_s,backward_s\n0,1,2\n1,10,20\n")  # no 1.0, 1.1 rows
    charges = Charges()
    with observe(make_compute(f"table:{table}").layer_observer(0, charges)):
        step(model)
        step(model)
    assert charges.log == [ticks(s) for s in (1, 10, 20, 2)] * 2


def test_cost_is_charged_before_other_observers_see_the_layer_end(tmp_path):
    """An overlapping exchange's ``after`` (an inner observer) sees the layer's cost already charged."""
    table = write(tmp_path / "t.csv", "layer,forward_s,backward_s\n0,1,2\n1,3,4\n2,5,6\n")
    clock = Charges()

    class Exchange:
        def __init__(self) -> None:
            self.seen: list[tuple[str, str, float]] = []

        def before(self, phase, layer, x):
            return None

        def after(self, phase, layer, y):
            self.seen.append((phase, layer.name, seconds(clock.total)))

    ex = Exchange()
    with observe(make_compute(f"table:{table}").layer_observer(0, clock)), observe(ex):
        step(mlp())
    assert ex.seen == [
        ("forward", "0", 1.0),
        ("forward", "1", 4.0),
        ("forward", "2", 9.0),
        ("backward", "2", 15.0),
        ("backward", "1", 19.0),
        ("backward", "0", 21.0),
    ]


# -- errors -----------------------------------------------------------------------------------


def test_missing_layer_names_the_layer_and_the_file(tmp_path):
    table = write(tmp_path / "t.csv", "layer,forward_s,backward_s\n0,1,2\n")
    charges = Charges()
    with observe(make_compute(f"table:{table}").layer_observer(0, charges)):
        with pytest.raises(CostTableError, match=rf"{table} has no row for layer '1' \(ReLU\).*profile"):
            step(mlp())
    assert charges.log == [ticks(1.0)]  # charged up to the first miss


def test_kind_mismatch_says_the_table_is_for_another_model(tmp_path):
    table = write(tmp_path / "t.csv", "layer,kind,forward_s,backward_s\n0,Conv2d,1,2\n")
    with pytest.raises(CostTableError, match=r"layer '0' is a Linear here but a Conv2d in compute table"):
        with observe(make_compute(f"table:{table}").layer_observer(0, Charges())):
            step(mlp())


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("fast", r"unknown compute model 'fast'; use one of measured, none, table:FILE"),
        ("table", r"needs a file: --compute table:FILE"),
        ("table:", r"needs a file"),
        ("table:/nonexistent/p.h5", r"compute table /nonexistent/p.h5 not found; give a run file"),
    ],
)
def test_bad_specs(spec, match):
    with pytest.raises(ConfigError, match=match):
        make_compute(spec)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"speed": 0}, r"speed must be a positive number \(0\)"),
        ({"speed": float("inf")}, r"speed must be a positive number"),
        ({"jitter": -0.1}, r"jitter must be a relative std >= 0 \(-0.1\)"),
        ({"seed": -1}, r"seed must be a non-negative integer"),
        ({"stragglers": {-1: 2.0}}, r"straggler rank must be a non-negative integer \(-1\)"),
        ({"stragglers": {2: 0.0}}, r"straggler factor of rank 2 must be a positive number \(0.0\)"),
    ],
)
def test_bad_settings(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        make_compute("measured", **kwargs)


def test_parse_stragglers():
    assert parse_stragglers("3:2.0, 7:1.5") == {3: 2.0, 7: 1.5}
    assert parse_stragglers("") == {}
    with pytest.raises(ConfigError, match=r"straggler '3' is not RANK:FACTOR"):
        parse_stragglers("3")
    with pytest.raises(ConfigError, match=r"straggler 'a:2' is not RANK:FACTOR"):
        parse_stragglers("a:2")
    with pytest.raises(ConfigError, match=r"factor of rank 1 must be a positive number"):
        parse_stragglers("1:-2")


@pytest.mark.parametrize(
    ("name", "text", "match"),
    [
        ("t.csv", "name,forward_s\n0,1\n", r"lacks the column\(s\) layer, backward_s"),
        ("t.csv", "layer,forward_s,backward_s\n", r"has no layer rows"),
        ("t.csv", "layer,forward_s,backward_s\n0,fast,1\n", r"line 2: forward_s of layer '0' is 'fast'"),
        ("t.csv", "layer,forward_s,backward_s\n0,1,-1\n", r"line 2: backward_s of layer '0' is -1.0"),
        ("t.csv", "layer,forward_s,backward_s\n0,1,1\n0,2,2\n", r"line 3: layer '0' appears twice"),
        ("t.csv", "layer,forward_s,backward_s\n,1,1\n", r"line 2: the layer name is missing"),
        ("t.csv", "layer,forward_s,backward_s,batch\n0,1,1,0\n", r"batch of layer '0' is '0'"),
        ("t.toml", "[[layers]\n", r"is not valid TOML"),
        ("t.toml", "batch = 2\n", r"needs \[\[layers\]\] tables"),
        ("t.toml", '[[layers]]\nlayer = "0"\nforward_s = 1\n', r"#1: backward_s of layer '0' is None"),
        ("t.h5", "not hdf5", r"is not an HDF5 run file"),
    ],
)
def test_bad_tables(tmp_path, name, text, match):
    table = write(tmp_path / name, text)
    with pytest.raises(CostTableError, match=match):
        make_compute(f"table:{table}")


def test_run_file_without_a_profile(tmp_path):
    path = tmp_path / "r.h5"
    run(load_config("digits-mlp", ["train.steps=1"]), out=path)
    with pytest.raises(CostTableError, match=r"has no per-layer profile.*profile.layers = true"):
        make_compute(f"table:{path}")


def test_table_model_made_from_rows():
    m = TableCompute("made-by-hand", {"0": LayerCost(1.0, 2.0)})
    assert m.describe()["table_sha256"] == "" and m.rows["0"].forward_s == 1.0


def test_table_charges_reach_the_virtual_clock_in_the_engine(tmp_path):
    """Through :func:`hpcdl.sim.engine.simulate`: ``wtime()`` after a step is the tabled sum (x straggler)."""
    import hpcdl.comm as hc
    from hpcdl.sim.engine import simulate
    from hpcdl.sim.network import Link, Network

    table = write(tmp_path / "t.csv", "layer,forward_s,backward_s\n0,1,2\n1,3,4\n2,5,6\n")

    def target() -> float:
        step(mlp())
        return hc.wtime()

    network = Network("test", inter=Link(1.0, 1.0))
    result = simulate(3, target, network=network, compute=make_compute(f"table:{table}", stragglers={1: 2.0}))
    assert result.results == [21.0, 42.0, 21.0]
