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
    for step in (4, 8, 12, 16, 20, 22):  # meetings every 4 steps
        bar.update(step, loss=1.0)
    printed = [line.split("/")[0] for line in stream.getvalue().splitlines()]
    assert printed == ["step 8", "step 12", "step 16", "step 20", "step 22"]  # 5, 10, 15, 20 and the end


class _Clock:
    """A clock the test sets."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(("every_s", "printed"), [(30.0, [2, 4, 6, 8, 9, 10]), (0.0, [9, 10])])
def test_lines_by_time_when_steps_are_slower_than_the_interval(every_s: float, printed: list[int]) -> None:
    """Steps of 20 s, a line every 9 steps or 30 s: a line at the first step after 30 s."""
    out, clock = io.StringIO(), _Clock()
    p = Progress("lines", total=10, every=9, active=True, stream=out, every_s=every_s, clock=clock)
    for step in range(1, 11):
        clock.now += 20.0
        p.update(step, loss=1.0, samples_per_s=512.0, time_s=clock.now)
    lines = out.getvalue().splitlines()
    assert [int(ln.split()[1].split("/")[0]) for ln in lines] == printed
    assert lines[-1] == "step 10/10  loss 1  512 samples/s  time 200.0 s"


def test_the_bar_counts_time_on_the_given_clock_and_shows_the_runs_samples_per_s() -> None:
    """In the simulator the clock is virtual: the bar's elapsed time is the run's, and tqdm's own
    steps/s (which would disagree with samples/s) is not shown."""
    out, clock = io.StringIO(), _Clock()
    p = Progress("bar", total=4, every=1, active=True, stream=out, start=1, clock=clock)
    clock.now = 125.0
    p.update(4, loss=1.0, samples_per_s=12280.4)
    p.close()
    text = out.getvalue()
    assert "4/4 [02:05<00:00, loss=1, samples/s=12280]" in text, text
    assert "step/s" not in text and "it/s" not in text
