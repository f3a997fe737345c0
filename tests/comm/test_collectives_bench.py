"""``bench allreduce``: output format on a world of one, calibration under mpiexec (no figures asserted)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import hpcdl.comm as hc
from hpcdl.bench import SUBCOMMANDS, build_parser, main
from hpcdl.bench.allreduce import parse_size
from hpcdl.comm.collectives import (
    ALGORITHMS,
    NODE_ALGORITHMS,
    AutoTable,
    Collectives,
    available_algorithms,
    load_table,
)
from hpcdl.comm.collectives.auto import merge, save_table, winners
from hpcdl.errors import ConfigError

KEYS = {
    "algorithm",
    "picked",
    "size_bytes",
    "ranks",
    "time_s",
    "iqr_s",
    "algbw_GBps",
    "busbw_GBps",
    "time_vs_mpi",
}


def test_parse_size() -> None:
    sizes = [parse_size(s) for s in ("4096", "4K", "16M", "1GiB", "64kb")]
    assert sizes == [4096, 4096, 16 << 20, 1 << 30, 65536]
    with pytest.raises(ConfigError, match="byte counts"):
        parse_size("lots")


@pytest.mark.skipif(hc.world().Get_size() != 1, reason="runs without mpiexec")
def test_allreduce_bench_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "allreduce.json"
    argv = ["allreduce", "--sizes", "4K", "64K", "--repeat", "2", "--min-time", "0.001", "--json", str(out)]
    assert main(argv) == 0
    rows = json.loads(out.read_text())
    expected = [(s, a) for s in (4096, 65536) for a in (*ALGORITHMS, "auto")]
    assert [(r["size_bytes"], r["algorithm"]) for r in rows] == expected
    for r in rows:
        assert KEYS <= set(r) and r["ranks"] == 1 and r["busbw_GBps"] == 0.0
        assert r["picked"] == ("mpi" if r["algorithm"] == "auto" else r["algorithm"])  # one rank: fallback
    assert next(r for r in rows if r["algorithm"] == "mpi")["time_vs_mpi"] == pytest.approx(1.0)
    out = capsys.readouterr().out
    assert "time/mpi" in out and "auto=mpi" in out


@pytest.mark.skipif(hc.world().Get_size() != 1, reason="runs without mpiexec")
def test_allreduce_bench_table_errors(tmp_path: Path) -> None:
    tiny = ["--sizes", "4K", "--repeat", "1", "--min-time", "0.0001"]
    with pytest.raises(ConfigError, match="--calibrate needs --table PATH"):
        main(["allreduce", "--calibrate", *tiny])
    with pytest.raises(ConfigError, match="2 or more: run it under mpiexec"):
        main(["allreduce", "--calibrate", "--table", str(tmp_path / "t.json"), *tiny])
    assert not (tmp_path / "t.json").exists()
    with pytest.raises(ConfigError, match=r"absent\.json not found"):
        main(["allreduce", "--table", str(tmp_path / "absent.json"), *tiny])
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ConfigError, match=r"bad\.json is not valid JSON"):
        main(["allreduce", "--table", str(tmp_path / "bad.json"), *tiny])


@pytest.mark.mpi(min_size=2)
def test_calibrate_writes_a_table_that_collectives_follow(capsys: pytest.CaptureFixture[str]) -> None:
    comm = hc.world()
    rank, size = comm.Get_rank(), comm.Get_size()
    tmp = Path(comm.bcast(tempfile.mkdtemp(prefix="hpcdl-auto-") if rank == 0 else None, root=0))
    path = tmp / "table.json"
    if rank == 0:  # another rank count's segments, which calibration must keep
        save_table(merge(AutoTable(), size + 1, [(None, "doubling")], {"note": "kept"}), path)
    comm.Barrier()
    argv = ["allreduce", "--calibrate", "--table", str(path), "--sizes", "4K", "64K"]
    rows = json.loads(json.dumps(_run(argv + ["--repeat", "1", "--min-time", "0.0005"])))
    assert {(r["size_bytes"], r["algorithm"]) for r in rows} == {
        (s, a)
        for s in (4096, 65536)
        for a in available_algorithms(comm)  # shm: one node
    }
    table = load_table(path)  # written by rank 0 before main returned on any rank
    assert set(table.segments) == {size, size + 1} and table.meta[size + 1]["note"] == "kept"
    meta = table.meta[size]
    assert meta["sizes"] == (4096, 65536) and meta["repeat"] == 1 and meta["mpi_library"]
    picked = {nbytes: name for nbytes, name, _ in winners(rows)}
    for nbytes, name in picked.items():  # the table gives each measured size its calibrated winner
        assert table.choose(nbytes, size) == name
    if rank == 0:
        out = capsys.readouterr().out
        assert f"auto at {size} ranks" in out and f"written to {path}" in out

    with Collectives(comm, "auto", auto=table) as coll:
        for nbytes, name in picked.items():
            x = np.arange(nbytes // 4, dtype=np.float32) + rank
            expected = np.empty_like(x)
            comm.Allreduce(x, expected, op=hc.SUM)
            # a node algorithm's pick runs on node memory (ordinary memory: the table's `ordinary`)
            got = coll.node_empty(x.size, x.dtype) if name in NODE_ALGORITHMS else np.empty_like(x)
            req = coll.Iallreduce(x, got)
            assert f"allreduce[{name}]" in repr(req)
            req.Wait()
            np.testing.assert_array_equal(got, expected)

    # a normal run with --table: auto's rows say what the table picked
    tiny = ["--sizes", "4K", "--repeat", "1", "--min-time", "0.0005"]
    auto_rows = _run(["allreduce", "--table", str(path), "--algorithms", "auto", *tiny])
    choice = table.choose(4096, size)  # timed alone, on ordinary memory: a node algorithm's pick is MPI's
    assert [r["picked"] for r in auto_rows] == ["mpi" if choice in NODE_ALGORITHMS else choice]
    comm.Barrier()
    if rank == 0:
        path.unlink()
        tmp.rmdir()


def _run(argv: list[str]) -> list[dict[str, Any]]:
    """The rows of a ``python -m hpcdl.bench`` command line, run in this process."""
    args = build_parser().parse_args(argv)
    return SUBCOMMANDS[args.command].run(args)


@pytest.mark.mpi(min_size=2)
def test_calibrate_weighs_several_passes_and_earlier_jobs() -> None:
    comm = hc.world()
    rank, size = comm.Get_rank(), comm.Get_size()
    tmp = Path(comm.bcast(tempfile.mkdtemp(prefix="hpcdl-auto-") if rank == 0 else None, root=0))
    tiny = ["--sizes", "4K", "--repeat", "1", "--min-time", "0.0005", "--algorithms", "ring", "mpi"]
    earlier = _run(["allreduce", "--calibrate", "--table", str(tmp / "a.json"), *tiny])
    if rank == 0:
        (tmp / "earlier.json").write_text(json.dumps(earlier))
        (tmp / "broken.json").write_text("[{")
    comm.Barrier()
    argv = ["allreduce", "--calibrate", "--table", str(tmp / "b.json"), "--runs", "2", *tiny]
    rows = _run([*argv, "--also", str(tmp / "earlier.json")])
    assert sorted({r["run"] for r in rows}) == [0, 1] and len(rows) == 4
    meta = load_table(tmp / "b.json").meta[size]
    combined = [*rows, *({**r, "run": 1000} for r in earlier)]
    assert [list(w[:2]) for w in meta["winners"]] == [list(w[:2]) for w in winners(combined)]
    with pytest.raises(ConfigError, match="--also .*broken.json: cannot use it"):
        _run([*argv, "--also", str(tmp / "broken.json")])
