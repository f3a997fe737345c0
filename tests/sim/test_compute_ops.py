"""Ops in cost tables (``hpcdl.store.costs.OpCosts``, ``hpcdl.nn.hooks.op``): their rows in every
format, the interpolation by each op's law, the charge in ``TableCompute``, the profiler's rows."""

from __future__ import annotations

import math
from pathlib import Path

import h5py
import numpy as np
import pytest

from hpcdl.config import load_config
from hpcdl.nn import Linear, Sequential, hooks, observe
from hpcdl.optim.kfac import KFAC
from hpcdl.sim.compute import CostTableError, MeasuredCompute, TableCompute, make_compute
from hpcdl.sim.ticks import ticks
from hpcdl.store.costs import OpCost, OpCosts, load_op_costs, op_work
from hpcdl.train import run

LAYERS = "[[layers]]\nlayer = '0'\nforward_s = 1.0\nbackward_s = 2.0\n"


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


class Charges:
    def __init__(self) -> None:
        self.log: list[int] = []

    def __call__(self, t: int) -> None:
        self.log.append(t)


# -- the law and the interpolation --------------------------------------------------------------


def test_each_op_has_its_law():
    assert op_work("eigh", (10,)) == 1000
    assert op_work("precondition", (3, 5)) == 3 * 5 * 8  # Q_Gᵀ ∇W Q_A and Q_G V Q_Aᵀ: 2 (g²a + ga²)
    assert op_work("factor", (32, 7)) == 32 * 49


def test_measured_sizes_are_exact_and_others_follow_the_law_or_log_log():
    costs = OpCosts([OpCost("eigh", (10,), 1e-3), OpCost("eigh", (100,), 0.1)])
    assert costs.seconds("eigh", (10,)) == 1e-3 and costs.seconds("eigh", (100,)) == 0.1  # as measured
    assert costs.seconds("eigh", (200,)) == pytest.approx(0.1 * 8)  # above: by the law n³
    assert costs.seconds("eigh", (5,)) == pytest.approx(1e-3 / 8)  # below: by the law n³
    # between: log-log; from n = 10 to 100 the seconds grow 100x over 1000x the work: exponent 2/3
    assert costs.seconds("eigh", (50,)) == pytest.approx(1e-3 * (50**3 / 10**3) ** (2 / 3))
    assert costs.seconds("precondition", (3, 5)) is None  # no row for that op
    assert costs.ops == ["eigh"] and len(costs) == 2


def test_a_zero_cost_row_interpolates_linearly():
    costs = OpCosts([OpCost("factor", (1, 1), 0.0), OpCost("factor", (1, 3), 9.0)])
    assert costs.seconds("factor", (1, 2)) == pytest.approx(9.0 * (4 - 1) / (9 - 1))
    assert OpCosts([OpCost("eigh", (4,), 0.0)]).seconds("eigh", (1000,)) == 0.0


# -- the formats --------------------------------------------------------------------------------


def test_toml_csv_and_run_file_op_rows(tmp_path):
    toml = write(
        tmp_path / "t.toml",
        LAYERS + "[[ops]]\nop = 'eigh'\ndims = 65\nseconds = 0.5\n"
        "[[ops]]\nop = 'precondition'\ndims = [24, 65]\nseconds = 0.25\n"
        "[[ops]]\nop = 'factor'\ndims = '8x65'\nseconds = 0.125\n",
    )
    csv = write(
        tmp_path / "t.csv",
        "layer,forward_s,backward_s,op,dims,seconds\n0,1,2,,,\n,,,eigh,65,0.5\n,,,precondition,24x65,0.25\n"
        ",,,factor,8x65,0.125\n",
    )
    h5 = tmp_path / "t.h5"
    with h5py.File(h5, "w") as f:
        f["profile/layer"], f["profile/forward_s"], f["profile/backward_s"] = ["0"], [1.0], [2.0]
        f["profile/ops/op"] = ["eigh", "precondition", "factor"]
        f["profile/ops/dims"] = ["65", "24x65", "8x65"]
        f["profile/ops/seconds"] = [0.5, 0.25, 0.125]
    want = [
        OpCost("eigh", (65,), 0.5),
        OpCost("precondition", (24, 65), 0.25),
        OpCost("factor", (8, 65), 0.125),
    ]
    for path in (toml, csv, h5):
        assert load_op_costs(path).rows == want, path
        m = make_compute(f"table:{path}")
        assert m.rows["0"].forward_s == 1.0 and len(m.rows) == 1  # op rows are not layers
        assert m.describe()["ops"] == 3


def test_a_table_without_op_rows_has_none(tmp_path):
    assert len(load_op_costs(write(tmp_path / "t.toml", LAYERS))) == 0
    assert len(load_op_costs(write(tmp_path / "t.csv", "layer,forward_s,backward_s\n0,1,2\n"))) == 0


@pytest.mark.parametrize(
    ("row", "match"),
    [
        ("op = 'inv'\ndims = 3\nseconds = 1", r"\[\[ops\]\] #1: op 'inv' is not one of eigh, precondition"),
        ("op = 'eigh'\ndims = [3, 4]\nseconds = 1", "give 1 whole number"),
        ("op = 'precondition'\ndims = 3\nseconds = 1", "give 2 whole number.*d_outxd_in"),
        ("op = 'eigh'\ndims = 0\nseconds = 1", "dims of op 'eigh' are 0"),
        ("op = 'eigh'\ndims = 3\nseconds = -1", "seconds of op 'eigh' is -1"),
        ("op = 'eigh'\ndims = 3\nseconds = 'x'", "give a finite time"),
    ],
)
def test_bad_op_rows_are_one_line_naming_the_row(tmp_path, row, match):
    path = write(tmp_path / "t.toml", LAYERS + "[[ops]]\n" + row + "\n")
    with pytest.raises(CostTableError, match=match) as raised:
        make_compute(f"table:{path}")
    assert "\n" not in str(raised.value)


def test_an_op_row_twice_is_refused(tmp_path):
    path = write(tmp_path / "t.toml", LAYERS + "[[ops]]\nop='eigh'\ndims=3\nseconds=1\n" * 2)
    with pytest.raises(CostTableError, match="op 'eigh' at dims 3 appears twice"):
        load_op_costs(path)


# -- the charge ---------------------------------------------------------------------------------


def test_a_table_charges_an_op_as_it_starts_scaled_like_a_layer():
    m = TableCompute("by-hand", {}, OpCosts([OpCost("eigh", (10,), 1e-3)]), speed=2.0, stragglers={1: 3.0})
    charges = Charges()
    with observe(m.layer_observer(1, charges)):
        with hooks.op("eigh", 10):
            assert charges.log == [ticks(1e-3) * 3 // 2]  # charged before the op ran
        with hooks.op("eigh", 20):
            pass
    assert charges.log == [ticks(1e-3) * 3 // 2, round(ticks(8e-3) * 1.5)]


def test_an_op_the_table_lacks_stops_the_run_naming_op_file_and_remedy():
    m = TableCompute("t.toml", {}, OpCosts())
    with observe(m.layer_observer(0, Charges())), pytest.raises(CostTableError) as raised:
        with hooks.op("precondition", 24, 65):
            pass
    assert str(raised.value) == (
        "compute table t.toml has no row for op 'precondition' (here at dims 24x65); profile this model "
        "with the same optimizer (profile.layers = true), or add [[ops]] rows (python -m hpcdl.bench ops)"
    )


def test_measured_compute_observes_no_op_it_measures_them_in_the_segment():
    """Ops run inside segments; ``measured`` charges segments by their wall time, so nothing changes."""
    assert MeasuredCompute().layer_observer(0, Charges()) is None
    ran = []
    with hooks.op("eigh", 3):  # no observer: the body runs, nothing else
        ran.append(1)
    assert ran == [1]


def test_observers_without_op_methods_are_not_called_for_ops():
    class LayersOnly:
        def before(self, phase, layer, x):
            raise AssertionError

        after = before

    with observe(LayersOnly()), hooks.op("eigh", 3):
        pass


# -- the profiler -------------------------------------------------------------------------------


def test_kfac_announces_its_ops_and_the_profiler_keeps_them_out_of_the_layers():
    rng = np.random.default_rng(0)
    model = Sequential([Linear(6, 9, rng=rng), Linear(9, 4, rng=rng, bias=False)])
    kfac = KFAC(model, 0.1, inv_every=1)
    seen: list[tuple[str, tuple[int, ...]]] = []

    class Ops:
        def before_op(self, op, dims):
            seen.append((op, dims))

        def before(self, *args):
            pass

        after = after_op = before

    profiler = hooks.LayerProfiler()
    with observe(profiler), observe(Ops()), observe(kfac.observer):
        y = model.forward(rng.standard_normal((5, 6)))
        model.backward(np.ones_like(y))
        kfac.step()
    assert seen == [
        ("factor", (5, 7)), ("factor", (5, 9)),  # forward: each layer's A (bias: 6 + 1)
        ("factor", (5, 4)), ("factor", (5, 9)),  # backward, last layer first: each G
        ("eigh", (7,)), ("eigh", (9,)), ("eigh", (9,)), ("eigh", (4,)),
        ("precondition", (9, 7)), ("precondition", (4, 9)),
    ]  # fmt: skip
    rows = profiler.ops_table()
    assert [(r["op"], r["dims"], r["calls"]) for r in rows] == [
        ("factor", (5, 7), 1), ("factor", (5, 9), 2), ("factor", (5, 4), 1),
        ("eigh", (7,), 1), ("eigh", (9,), 2), ("eigh", (4,), 1),
        ("precondition", (9, 7), 1), ("precondition", (4, 9), 1),
    ]  # fmt: skip
    assert all(r["seconds"] > 0 for r in rows)


def test_the_profiler_takes_an_op_inside_a_layer_out_of_its_time(monkeypatch):
    clock = iter(float(t) for t in range(100))
    monkeypatch.setattr(hooks.time, "perf_counter", lambda: next(clock))
    p = hooks.LayerProfiler()
    layer = Linear(2, 2, rng=np.random.default_rng(0))
    layer.name = "0"
    p.before("forward", layer, None)  # t = 0
    p.before_op("factor", (1, 2))  # t = 1
    p.after_op("factor", (1, 2))  # t = 2
    p.after("forward", layer, np.zeros((1, 2)))  # t = 3: 3 s, of which 1 s the op
    assert p.times[("0", "forward")] == [2.0] and p.op_times[("factor", (1, 2))] == [1.0]


def test_a_kfac_profile_run_file_holds_its_ops_and_simulates_with_them(tmp_path):
    """A real run with ``profile.layers = true`` writes ``profile/ops/``; a table made of it charges them."""
    sets = ["dtype=float64", "model.depth=2", "model.width=16", "data.batch_size=8", "optimizer.name=kfac",
            "kfac.inv_every=2", "train.steps=3", "train.eval_every=3", "profile.layers=true"]  # fmt: skip
    out = tmp_path / "prof.h5"
    run(load_config("digits-mlp", sets), out=out)
    with h5py.File(out) as f:
        names = [s.decode() for s in f["profile/ops/op"][()]]
        dims = [s.decode() for s in f["profile/ops/dims"][()]]
        ops = sorted(zip(names, dims, strict=True))
        calls = dict(zip(dims, f["profile/ops/calls"][()], strict=True))
    assert ("eigh", "65") in ops and ("precondition", "16x65") in ops and ("factor", "8x65") in ops
    assert calls["65"] == 2  # decomposed at steps 0 and 2
    costs = load_op_costs(out)
    assert all(math.isfinite(r.seconds) and r.seconds > 0 for r in costs.rows)
    assert len(make_compute(f"table:{out}").ops) == len(ops)
