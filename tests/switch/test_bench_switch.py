"""``bench switch``: exact sums from the load generator; --calibrate writes networks the simulator loads."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcdl.bench.switch import bench_switch, write_networks
from hpcdl.sim.network import load_network


@pytest.mark.timeout(120)
def test_calibrate_writes_a_switch_and_a_host_network_with_the_measured_costs(tmp_path: Path) -> None:
    rows = bench_switch([2], [16, 1], slots=32, window=32, seconds=0.2, repeat=1)
    assert {(r["batch"], r["gso"]) for r in rows} == {(16, True), (16, False), (1, False)}
    assert all(r["bad_results"] == 0 and r["packets_per_s"] > 0 for r in rows)
    switch_file, host_file = write_networks(rows, "eth10g", tmp_path)
    batched = next(r for r in rows if r["batch"] == 16 and r["gso"])
    single = next(r for r in rows if r["batch"] == 1)
    base = load_network("eth10g")
    for path, mode, row in ((switch_file, "switch", batched), (host_file, "host", single)):
        net = load_network(path)
        assert path.name == f"eth10g-{mode}.toml"
        assert net.switch.mode == mode and net.switch.rank == -1 and net.switch.processing == "serial"
        assert net.switch.per_packet_us > 0
        assert net.switch.per_packet_us == pytest.approx(row["cpu_us_per_packet_in"], abs=1e-4)
        assert net.inter.describe() == base.inter.describe()
