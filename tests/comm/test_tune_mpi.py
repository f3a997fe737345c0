"""``auto`` tuned where it runs, under mpiexec: the ranks agree on one table, a run records it, and a
resume keeps its run's table even when the cache would now choose otherwise."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpcdl.comm import world
from hpcdl.comm.collectives import ALGORITHMS
from hpcdl.comm.collectives.auto import AutoTable
from hpcdl.comm.collectives.tune import tuned_table
from hpcdl.config import load_config
from hpcdl.driver.run import train
from hpcdl.store.checkpoint import list_checkpoints, load_checkpoint
from hpcdl.store.runfile import read_attrs

SIZES = (4096, 262144)
#: a small sync run in float64 (as the conformance suite's), 8 steps, a checkpoint every 4
BASE = ["dtype=float64", "model.width=32", "train.steps=8", "checkpoint.every=4", "schedule.name=constant",
        "schedule.scale=none", "schedule.warmup_epochs=0", "exchange.bucket_mb=0.01"]  # fmt: skip


def _shared(tmp_path: Path) -> Path:
    return Path(world().bcast(str(tmp_path), root=0))


@pytest.mark.mpi(min_size=2)
def test_every_rank_takes_the_same_table_timed_once_then_cached(tmp_path: Path) -> None:
    comm = world()
    cache = _shared(tmp_path) / "auto.json"
    first = tuned_table(comm, SIZES, cache=cache, min_time=1e-3)
    assert first.source == "calibrated" and first.timed == SIZES
    tables = comm.allgather(json.dumps(first.table.to_dict(), sort_keys=True))
    assert len(set(tables)) == 1
    again = tuned_table(comm, SIZES, cache=cache)
    assert again.source == "cache" and again.seconds == 0
    assert again.table.segments == first.table.segments
    assert again.table.meta[comm.Get_size()]["machine"]["ranks"] == comm.Get_size()


@pytest.mark.mpi(min_size=2)
def test_a_resume_keeps_its_runs_table_though_the_cache_now_says_otherwise(tmp_path: Path) -> None:
    comm = world()
    base = _shared(tmp_path)
    cache = base / "auto.json"
    sets = [*BASE, f"exchange.auto_cache={json.dumps(str(cache))}"]
    cfg = load_config("digits-mlp", sets)
    whole = train(cfg, comm, out=base / "whole.h5")
    used = whole.strategy.exchange.auto
    assert used.meta[comm.Get_size()]["source"] == "calibrated"
    if comm.Get_rank() == 0:
        recorded = AutoTable.from_dict(json.loads(read_attrs(base / "whole.h5")["auto_table"]))
        assert recorded.segments == used.segments
    stopped = train(load_config("digits-mlp", [*sets, "train.stop_at=4"]), comm, out=base / "part.h5")
    assert stopped.strategy.exchange.auto.meta[comm.Get_size()]["source"] == "cache"
    if comm.Get_rank() == 0:  # now every size's winner is an algorithm the run did not use
        data = json.loads(cache.read_text())
        (entry,) = data["entries"].values()
        for size, times in entry["times"].items():
            was = used.choose(int(size), comm.Get_size())
            other = next(a for a in ALGORITHMS if a != was)
            entry["times"][size] = {a: 1e-3 if a == other else 1.0 for a in times}
        cache.write_text(json.dumps(data))
    comm.Barrier()
    sizes = used.meta[comm.Get_size()]["sizes"]
    fresh = tuned_table(comm, sizes, cache=cache).table
    assert fresh.segments != used.segments  # a fresh run would sum otherwise: the test can fail
    resumed = train(cfg, comm, out=base / "part.h5", resume="auto")
    assert resumed.strategy.exchange.auto.segments == used.segments
    comm.Barrier()
    if comm.Get_rank() == 0:
        a, b = (load_checkpoint(list_checkpoints(base / f)[0]) for f in ("part.h5", "whole.h5"))
        assert a.step == b.step == 8
        for name, piece in a.pieces.items():
            for key, value in piece["params"].items():
                assert value.tobytes() == b.pieces[name]["params"][key].tobytes(), key


@pytest.mark.mpi(min_size=2)
def test_bench_allreduce_times_auto_after_its_own_calibration(tmp_path: Path) -> None:
    from hpcdl.bench import main

    comm = world()
    base = _shared(tmp_path)
    cache, out = base / "auto.json", base / "rows.json"
    args = ["allreduce", "--sizes", "4K", "64K", "--repeat", "1", "--min-time", "0.001", "--auto-cache",
            str(cache), "--json", str(out)]  # fmt: skip
    for source in ("calibrated", "cache"):
        assert main(args) == 0
        rows = json.loads(out.read_text()) if comm.Get_rank() == 0 else []
        assert all(r["auto_table"] == source for r in rows)
        assert all((r["calibration_s"] > 0) == (source == "calibrated") for r in rows)
    assert main([*args, "--auto-calibrate", "never"]) == 0
    if comm.Get_rank() == 0:
        assert {r["auto_table"] for r in json.loads(out.read_text())} == {"packaged"}
        (entry,) = json.loads(cache.read_text())["entries"].values()
        assert sorted(map(int, entry["times"])) == [4096, 65536]
