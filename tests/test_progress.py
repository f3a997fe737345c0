"""Progress output: bar when interactive, lines in batch jobs, silent on other ranks."""

from __future__ import annotations

import io

import pytest

from hpcdl.driver.progress import SCHEDULER_VARS, Progress, choose_mode


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for var in (*SCHEDULER_VARS, "CI", "PMI_RANK", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_auto_mode(clean_env: pytest.MonkeyPatch) -> None:
    assert choose_mode("auto", _Tty()) == "bar"
    assert choose_mode("auto", io.StringIO()) == "lines"
    clean_env.setenv("PMI_RANK", "0")
    assert choose_mode("auto", io.StringIO()) == "bar"  # mpiexec pipes the output of an interactive run
    clean_env.setenv("SLURM_JOB_ID", "123")
    assert choose_mode("auto", _Tty()) == "lines"
    assert choose_mode("bar", io.StringIO()) == "bar"


def test_lines_every_n_steps_and_last() -> None:
    out = io.StringIO()
    p = Progress("lines", total=7, every=3, active=True, stream=out)
    for step in range(1, 8):
        p.update(step, loss=0.5)
    p.close()
    assert [ln.split()[1] for ln in out.getvalue().splitlines()] == ["3/7", "6/7", "7/7"]


def test_bar_and_inactive_ranks() -> None:
    out = io.StringIO()
    p = Progress("bar", total=5, every=1, active=True, stream=out)
    for step in range(1, 6):
        p.update(step, loss=1.0, samples_per_s=1234.0)
    p.close()
    assert "5/5" in out.getvalue() and "loss" in out.getvalue()
    silent = io.StringIO()
    q = Progress("bar", total=5, every=1, active=False, stream=silent)
    q.update(1, loss=1.0)
    q.write("hello")
    q.close()
    assert silent.getvalue() == ""
