"""Distributed K-FAC on the simulator's virtual ranks: against one process, and its refusals.

On N = 2, 3 and 8 virtual ranks, for every ``kfac.grad_workers`` k dividing N (k = N: eigenbases
to every rank; 1: one rank per layer preconditions; between: HYBRID), the parameters end where
one process with ``exchange.accumulate = N`` ends on the same samples (float64, relative
1e-10; no dropout, no BatchNorm); a stop and ``--resume auto`` repeat the run bit for bit; a
checkpoint of SGD is refused by a K-FAC resume in one line; the eigendecompositions go to
ranks by KAISA's greedy rule.
"""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest
from kfac_config import COMMON, flat  # tests/ is on sys.path (pytest prepend mode)
from simulated import sim  # tests/ is on sys.path (pytest prepend mode)

from hpcdl.comm import world
from hpcdl.config import load_config
from hpcdl.driver.run import train
from hpcdl.errors import ConfigError
from hpcdl.parallel.kfac import assign
from hpcdl.sim.ticks import ticks
from hpcdl.store.checkpoint import list_checkpoints, load_checkpoint
from hpcdl.train import main as train_main


@pytest.mark.parametrize(("n", "k"), [(2, 1), (2, 2), (3, 1), (3, 3), (8, 1), (8, 2), (8, 4), (8, 8)])
def test_distributed_kfac_ends_where_one_process_accumulating_ends(n: int, k: int) -> None:
    got = sim(n, load_config("digits-mlp", [*COMMON, f"kfac.grad_workers={k}"]))
    alone = train(load_config("digits-mlp", [*COMMON, f"exchange.accumulate={n}"]), world())
    want = flat(alone)
    for r in range(n):  # every rank holds the same model
        np.testing.assert_allclose(flat(got[r]), want, rtol=0, atol=1e-10 * np.abs(want).max())
    np.testing.assert_allclose([row["loss"] for row in got[0].history],
                               [row["loss"] for row in alone.history], rtol=1e-10)  # fmt: skip


def test_a_stop_and_resume_auto_repeat_a_kfac_run_bit_for_bit(tmp_path: Path) -> None:
    sets = [*COMMON, "kfac.grad_workers=1", "checkpoint.every=3", "train.steps=6", "kfac.inv_every=4"]
    whole, part = tmp_path / "whole.h5", tmp_path / "part.h5"
    sim(3, load_config("digits-mlp", sets), out=whole)
    sim(3, load_config("digits-mlp", [*sets, "train.stop_at=3"]), out=part)
    sim(3, load_config("digits-mlp", sets), out=part, resume="auto")
    a, b = load_checkpoint(list_checkpoints(whole)[0]), load_checkpoint(list_checkpoints(part)[0])
    assert a.step == b.step == 6
    for group in ("params", "optimizer", "kfac"):
        assert sorted(a.pieces["model"][group]) == sorted(b.pieces["model"][group])
        for key, value in a.pieces["model"][group].items():
            assert value.tobytes() == b.pieces["model"][group][key].tobytes(), (group, key)
    with h5py.File(list_checkpoints(whole)[0]) as f:  # the documented place of a layer's factors
        assert f["pieces/model/kfac/1/A"].shape == (65, 65) and f["pieces/model/kfac/1/G"].shape == (24, 24)


def test_a_checkpoint_without_kfac_state_is_refused_in_one_line(tmp_path: Path) -> None:
    out = tmp_path / "sgd.h5"
    sgd = [s for s in COMMON if not s.startswith("optimizer.name")]
    sim(2, load_config("digits-mlp", [*sgd, "checkpoint.every=2", "train.stop_at=2"]), out=out)
    before = out.read_bytes()
    with pytest.raises(Exception, match="no K-FAC state for layer") as raised:
        sim(2, load_config("digits-mlp", COMMON), out=out, resume="auto")
    assert "\n" not in str(raised.value).split(": ", 1)[-1]
    assert out.read_bytes() == before  # nothing written


@pytest.mark.parametrize(
    ("sets", "ranks", "says"),
    [
        (["kfac.grad_workers=2"], 3, "kfac.grad_workers = 2 does not divide the 3 ranks: use one of [1, 3]"),
        (["parallel.strategy=ps"], 3, "optimizer.name = 'kfac' updates whole layers"),
        (["parallel.strategy=pipeline"], 2, "optimizer.name = 'kfac' updates whole layers"),
        (["kfac.inv_every=1", "kfac.factor_every=2"], 2, "kfac.inv_every = 1 must be >= kfac.factor_every"),
        (["kfac.damping=0"], 2, "kfac.damping"),
    ],
)
def test_what_kfac_cannot_run_is_one_line(sets: list[str], ranks: int, says: str) -> None:
    with pytest.raises(Exception) as raised:
        sim(ranks, load_config("digits-mlp", [*COMMON, *sets]))
    assert says in str(raised.value)


def test_the_plan_prints_each_layers_owner_and_workers(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--config", "digits-mlp", "--plan", "-n", "4", "--set", "optimizer.name=kfac", "--set",
            "kfac.grad_workers=2"]  # fmt: skip
    assert train_main(argv) == 0
    out = capsys.readouterr().out
    assert "K-FAC: eigendecompositions by rank" in out and "grad workers" in out


def test_the_assignment_is_largest_first_to_the_least_loaded_rank() -> None:
    assert assign([1.0, 8.0, 2.0, 8.0, 3.0], 2) == [1, 0, 1, 1, 0]  # 8->0, 8->1, 3->0, 2->1, 1->1
    assert assign([5.0], 4) == [0]
    with pytest.raises(ConfigError):
        from hpcdl.parallel.kfac import grad_workers  # noqa: PLC0415

        grad_workers(3, 8)


# -- with a cost table: K-FAC's ops are charged to the ranks that run them ------------------------

#: a table for the model of :func:`_kfac_step`: each layer's forward/backward seconds, and every op
#: at the dimensions it runs at (distinct powers of two, so that a wrong charge cannot add up right)
_LAYERS = {"0": (1e-4, 2e-4), "1": (1e-6, 2e-6), "2": (3e-4, 5e-4), "3": (1e-6, 2e-6), "4": (7e-5, 9e-5)}
_OPS = {
    ("eigh", (7,)): 1e-3, ("eigh", (9,)): 2e-3, ("eigh", (10,)): 4e-3, ("eigh", (4,)): 8e-3,
    ("eigh", (3,)): 16e-3,
    ("precondition", (9, 7)): 32e-6, ("precondition", (4, 10)): 64e-6, ("precondition", (3, 4)): 128e-6,
    ("factor", (5, 7)): 1e-6, ("factor", (5, 9)): 2e-6, ("factor", (5, 10)): 4e-6, ("factor", (5, 4)): 8e-6,
    ("factor", (5, 3)): 16e-6,
}  # fmt: skip
#: each covered layer's factor sizes (d_A, d_G): A counts the bias's 1 (the last layer has none)
_DIMS = [(7, 9), (10, 4), (4, 3)]


class _Instant:
    """A network whose messages take no virtual time: clocks move by the table and by waiting only."""

    def reset(self, n: int) -> None:
        pass

    def send(self, src: int, dst: int, nbytes: int, t: int) -> tuple[int, int]:
        return t, t

    def describe(self) -> dict:
        return {"name": "instant"}


def _table(tmp_path: Path) -> Path:
    rows = [f"[[layers]]\nlayer = '{name}'\nforward_s = {f!r}\nbackward_s = {b!r}\n"
            for name, (f, b) in _LAYERS.items()]  # fmt: skip
    rows += [f"[[ops]]\nop = '{op}'\ndims = {list(dims)}\nseconds = {s!r}\n"
             for (op, dims), s in _OPS.items()]  # fmt: skip
    path = tmp_path / "kfac.toml"
    path.write_text("\n".join(rows))
    return path


def _kfac_step(workers: int) -> float:
    """One K-FAC step on this virtual rank (forward, backward, DistributedKfac's step); its clock."""
    from hpcdl.comm import wtime  # noqa: PLC0415
    from hpcdl.nn import Linear, ReLU, Sequential, observe  # noqa: PLC0415
    from hpcdl.optim.kfac import KFAC  # noqa: PLC0415
    from hpcdl.parallel.kfac import DistributedKfac  # noqa: PLC0415

    rng = np.random.default_rng(0)
    model = Sequential(
        [Linear(6, 9, rng=rng), ReLU(), Linear(9, 4, rng=rng), ReLU(), Linear(4, 3, bias=False, rng=rng)]
    )
    comm = world()
    update = DistributedKfac(KFAC(model, 0.1, inv_every=1), comm, workers)
    x = np.random.default_rng(comm.Get_rank()).standard_normal((5, 6), dtype=np.float32)
    with observe(update.observer):
        model.backward(np.ones_like(model.forward(x)))
    update.step()
    update.close()
    return wtime()


def _run_step(tmp_path: Path, n: int, k: int) -> tuple[list[int], list[list[tuple[str, tuple[int, ...]]]]]:
    """Each rank's clock in ticks after one step, and the ops each rank was charged."""
    from hpcdl.sim.compute import TableCompute, make_compute  # noqa: PLC0415
    from hpcdl.sim.engine import simulate  # noqa: PLC0415

    table = make_compute(f"table:{_table(tmp_path)}")
    charged: list[list[tuple[str, tuple[int, ...]]]] = [[] for _ in range(n)]

    class Recording(TableCompute):
        def op_cost(self, rank: int, op: str, dims: tuple[int, ...]) -> int:
            charged[rank].append((op, dims))
            return super().op_cost(rank, op, dims)

    compute = Recording(table.path, table.rows, table.ops)
    result = simulate(n, lambda: _kfac_step(k), network=_Instant(), compute=compute, poll_cost_s=0.0)
    return [ticks(t) for t in result.results], charged


def _t(op: str, *dims: int) -> int:
    return ticks(_OPS[(op, dims)])


@pytest.mark.parametrize(("n", "k"), [(2, 1), (2, 2), (3, 3)])
def test_a_table_charges_each_rank_its_layers_factors_eigendecompositions_and_preconditioning(
    tmp_path: Path, n: int, k: int
) -> None:
    clocks, charged = _run_step(tmp_path, n, k)
    owner = assign([float(a) ** 3 + float(g) ** 3 for a, g in _DIMS], n)
    per = n // k
    workers = [[r for r in range(n) if r % per == owner[i] % per] for i in range(len(_DIMS))]
    # every rank: its layers and the factors of its own batch; the eigendecompositions its owner's
    # (KAISA's LPT, whatever k); the preconditioning of the layers it works on (k of them per layer)
    layers = sum(ticks(f) + ticks(b) for f, b in _LAYERS.values())
    factors = sum(_t("factor", 5, a) + _t("factor", 5, g) for a, g in _DIMS)
    eigh = [_t("eigh", a) + _t("eigh", g) for a, g in _DIMS]
    pre = [_t("precondition", g, a) for a, g in _DIMS]
    for r in range(n):
        assert [c for c in charged[r] if c[0] == "eigh"] == [
            ("eigh", (d,)) for i in range(len(_DIMS)) if owner[i] == r for d in _DIMS[i]
        ]
        assert [c for c in charged[r] if c[0] == "precondition"] == [
            ("precondition", (g, a)) for i, (a, g) in enumerate(_DIMS) if r in workers[i]
        ]
    load = [sum(eigh[i] for i in range(len(_DIMS)) if owner[i] == r) for r in range(n)]
    if k == n:  # the eigenbases go to every rank: all wait for the most loaded, then precondition all
        want = [layers + factors + max(load) + sum(pre)] * n
    else:  # k = 1 at N = 2: layer by layer, the owner preconditions and sends the result to the other
        want = [layers + factors + load[r] for r in range(n)]
        for i, o in enumerate(owner):
            want[o] += pre[i]
            want[1 - o] = max(want[1 - o], want[o])
    assert clocks == want


def test_grad_workers_move_the_preconditioning_and_not_the_eigendecompositions(tmp_path: Path) -> None:
    (_, one), (_, every) = _run_step(tmp_path, 2, 1), _run_step(tmp_path, 2, 2)
    assert assign([1072.0, 1064.0, 91.0], 2) == [0, 1, 1]  # d_A³ + d_G³ of (7, 9), (10, 4), (4, 3)

    def of(charged, op):
        return [[c[1] for c in cs if c[0] == op] for cs in charged]

    assert of(one, "eigh") == of(every, "eigh") == [[(7,), (9,)], [(10,), (4,), (4,), (3,)]]
    assert of(one, "precondition") == [[(9, 7)], [(4, 10), (3, 4)]]  # MEM-OPT: the owner alone
    assert of(every, "precondition") == [[(9, 7), (4, 10), (3, 4)]] * 2  # COMM-OPT: every rank


@pytest.mark.parametrize(("mb", "buckets"), [(0.0, 1), (25.0, 1), (1e-6, None)])
def test_the_factors_bucket_size_follows_the_exchanges_rule(mb: float, buckets: int | None) -> None:
    """``exchange.bucket_mb = 0`` is one bucket for the factors too (it was one per byte)."""
    got = sim(2, load_config("digits-mlp", [*COMMON, f"exchange.bucket_mb={mb}", "train.steps=1"]))
    factors = got[0].strategy.update._buckets
    count = len(factors)
    if buckets is None:  # a bucket a factor: each factor is larger than a byte
        assert count == len(got[0].strategy.update.kfac.layers) * 2
    else:
        assert count == buckets
