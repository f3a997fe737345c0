"""A run's wall time and samples/s (``hpcdl/driver/figures.py``): one figure, printed alike by
the progress lines, the summary line, the run file and the report; progress by time too.

Runs go through the commands as a user types them (``python -m hpcdl.simulate ... -m
hpcdl.train``, ``python -m hpcdl.report``), in the simulator's virtual time.
"""

from __future__ import annotations

import re
from pathlib import Path

import h5py
import pytest

from hpcdl.driver.figures import rate_phrase, rate_text, samples_per_s, wall_phrase, wall_text
from hpcdl.report import main as report
from hpcdl.simulate import main as simulate

#: a progress line: step, loss, the run's samples/s up to it, its time
LINE = re.compile(r"^step (\d+)/(\d+)  loss (\S+)  (\S+) samples/s  time (\S+) s$")
#: the summary line's figures
SUMMARY = re.compile(r"\| wall (\S+) s \| (\S+) samples/s \|")
SMALL = ["model.depth=2", "model.width=32", "data.batch_size=16", "checkpoint.every=0"]


def costs(tmp_path: Path, seconds: float, layers: int) -> str:
    """``--compute``: a cost table charging every layer ``seconds`` forward and backward (virtual)."""
    table = tmp_path / "costs.toml"
    row = f"forward_s = {seconds!r}\nbackward_s = {seconds!r}\n"
    table.write_text("".join(f'[[layers]]\nlayer = "{i}"\n{row}' for i in range(layers)))
    return f"table:{table}"


def run(
    capsys: pytest.CaptureFixture[str], n: int, sets: list[str], *argv: str, compute: str = "measured"
) -> tuple[list[re.Match[str]], str]:
    """``python -m hpcdl.simulate -n N --compute COMPUTE -m hpcdl.train --config digits-mlp
    --progress lines --set ... ARGV`` (:data:`SMALL`, then ``sets``): its progress lines
    (parsed) and its summary line."""
    command = ["-n", str(n), "--compute", compute, "-m", "hpcdl.train", "--config", "digits-mlp"]
    settings = [a for s in [*SMALL, *sets] for a in ("--set", s)]
    assert simulate([*command, "--progress", "lines", *settings, *argv]) == 0
    out, err = capsys.readouterr()
    lines = [LINE.match(line) for line in err.splitlines() if re.match(r"step \d+/", line)]
    assert all(lines), err  # every progress line has the one form
    summary = [line for line in out.splitlines() if SUMMARY.search(line)]
    assert len(summary) == 1, out
    return lines, summary[0]


def report_row(capsys: pytest.CaptureFixture[str], path: Path) -> dict[str, str]:
    """``python -m hpcdl.report RUN.h5``: the table's row, by column header."""
    assert report([str(path), "--out", f"{path.parent}/plots/"]) == 0
    table = capsys.readouterr().out.splitlines()
    header = re.split(r"\s{2,}", table[0].strip())
    return dict(zip(header, re.split(r"\s{2,}", table[2].strip())))


@pytest.mark.parametrize(
    ("n", "sets"),
    [(3, ["parallel.strategy=sync", "train.steps=12", "train.log_every=5"]),
     (2, ["parallel.strategy=pipeline", "train.steps=6", "train.log_every=2"]),
     (3, ["parallel.strategy=ps", "train.steps=40", "train.log_every=10"])],
)  # fmt: skip
def test_the_progress_the_summary_the_run_file_and_the_report_print_the_same_figures(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, n: int, sets: list[str]
) -> None:
    out = tmp_path / "run.h5"
    lines, summary = run(capsys, n, sets, "--out", str(out))
    wall, rate = SUMMARY.search(summary).groups()
    last = lines[-1]
    assert last.group(1) == last.group(2)  # the last step's line
    assert last.group(4) == rate  # the same throughput
    with h5py.File(out) as f:
        attrs = dict(f.attrs)
        last_time = float(f["metrics/time"][-1])
    assert rate_text(attrs["samples_per_s"]) == rate and wall_text(attrs["wall_s"]) == wall
    assert last.group(5) == wall_text(last_time)  # a line's time is its step's metrics/time
    assert attrs["wall_s"] >= last_time  # the run's wall time counts the last evaluation and checkpoint
    row = report_row(capsys, out)
    assert row["wall s"] == wall and row["samples/s"] == rate


def test_a_resumed_run_adds_its_segments_alike_in_the_summary_and_the_report(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "run.h5"
    table = costs(tmp_path, 0.1, 6)  # a step: 0.8 virtual seconds (4 layers)
    _, first = run(capsys, 2, ["train.steps=8", "train.stop_at=4"], "--out", str(out), compute=table)
    _, second = run(capsys, 2, ["train.steps=8"], "--out", str(out), "--resume", "auto", compute=table)
    first_wall, _ = SUMMARY.search(first).groups()
    wall, rate = SUMMARY.search(second).groups()
    assert float(wall) > 1.5 * float(first_wall)  # both segments
    row = report_row(capsys, out)
    assert row["wall s"] == wall and row["samples/s"] == rate


def test_every_parameter_server_progress_line_carries_a_figure(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Server 0 hands its rows over during a phase (at most once a virtual second): each
    hand-off's line gives the throughput up to its last push."""
    sets = ["parallel.strategy=ps", "train.steps=60", "train.log_every=1", "log.flush_every=5"]
    lines, summary = run(capsys, 3, sets, "--out", str(tmp_path / "ps.h5"), compute=costs(tmp_path, 0.02, 6))
    assert len(lines) >= 4, lines  # rows handed over during the one phase, then the end
    for line in lines:
        assert float(line.group(4)) > 0, line.group(0)
    assert lines[-1].group(4) == SUMMARY.search(summary).group(2)


def test_progress_lines_come_by_time_when_steps_are_slower_than_the_interval(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A pipeline whose step takes longer than train.log_every_s (virtual seconds, a cost
    table) prints a line after every step, although train.log_every steps never pass."""
    table = costs(tmp_path, 1.0, 6)
    sets = ["parallel.strategy=pipeline", "train.steps=4", "train.log_every=100"]
    lines, _ = run(capsys, 2, [*sets, "train.log_every_s=5"], "--out", str(tmp_path / "a.h5"), compute=table)
    assert [int(line.group(1)) for line in lines] == [1, 2, 3, 4]
    times = [float(line.group(5)) for line in lines]
    assert all(b - a >= 5 for a, b in zip(times, times[1:])), times
    # by steps only: the last step's line
    lines, _ = run(capsys, 2, [*sets, "train.log_every_s=0"], "--out", str(tmp_path / "b.h5"), compute=table)
    assert [int(line.group(1)) for line in lines] == [4]


def test_the_figures_print_alike() -> None:
    assert samples_per_s(1024, 2.0) == 512.0 and samples_per_s(1024, 0.0) != samples_per_s(1024, 0.0)  # NaN
    assert rate_phrase(12280.4) == "12280 samples/s" and rate_phrase(8.663) == "8.66 samples/s"
    assert rate_phrase(float("nan")) == "samples/s n/a"
    assert wall_phrase(14.62) == "wall 14.6 s" and wall_phrase(None) == "wall n/a"
