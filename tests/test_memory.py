"""Memory: each rank's estimate against what is allocated, and a run that cannot fit refused in one line
(hpcdl.nn.memory, hpcdl.parallel.memory, hpcdl.driver.memory), or a MemoryError ending as one line."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tracemalloc
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
from simulated import sim

from hpcdl.comm import world
from hpcdl.config import load_config
from hpcdl.driver.factory import build as build_model
from hpcdl.driver.factory import load_data
from hpcdl.driver.memory import ENV, MARGIN, Limits, check, estimate, read_limits, verdicts
from hpcdl.driver.run import build, plan
from hpcdl.errors import ConfigError
from hpcdl.models import build_model as model_by_name
from hpcdl.nn import MemoryProbe, SoftmaxCrossEntropy
from hpcdl.nn.memory import at
from hpcdl.parallel.memory import RankMemory, format_bytes
from hpcdl.parallel.pipe_plan import schedule
from hpcdl.rng import generator
from hpcdl.sim.compute import make_compute
from hpcdl.sim.engine import simulate
from hpcdl.sim.network import load_network
from hpcdl.simulate import main as simulate_main

# -- the estimate against what is allocated ------------------------------------------------------


def traced_step(model: Any, shape: tuple[int, ...], n: int) -> int:
    """The most NumPy allocates at once in a training step of ``n`` samples (tracemalloc)."""
    loss = SoftmaxCrossEntropy()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        x = np.ones((n, *shape), dtype=np.float32)
        loss.forward(model.forward(x), np.zeros(n, dtype=np.int64))
        model.backward(loss.backward())
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize(
    ("name", "shape", "options"),
    [
        ("mlp", (64,), {}),
        ("cnn", (1, 8, 8), {"dropout": 0.25}),
        ("vgg16", (3, 32, 32), {"width_mult": 0.25}),
        ("resnet18", (3, 16, 16), {"width_mult": 0.25}),
    ],
)
def test_a_steps_activations_are_estimated_within_the_margin(name: str, shape: tuple, options: dict) -> None:
    """Dry steps of 2 and 3 samples predict a real step of 48 (its peak, as tracemalloc sees it)."""

    def model() -> Any:
        streams = {"rng": generator(0, "init"), "dropout_rng": generator(0, "d")}
        return model_by_name(name, shape, 10, **streams, **options)

    act = MemoryProbe(model(), shape, np.float32).activations()
    real = traced_step(model(), shape, 48)
    assert abs(at(act.step, 48) - real) <= MARGIN * real, (at(act.step, 48), real)


KEEP = ("hpcdl.parallel", "hpcdl.nn", "hpcdl.optim", "hpcdl.comm.pack", "hpcdl.comm.buckets")


def held_arrays(strategy: Any) -> int:
    """Bytes of the NumPy arrays a built strategy holds (each buffer once; not its data set, sampler or
    communicators): the model, its gradients, the optimizer's state, the exchange's buffers, messages."""
    seen: set[int] = set()
    bases: dict[int, int] = {}

    def walk(obj: Any) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, np.ndarray):
            base = obj
            while isinstance(base.base, np.ndarray):
                base = base.base
            bases[id(base)] = base.nbytes
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v)
        elif isinstance(obj, list | tuple):
            for v in obj:
                walk(v)
        elif (type(obj).__module__ or "").startswith(KEEP):
            for key, v in getattr(obj, "__dict__", {}).items():
                if key != "ctx":
                    walk(v)
            for key in getattr(type(obj), "__slots__", ()):
                walk(getattr(obj, key, None))

    walk(strategy)
    return sum(bases.values())


@pytest.mark.parametrize(
    ("ranks", "sets"),
    [
        (1, []),
        (2, ["exchange.name=allreduce"]),
        (2, ["exchange.name=bucketed", "exchange.compression=float16"]),
        (3, ["parallel.strategy=ps", "ps.servers=2", "ps.compensation=dc"]),
        (3, ["parallel.strategy=pipeline", "optimizer.name=adam"]),
    ],
    ids=str,
)
def test_what_each_rank_holds_is_estimated_within_the_margin(ranks: int, sets: list[str]) -> None:
    """Parameters, gradients, optimizer state and buffers of every role against the arrays of the
    strategy built on virtual ranks (64 KiB of slack: BatchNorm statistics, small arrays)."""
    cfg = load_config("digits-cnn", sets)
    network, compute = load_network("eth10g", ranks), make_compute("none")
    built = simulate(ranks, lambda: build(cfg, world())[1], network=network, compute=compute).results
    estimates = estimate(cfg, plan(cfg, ranks), load_data(cfg))
    assert estimates is not None
    for est, strategy in zip(estimates, built, strict=True):
        real = held_arrays(strategy)
        assert abs(sum(est.parts.values()) - real) <= MARGIN * real + 2**16, (est.role, est.parts, real)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_a_stages_held_activations_are_what_the_pipeline_records(kind: str, tmp_path: Path) -> None:
    """The microbatches a stage holds at once times one microbatch's caches: the run's own
    ``ranks/activation_bytes`` (the arrays' bytes), exactly."""
    sets = ["parallel.strategy=pipeline", f"pipeline.schedule={kind}", "pipeline.microbatches=4",
            "pipeline.balance=[2,4,4]", "train.steps=2"]  # fmt: skip
    cfg = load_config("digits-cnn", sets)
    sim(3, cfg, out=tmp_path / "p.h5")
    with h5py.File(tmp_path / "p.h5") as f:
        recorded = f["ranks/activation_bytes"][...].max(axis=0)
    data = load_data(cfg)
    model = build_model(cfg, data, 0, np.float32, np, generator(0, "t"))
    probe = MemoryProbe(model, data.input_shape, np.float32)
    bounds = [0, 2, 6, 10]
    for s, held in enumerate(schedule(kind, 3, 4).in_flight()):
        fixed, per = probe.activations(bounds[s], bounds[s + 1]).held
        assert held * (fixed + 32 * per) == recorded[s]


def test_plan_shows_each_ranks_estimate_and_this_hosts_limits(capsys: pytest.CaptureFixture[str]) -> None:
    from hpcdl.train import main

    assert main(["--config", "digits-cnn", "--plan", "-n", "4", "--set", "parallel.strategy=ps"]) == 0
    out = capsys.readouterr().out
    assert "memory per rank (estimate, ±25%" in out
    assert re.search(r"\n  rank 0 +server +[\d.]+ [KMG]iB: activations .*parameters", out)
    workers = r"\n  ranks 1-3 +worker +[\d.]+ [KMG]iB: activations [\d.]+ [KMG]iB \(a batch: 32 x"
    assert re.search(workers, out)
    assert "\nlimits here: " in out


# -- the limits, and the refusal -------------------------------------------------------------------


def limits(host: int | None = None, *, rss: int = 0, space: int | None = None, vm: int = 0) -> Limits:
    return Limits(host=host, host_name="the test's limit ({})", group="", available=None,
                  address_space=space, rss=rss, vm=vm)  # fmt: skip


BIG = ["data.batch_size=2048", "data.sampler=random"]


def test_a_run_that_cannot_fit_is_refused_naming_the_batch_that_fits(
    capsys: pytest.CaptureFixture[str],
) -> None:
    cfg = load_config("digits-cnn", BIG)
    placement, data = plan(cfg, 1), load_data(cfg)
    (est,) = estimate(cfg, placement, data) or []
    limit = est.total() // 3
    with pytest.raises(ConfigError) as err:
        check(world(), cfg, placement, data, limits=limits(limit))
    text = str(err.value)
    assert "\n" not in text
    assert text.startswith("this run does not fit in memory: rank 0 (worker) needs about ")
    assert format_bytes(est.total()) in text and f"the test's limit ({format_bytes(limit)})" in text
    assert f"{ENV}=off skips this check" in text
    fits = int(re.search(r"lower data\.batch_size to at most (\d+)", text)[1])
    assert est.total(fits) <= limit < est.total(fits + 1)
    smaller = load_config("digits-cnn", [*BIG[1:], f"data.batch_size={fits}"])
    check(world(), smaller, plan(smaller, 1), data, limits=limits(limit))  # the batch it names passes
    assert "! rank 0 needs about" in capsys.readouterr().err  # above 80% of the limit: a warning


def test_what_is_in_use_counts_and_off_skips_the_check() -> None:
    cfg = load_config("digits-cnn", BIG)
    placement, data = plan(cfg, 1), load_data(cfg)
    (est,) = estimate(cfg, placement, data) or []
    check(world(), cfg, placement, data, limits=limits(space=2 * est.total()))
    in_use = est.total() * 11 // 10  # well past the limit: a second estimate may differ by some bytes
    with pytest.raises(ConfigError, match=r"leaves beside the [\d.]+ [KMG]iB in use"):
        check(world(), cfg, placement, data, limits=limits(space=2 * est.total(), vm=in_use))
    with pytest.raises(ConfigError, match=r"the test's limit \(1 KiB\) is less than the 2 KiB its processes"):
        check(world(), cfg, placement, data, limits=limits(1024, rss=2048))
    assert read_limits({ENV: "off"}) is None
    assert read_limits({ENV: "3G"}).host == 3 << 30  # type: ignore[union-attr]
    with pytest.raises(ConfigError, match=f"{ENV} takes byte counts"):
        read_limits({ENV: "lots"})


def test_sizes_read_as_written() -> None:
    sizes = [format_bytes(n) for n in (512, 3277, 1020 * 1024, 41.5 * 2**30, 1100 * 2**40)]
    assert sizes == ["512 B", "3.2 KiB", "1020 KiB", "41.5 GiB", "1100 TiB"]
    # rounding never prints an exponent, nor 1024 of a unit
    edges = [format_bytes(n) for n in (99.97 * 1024, 999.7 * 1024, 1023.7 * 1024)]
    assert edges == ["100 KiB", "1000 KiB", "1 MiB"]


def test_ranks_sharing_a_host_or_a_process_are_summed() -> None:
    one = RankMemory("worker", {"parameters": 100}, ((0, 10, "a batch"),), 10)  # 200 bytes
    host = limits(700)
    sim4 = [(0, 7, host)] * 4  # four virtual ranks in one process
    errors, _ = verdicts([one] * 4, sim4)
    assert len(errors) == 1 and "its 4 ranks need about 800 B together" in errors[0]
    assert "lower data.batch_size to at most 7" in errors[0]  # 4 x (100 + 10 b) <= 700
    two_hosts = [(0, 1, host), (0, 2, host), (2, 3, host), (2, 4, host)]  # 400 bytes a host
    assert verdicts([one] * 4, two_hosts) == ([], [])
    space = limits(space=300, vm=0)
    errors, _ = verdicts([one] * 2, [(0, 1, space), (0, 1, space)])  # one process: its address space
    assert "its 2 ranks need about 400 B together" in errors[0] and "at most 5" in errors[0]


def test_the_ranks_of_one_process_build_one_after_another() -> None:
    stage = RankMemory("stage 0", {"parameters": 100}, ((0, 10, "a batch"),), 10, building=1000)  # 200 built
    host = limits(2100)
    sim4 = [(0, 7, host)] * 4  # virtual ranks: 4 x 200 built, and one build's 800 beyond its own
    assert verdicts([stage] * 4, sim4) == ([], [])
    errors, _ = verdicts([stage] * 4, [(0, 7, limits(1500))] * 4)
    assert len(errors) == 1 and "its 4 ranks need about 1.56 KiB together" in errors[0]
    processes = [(0, pid, host) for pid in range(4)]  # separate processes build at once: 4 x 1000
    errors, _ = verdicts([stage] * 4, processes)
    assert len(errors) == 1 and "its 4 ranks need about 3.91 KiB together" in errors[0]


def test_the_cgroup_limit_is_the_lowest_up_the_hierarchy(tmp_path: Path) -> None:
    proc, cg = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "statm").write_text("1000 500 0 0 0 0 0\n")
    (proc / "meminfo").write_text("MemTotal:  1000 kB\nMemAvailable:  600 kB\n")
    job = cg / "slurm" / "job_7" / "step_0"
    job.mkdir(parents=True)
    (proc / "self" / "cgroup").write_text("0::/slurm/job_7/step_0\n")  # cgroup v2
    (job / "memory.max").write_text("max\n")
    (job.parent / "memory.max").write_text(f"{8 << 30}\n")
    (cg / "slurm" / "memory.max").write_text(f"{16 << 30}\n")
    got = read_limits({}, proc=str(proc), cgroups=str(cg))
    assert got is not None and got.host == 8 << 30 and got.group == str(job.parent / "memory.max")
    assert got.available == 600 * 1024 and got.rss == 500 * os.sysconf("SC_PAGE_SIZE")
    v1 = cg / "memory" / "job"
    v1.mkdir(parents=True)
    (proc / "self" / "cgroup").write_text("4:memory:/job\n0::/\n")  # cgroup v1 (hybrid)
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "unlimited"
    assert read_limits({}, proc=str(proc), cgroups=str(cg)).host is None  # type: ignore[union-attr]
    (v1 / "memory.limit_in_bytes").write_text(f"{2 << 30}\n")
    assert read_limits({}, proc=str(proc), cgroups=str(cg)).host == 2 << 30  # type: ignore[union-attr]


def test_virtual_ranks_are_refused_together(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The simulator's ranks share one process: one rank fits the limit, four do not."""
    cfg = load_config("digits-cnn", BIG)
    (est,) = estimate(cfg, plan(cfg, 1), load_data(cfg)) or []
    in_use = read_limits({}).rss  # type: ignore[union-attr]
    monkeypatch.setenv(ENV, str(in_use + int(2.5 * est.total())))
    argv = ["-m", "hpcdl.train", "--config", "digits-cnn", "--set", "data.batch_size=2048", "--set",
            "data.sampler=random", "--set", "train.steps=1", "--progress", "none"]  # fmt: skip
    assert simulate_main(["-n", "4", "--compute", "none", *argv]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("hpcdl.train: error: this run does not fit in memory: its 4 ranks need about")


def test_a_memory_error_on_a_virtual_rank_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from hpcdl.nn import Linear

    def forward(self: Any, x: Any) -> Any:  # named as a layer's: the message names the layer
        raise MemoryError("Unable to allocate 8.00 EiB for an array with shape (1,) and data type float32")

    monkeypatch.setattr(Linear, "forward", forward)
    monkeypatch.setenv(ENV, "off")  # the estimate's dry steps would fail first
    argv = ["-n", "2", "--compute", "none", "-m", "hpcdl.train", "--config", "digits-mlp", "--set",
            "train.steps=2", "--progress", "none", "--out", str(tmp_path / "r.h5")]  # fmt: skip
    assert simulate_main(argv) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert re.match(
        r"hpcdl\.train: error: rank \d ran out of memory in the forward of layer 1 \(Linear\): unable to "
        r"allocate 8\.00 EiB for an array with shape \(1,\) and data type float32; lower data\.batch_size",
        line,
    )


# -- under a real ulimit -v ----------------------------------------------------------------------------

ULIMIT_KB = 1_200_000  # the interpreter with NumPy, h5py and MPI takes about 0.25 GiB of it
HUGE = ["--config", "digits-cnn", "--set", "data.batch_size=20000", "--set", "data.sampler=random",
        "--set", "train.steps=1", "--progress", "none"]  # fmt: skip


def under_ulimit(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    command = " ".join([sys.executable, "-m", "hpcdl.train", *args])
    return subprocess.run(
        ["bash", "-c", f"ulimit -v {ULIMIT_KB}; exec {command}"],
        capture_output=True, text=True, timeout=300, check=False, env={**os.environ, **(env or {})},
    )  # fmt: skip


@pytest.mark.skipif(sys.platform != "linux", reason="ulimit -v as Linux enforces it")
def test_under_ulimit_v_a_run_that_cannot_fit_is_one_line_before_anything_is_written(tmp_path: Path) -> None:
    out = tmp_path / "r.h5"
    proc = under_ulimit([*HUGE, "--out", str(out)])
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line.startswith("hpcdl.train: error: this run does not fit in memory: rank 0 (worker) needs about")
    assert "its process's address-space limit (ulimit -v: 1.14 GiB)" in line
    assert re.search(r"lower data\.batch_size to at most \d+", line) and not out.exists()


@pytest.mark.skipif(sys.platform != "linux", reason="ulimit -v as Linux enforces it")
def test_under_ulimit_v_a_memory_error_is_one_line_and_the_run_file_says_failed(tmp_path: Path) -> None:
    out = tmp_path / "r.h5"
    # the layers by Conv2d's rule: timing them at this batch might or might not fit (model.winograd's own
    # out-of-memory case is tests/test_convplan.py's)
    proc = under_ulimit([*HUGE, "--set", "model.winograd=rule", "--out", str(out)], {ENV: "off"})
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.splitlines()
    assert re.match(r"hpcdl\.train: error: rank 0 ran out of memory in the (forward|backward) of layer \d+ "
                    r"\(\w+\): unable to allocate [\d.]+ [KMG]iB for an array with shape", line)  # fmt: skip
    with h5py.File(out) as f:
        assert f.attrs["status"] == "failed"
