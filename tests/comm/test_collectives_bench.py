"""``bench allreduce`` output format on a world of one (figures are not asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import hpcdl.comm as hc
from hpcdl.bench import main
from hpcdl.bench.allreduce import parse_size
from hpcdl.comm.collectives import ALGORITHMS
from hpcdl.errors import ConfigError

KEYS = {"algorithm", "size_bytes", "ranks", "time_s", "iqr_s", "algbw_GBps", "busbw_GBps", "time_vs_mpi"}


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
    assert next(r for r in rows if r["algorithm"] == "mpi")["time_vs_mpi"] == pytest.approx(1.0)
    assert "time/mpi" in capsys.readouterr().out
