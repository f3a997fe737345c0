"""Where a process runs: the CPU, BLAS and MPI library benchmarks record beside their rows."""

from __future__ import annotations

import builtins
from pathlib import Path

import pytest

from hpcdl.comm import machine

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC 9R14
stepping\t: 1
cpu MHz\t\t: 2596.102

processor\t: 1
model name\t: some other core
"""


def test_cpu_model_reads_the_first_processor_without_its_clock(tmp_path: Path) -> None:
    path = tmp_path / "cpuinfo"
    path.write_text(CPUINFO)
    assert machine.cpu_model(path) == "AMD EPYC 9R14 (family/model/stepping 25/17/1)"
    assert machine.cpu_model(tmp_path / "missing")  # unreadable: the platform's name, never an error


def test_describe_names_cpu_blas_and_mpi() -> None:
    info = machine.describe(ranks_per_node=1)
    assert info["cores"] >= 1 and info["cpu"] == machine.cpu_model()
    assert info["blas"] not in ("unknown", "none")  # NumPy's BLAS, read by threadpoolctl
    assert info["blas_threads"] >= 1 and "MPI" in info["mpi"].upper() and info["ranks_per_node"] == 1
    line = machine.machine_line(info)
    assert info["cpu"] in line and info["blas"] in line and info["mpi"] in line


def test_blas_without_threadpoolctl_says_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def no_threadpoolctl(name: str, *args: object, **kwargs: object) -> object:
        if name == "threadpoolctl":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_threadpoolctl)
    assert machine.blas()["library"] == "unknown"


def test_the_simulator_is_named_as_the_library() -> None:
    class Simulated:
        sim_attrs = staticmethod(lambda: {})

        def Get_size(self) -> int:  # noqa: N802 - the communicator's name
            return 3

    info = machine.describe(Simulated())  # type: ignore[arg-type]
    assert info["mpi"] == "hpcdl.sim (virtual ranks)" and info["ranks"] == 3


@pytest.mark.parametrize(
    ("on_node", "cores", "bound", "want"),
    [
        (2, 2, None, 1),
        (1, 8, None, 8),
        (3, 8, None, 2),
        (16, 8, None, 1),
        (4, 64, 64, 16),
        (4, 64, 2, 2),
        (4, 16, 8, 4),
    ],  # fmt: skip  (the last: 4 ranks bound 2 by 2 to a socket of 8 cores: 4 each, not 8)
)
def test_a_ranks_blas_gets_its_share_of_the_nodes_cores(on_node: int, cores: int, bound, want: int) -> None:
    """A share of the node's cores, or the cores the launcher bound the rank to when fewer."""
    assert machine.blas_share(on_node, cores, bound) == want


def test_blas_threads_are_left_alone_when_the_user_chose() -> None:
    from hpcdl.comm import world

    before = machine.blas()["threads"]
    assert machine.fit_blas_threads(world(), env={"OPENBLAS_NUM_THREADS": "3"}) is None
    assert machine.blas()["threads"] == before


def test_blas_threads_are_fitted_to_the_node_when_nobody_chose() -> None:
    """One rank alone on this machine: its BLAS gets every core it may run on (then put back)."""
    import os

    from threadpoolctl import threadpool_limits

    from hpcdl.comm import world

    with threadpool_limits(limits=1, user_api="blas"):  # restored on leaving
        want = machine.blas_share(1, bound=len(os.sched_getaffinity(0)))
        got = machine.fit_blas_threads(world(), env={})
        assert machine.blas()["threads"] == want
        assert got == ((1, want) if want != 1 else None)
