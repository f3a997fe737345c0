"""Will the run fit in memory? Each rank's estimate against the limits it runs under.

Before the strategy builds anything (:func:`check`, from :func:`hpcdl.driver.run.build`),
rank 0 estimates what every rank will allocate (:func:`estimate`: the strategy's
:meth:`~hpcdl.parallel.Strategy.memory`, from dry steps of a model of its own, see
:class:`~hpcdl.nn.MemoryProbe`), and the ranks compare it with three limits:

* the memory limit of their cgroup (v2 ``memory.max``, v1 ``memory.limit_in_bytes``: the
  lowest up the hierarchy), which the ranks of a host in that cgroup share: what they use
  now (their resident sets) and all their estimates; ``HPCDL_MEMORY_LIMIT`` (bytes, e.g.
  ``64G``) stands in for it, for a limit hpcdl cannot see;
* the host's available memory (``MemAvailable`` of ``/proc/meminfo``: what can be had
  without swapping): the estimates of the host's ranks;
* each process's address space (``ulimit -v``, ``RLIMIT_AS``): its virtual size now and the
  estimates of its ranks (one, or every virtual rank of a simulation).

A run whose ranks need more than a limit leaves is refused in one line naming the
estimate, the limit and the fix, before anything is written; above :data:`WARN_AT` of one,
rank 0 warns. The estimate counts the arrays hpcdl allocates and is within about
:data:`MARGIN` of them (``tests/test_memory.py``); ``HPCDL_MEMORY_LIMIT=off`` skips the
check. A GPU run is not checked (its arrays are the device's).

Ranks in separate processes build at once, so a host's ranks need the sum of each one's
peak, building included. The virtual ranks of a simulation share one process and build one
after another (the simulator runs one rank at a time between communicator calls, and a
pipeline stage drops the other stages' layers before its next one): they need the sum of
their built states and one rank's building peak beyond its own.
"""

from __future__ import annotations

import dataclasses
import os
import resource
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hpcdl.comm import Communicator, host_ranks, on_root
from hpcdl.config import Config
from hpcdl.data import Dataset
from hpcdl.driver.cli import parse_size
from hpcdl.driver.factory import EVAL_BATCH, build
from hpcdl.errors import ConfigError
from hpcdl.nn import MemoryProbe, Sequential
from hpcdl.parallel import Placement, strategy_class
from hpcdl.parallel.memory import RankMemory, format_bytes
from hpcdl.rng import generator

__all__ = ["ENV", "MARGIN", "WARN_AT", "Limits", "check", "estimate", "plan_lines", "read_limits"]

#: the environment variable: a host memory limit in bytes (``64G``), or ``off`` (no check)
ENV = "HPCDL_MEMORY_LIMIT"
#: above this fraction of a limit, a run is warned about
WARN_AT = 0.8
#: how far the estimate may be from what is allocated (the tests hold it to that)
MARGIN = 0.25
#: cgroup v1 writes "no limit" as the largest page-aligned int64
_UNLIMITED = 2**62


@dataclass(frozen=True)
class Limits:
    """What one process may use, and uses (bytes; None: no limit).

    Attributes:
        host: the limit the ranks of a host share: ``HPCDL_MEMORY_LIMIT``, else the cgroup's.
        host_name: what ``host`` is, in words, with ``{}`` where its value goes.
        group: the ranks sharing ``host`` are those of a host with this ``group`` (the cgroup).
        available: the host's ``MemAvailable``.
        address_space: ``RLIMIT_AS`` (``ulimit -v``).
        rss: the process's resident set now.
        vm: the process's virtual size now.
    """

    host: int | None
    host_name: str
    group: str
    available: int | None
    address_space: int | None
    rss: int
    vm: int


def read_limits(
    environ: Mapping[str, str] | None = None, *, proc: str = "/proc", cgroups: str = "/sys/fs/cgroup"
) -> Limits | None:
    """The limits of this process (None: ``HPCDL_MEMORY_LIMIT=off``, nothing is checked).

    Args:
        environ: the environment (default ``os.environ``).
        proc: where ``/proc`` is (tests give a tree of their own).
        cgroups: where the cgroup file systems are mounted.

    Raises:
        ConfigError: ``HPCDL_MEMORY_LIMIT`` is neither ``off`` nor a byte count.
    """
    env = os.environ if environ is None else environ
    text = env.get(ENV, "").strip()
    if text.lower() == "off":
        return None
    if text:
        host, name, group = parse_size(text, ENV), f"the {ENV} limit of its host ({{}})", ""
    else:
        host, where = _cgroup_limit(Path(proc), Path(cgroups))
        escaped = where.replace("{", "{{").replace("}", "}}")
        name, group = f"its cgroup's memory limit ({escaped}: {{}})", where
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    rss, vm = _usage(Path(proc))
    return Limits(
        host=host,
        host_name=name,
        group=group,
        available=_meminfo(Path(proc)).get("MemAvailable"),
        address_space=None if soft == resource.RLIM_INFINITY else int(soft),
        rss=rss,
        vm=vm,
    )


def _usage(proc: Path) -> tuple[int, int]:
    """This process's resident set and virtual size (``/proc/self/statm``; 0 where unknown)."""
    try:
        size, resident = (proc / "self" / "statm").read_text().split()[:2]
    except (OSError, ValueError):
        return 0, 0
    page = os.sysconf("SC_PAGE_SIZE")
    return int(resident) * page, int(size) * page


def _meminfo(proc: Path) -> dict[str, int]:
    """``/proc/meminfo`` in bytes (empty where there is none)."""
    try:
        lines = (proc / "meminfo").read_text().splitlines()
    except OSError:
        return {}
    out = {}
    for line in lines:
        key, _, rest = line.partition(":")
        fields = rest.split()
        if fields and fields[0].isdigit():
            out[key] = int(fields[0]) * (1024 if fields[1:2] == ["kB"] else 1)
    return out


def _cgroup_limit(proc: Path, root: Path) -> tuple[int | None, str]:
    """The lowest memory limit of this process's cgroup and its ancestors, and the file it is in.

    ``/proc/self/cgroup`` names the cgroup: ``0::/PATH`` (v2: ``ROOT/PATH/memory.max``) and
    ``N:...memory...:/PATH`` (v1: ``ROOT/memory/PATH/memory.limit_in_bytes``).
    """
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None, ""
    candidates = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            candidates.append((root, path, "memory.max"))
        elif "memory" in controllers.split(","):
            candidates.append((root / "memory", path, "memory.limit_in_bytes"))
    best: tuple[int | None, str] = (None, "")
    for mount, path, name in candidates:
        here = mount / path.strip("/")
        for directory in [here, *here.parents]:
            limit = _read_limit(directory / name)
            if limit is not None and (best[0] is None or limit < best[0]):
                best = (limit, str(directory / name))
            if directory == mount:
                break
    return best


def _read_limit(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if not text.isdigit() or int(text) >= _UNLIMITED:
        return None  # "max" (v2) or the v1 unlimited value
    return int(text)


def estimate(
    cfg: Config, placement: Placement, data: Dataset, model: Sequential | None = None
) -> list[RankMemory] | None:
    """What each rank will allocate, by the strategy's :meth:`~hpcdl.parallel.Strategy.memory`.

    Args:
        cfg: the config.
        placement: the strategy's placement.
        data: the data set (its sample shape and test images).
        model: a model of the config's to measure (its BatchNorm statistics change, its
            dropout draws); default: one built here, freed after.

    Returns:
        One estimate per rank; None for a GPU run or a strategy without estimates.

    Raises:
        ConfigError: the model or a pipeline's partition does not fit (the strategy's errors).
    """
    if cfg["device"] != "cpu":
        return None
    dtype = np.dtype(cfg["dtype"])
    if model is None:
        model = build(cfg, data, 0, dtype, np, generator(cfg["seed"], "memory"))
    probe = MemoryProbe(model, data.input_shape, dtype)
    cls = strategy_class(cfg["parallel.strategy"])
    return cls.memory(cfg, placement, probe, len(data.y_test), EVAL_BATCH)


def check(
    comm: Communicator, cfg: Config, placement: Placement, data: Dataset, *, limits: Limits | None = None
) -> None:
    """Refuse a run whose ranks cannot fit in the memory they have (collective, before building).

    Args:
        comm: the world.
        cfg: the config.
        placement: the strategy's placement.
        data: the data set.
        limits: this rank's limits (default: :func:`read_limits`; tests give their own).

    Raises:
        ConfigError: one line naming the ranks' estimate, the limit it exceeds and the fix,
            the same on every rank.
    """
    mine = limits if limits is not None else read_limits()
    everyone = comm.gather((min(host_ranks(comm)), os.getpid(), mine), root=0)

    def judge() -> tuple[list[str], list[str]]:
        # rank 0 alone estimates and judges, every rank gets the verdict: a simulation's 1,024
        # ranks would each unpickle and judge 1,024 estimates (N^2 work) to reach the same one
        if any(lim is None for _, _, lim in everyone or ()):  # HPCDL_MEMORY_LIMIT=off
            return [], []
        estimates = estimate(cfg, placement, data)
        return ([], []) if estimates is None else verdicts(estimates, everyone or ())

    errors, warnings = on_root(comm, judge)
    if errors:
        raise ConfigError(errors[0])
    if comm.Get_rank() == 0:
        for line in warnings:
            print(f"hpcdl.train: ! {line}", file=sys.stderr, flush=True)


def verdicts(
    estimates: Sequence[RankMemory], everyone: Sequence[tuple[int, int, Limits]]
) -> tuple[list[str], list[str]]:
    """The refusals and the warnings of ``estimates`` (by world rank) under the ranks' limits.

    Args:
        estimates: each rank's.
        everyone: per rank, ``(host, pid, limits)``: ranks with the same host (its lowest rank)
            share its memory, ranks with the same host and pid a process.

    Returns:
        ``(refusals, warnings)``, each a list of one-line messages.
    """
    estimates = _one_build_at_a_time(estimates, everyone)
    checks: list[tuple[list[int], int | None, int, str]] = []  # ranks, limit, in use, the limit in words
    for ranks in _groups(everyone, lambda host, pid, lim: (host, pid)):
        lim = everyone[ranks[0]][2]
        checks.append((ranks, lim.address_space, lim.vm, "its process's address-space limit (ulimit -v: {})"))
    for ranks in _groups(everyone, lambda host, pid, lim: (host, lim.group)):
        lim = everyone[ranks[0]][2]
        in_use = sum({everyone[r][1]: everyone[r][2].rss for r in ranks}.values())  # each process once
        checks.append((ranks, lim.host, in_use, lim.host_name))
    for ranks in _groups(everyone, lambda host, pid, lim: host):
        lim = everyone[ranks[0]][2]
        checks.append((ranks, lim.available, 0, "the memory available on its host (MemAvailable: {})"))
    errors: list[tuple[int, str]] = []  # (room, message): the tightest limit first
    warnings = []
    for ranks, limit, in_use, name in checks:
        if limit is None:
            continue
        need = sum(estimates[r].total() for r in ranks)
        room = limit - in_use
        if need > room:
            errors.append((room, _refusal([estimates[r] for r in ranks], ranks, limit, in_use, name)))
        elif need > WARN_AT * room:
            who = f"rank {ranks[0]}" if len(ranks) == 1 else f"the {len(ranks)} ranks of a host"
            warnings.append(
                f"{who} need{'s' * (len(ranks) == 1)} about {format_bytes(need)} (estimate, ±{MARGIN:.0%}), "
                f"{need / room:.0%} of what {name} leaves ({format_bytes(room)}): it may not fit"
            )
    return [message for _, message in sorted(errors, key=lambda e: e[0])], warnings


def _one_build_at_a_time(
    estimates: Sequence[RankMemory], everyone: Sequence[tuple[int, int, Limits]]
) -> list[RankMemory]:
    """``estimates`` with the building peaks of the ranks of one process (a simulation's) but
    one dropped: they build one after another, so beside the others' built states only the
    rank whose building rises most above its own built state counts it."""
    out = list(estimates)
    for ranks in _groups(everyone, lambda host, pid, lim: (host, pid)):
        builders = [r for r in ranks if estimates[r].building]
        if len(builders) < 2:
            continue
        steady = {r: sum(estimates[r].parts.values()) + estimates[r].activation_bytes() for r in builders}
        top = max(builders, key=lambda r: estimates[r].building - steady[r])
        for r in builders:
            if r != top:
                out[r] = dataclasses.replace(estimates[r], building=0)
    return out


def _groups(everyone: Sequence[tuple[int, int, Limits]], key: Callable[..., Any]) -> list[list[int]]:
    """The world ranks grouped by ``key(host, pid, limits)``, in rank order."""
    groups: dict[Any, list[int]] = {}
    for rank, (host, pid, lim) in enumerate(everyone):
        groups.setdefault(key(host, pid, lim), []).append(rank)
    return list(groups.values())


def _refusal(ests: Sequence[RankMemory], ranks: Sequence[int], limit: int, in_use: int, name: str) -> str:
    """One line: who needs how much (and for what), the limit (``name`` with ``{}`` where its
    value goes) and what it leaves, the fix."""
    big = max(range(len(ests)), key=lambda i: ests[i].total())
    need = sum(e.total() for e in ests)
    detail = f"estimate ±{MARGIN:.0%}: {ests[big].breakdown()}"
    if len(ranks) == 1:
        who = f"rank {ranks[0]} ({ests[big].role}) needs about {format_bytes(need)} ({detail})"
    else:
        most = f"rank {ranks[big]}, {ests[big].role}: {format_bytes(ests[big].total())}"
        who = f"its {len(ranks)} ranks need about {format_bytes(need)} together (the most, {most}, {detail})"
    limit_words = name.format(format_bytes(limit))
    if in_use >= limit:
        return (
            f"this run does not fit in memory: {limit_words} is less than the {format_bytes(in_use)} its "
            f"processes already use, and {who}: raise the limit ({ENV}=off skips this check)"
        )
    if in_use:
        room, used = format_bytes(limit - in_use), format_bytes(in_use)
        limit_words = f"the {room} that {limit_words} leaves beside the {used} in use"
    return (
        f"this run does not fit in memory: {who}, more than {limit_words}: "
        f"{_fix(ests, limit - in_use, ests[big])}, or raise the limit ({ENV}=off skips this check)"
    )


def _fix(ests: Sequence[RankMemory], room: int, big: RankMemory) -> str:
    """Lower ``data.batch_size`` to the largest that fits (bisection: the totals grow with it)."""
    lo, hi = 0, ests[0].batch - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if sum(e.total(mid) for e in ests) <= room:
            lo = mid
        else:
            hi = mid - 1
    if lo >= 1:
        joined = f", {big.hint}" if big.hint.startswith("or ") else f" {big.hint}" if big.hint else ""
        return f"lower data.batch_size to at most {lo}{joined}"
    alternative = big.hint.removeprefix("or ") if big.hint.startswith("or ") else "use a smaller model"
    one = format_bytes(sum(e.total(1) for e in ests))
    return f"even data.batch_size = 1 needs {one}{big.what(1)}: {alternative}"


def plan_lines(estimates: Sequence[RankMemory] | None, limits: Limits | None) -> list[str]:
    """``--plan``'s lines: each rank's estimate (runs of like ranks on one line), this host's limits,
    and a warning when one rank alone cannot fit here."""
    if not estimates:
        return []
    lines = [f"memory per rank (estimate, ±{MARGIN:.0%}; the arrays hpcdl allocates, beyond the interpreter "
             "and the data set):"]  # fmt: skip
    start = 0
    for r in range(1, len(estimates) + 1):
        if r == len(estimates) or estimates[r] != estimates[start]:
            who = f"rank {start}" if r - start == 1 else f"ranks {start}-{r - 1}"
            lines.append(f"  {who:<14}{estimates[start].role:<10}{estimates[start].describe()}")
            start = r
    notes = dict.fromkeys(e.note for e in estimates if e.note)
    lines += [f"  ({note})" for note in notes]
    if limits is None:
        return [*lines, f"limits here: not checked ({ENV}=off)"]
    rooms = [
        (limits.host, limits.rss, limits.host_name),
        (limits.available, 0, "the memory available on this host (MemAvailable: {})"),
        (limits.address_space, limits.vm, "a process's address-space limit (ulimit -v: {})"),
    ]
    words = [name.format(format_bytes(limit)) for limit, _, name in rooms if limit is not None]
    lines.append("limits here: " + ("; ".join(words) if words else "none found"))
    big = max(range(len(estimates)), key=lambda r: estimates[r].total())
    exceeded = [(limit - in_use, limit, in_use, name) for limit, in_use, name in rooms
                if limit is not None and estimates[big].total() > limit - in_use]  # fmt: skip
    if exceeded:
        _, limit, in_use, name = min(exceeded)
        lines.append("! " + _refusal([estimates[big]], [big], limit, in_use, name))
    return lines
