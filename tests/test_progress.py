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


def test_lines_due_between_two_meetings_are_printed_at_the_next() -> None:
    import io

    stream = io.StringIO()
    bar = Progress("lines", total=22, every=5, active=True, stream=stream)
    for step, since in ((4, 0), (8, 4), (12, 8), (16, 12), (20, 16), (22, 20)):  # meetings every 4 steps
        bar.update(step, since=since, loss=1.0)
    printed = [line.split("/")[0] for line in stream.getvalue().splitlines()]
    assert printed == ["step 8", "step 12", "step 16", "step 20", "step 22"]  # 5, 10, 15, 20 and the end
