"""Whether a run file marked ``running`` is still being written, from its writer's host, pid and heartbeat.

The training command records, as root attributes of the run file, rank 0's ``host``
(``socket.gethostname()``), ``pid``, ``pid_start`` (the process's start, in clock ticks
after the host's boot: ``/proc/PID/stat``) and a ``heartbeat`` (ISO 8601, UTC) that every
flush renews, and every step boundary at least every :data:`HEARTBEAT_S` seconds, while
``status == "running"``; ``heartbeat_gap_s`` is the longest time between two heartbeats of
that writer so far. A run killed with SIGKILL, a second Ctrl-C or a dead rank never gets
to set another status.

On the writer's host we can tell: when its process is gone (or the pid now belongs to
another process: another start time, another program, or a process started after the
last heartbeat) the run was **interrupted**; while it runs, the run is being written.
From another host only the heartbeat tells: a writer counts as alive while its heartbeat
is younger than :func:`stale_after` (3 of its longest gaps, at least 2 minutes). The
report shows the time since the last write; ``train --resume`` refuses a run whose
writer is alive (:func:`writer`).
"""

from __future__ import annotations

import datetime
import math
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "RUNNING",
    "INTERRUPTED",
    "HEARTBEAT_S",
    "Writer",
    "writer",
    "stale_after",
    "run_status",
    "process_alive",
    "start_ticks",
    "ago",
]

RUNNING = "running"
INTERRUPTED = "interrupted"

#: a writer renews its heartbeat at the first step boundary this many seconds after the last
HEARTBEAT_S = 30.0
#: a writer on another host is alive while its heartbeat is younger than this many of its
#: longest gaps between heartbeats (``heartbeat_gap_s``) ...
STALE_GAPS = 3
#: ... and at least this many seconds (4 heartbeats of a writer whose flushes come faster)
STALE_MIN_S = 4 * HEARTBEAT_S

#: seconds of tolerance when comparing a process's start with the heartbeat (whole seconds
#: in the file; the boot time in /proc/stat is whole seconds too)
_SLACK_S = 2.0


@dataclass(frozen=True)
class Writer:
    """The job that writes a run file marked ``running``, as the file's attributes tell.

    Attributes:
        host: the writer's host ("" when not recorded: a file of an older hpcdl).
        pid: its process id (0 when not recorded).
        age_s: seconds since its heartbeat (or since the file was modified, for a file
            without one); None when neither is known.
        local: the writer ran on this host, so its process can be looked at.
        process: on this host, whether its process still runs (:func:`process_alive`);
            None elsewhere, or when that cannot be told.
        stale_after_s: from another host, the heartbeat's age past which the writer
            counts as gone (:func:`stale_after`).
    """

    host: str
    pid: int
    age_s: float | None
    local: bool
    process: bool | None
    stale_after_s: float

    @property
    def alive(self) -> bool | None:
        """Whether the writer may still write: its process on this host; elsewhere, a fresh heartbeat."""
        if self.process is not None:
            return self.process
        if self.age_s is None:
            return None
        return self.age_s < self.stale_after_s


def stale_after(attrs: dict[str, Any]) -> float:
    """The heartbeat's age (s) past which a writer on another host counts as gone.

    :data:`STALE_GAPS` times the longest gap between the writer's heartbeats so far
    (``heartbeat_gap_s``: a long step, evaluation or checkpoint, a parameter server's slow
    pushes), and at least :data:`STALE_MIN_S`.
    """
    try:
        gap = float(attrs.get("heartbeat_gap_s", 0.0))
    except (TypeError, ValueError):
        gap = 0.0
    return max(STALE_MIN_S, STALE_GAPS * gap) if math.isfinite(gap) else STALE_MIN_S


def writer(attrs: dict[str, Any], path: Path, *, now: float | None = None) -> Writer | None:
    """The writer of a run file whose status is ``running`` (None for any other status).

    Args:
        attrs: the file's root attributes (``status``, and when recorded ``host``, ``pid``,
            ``pid_start``, ``heartbeat``, ``heartbeat_gap_s``).
        path: the file (its modification time stands in for a missing heartbeat).
        now: the current time (seconds since the epoch; default: now).
    """
    if str(attrs.get("status")) != RUNNING:
        return None
    written = _heartbeat(attrs.get("heartbeat"))
    if written is None:
        try:
            written = path.stat().st_mtime
        except OSError:
            written = None
    now = datetime.datetime.now(datetime.UTC).timestamp() if now is None else now
    host, pid = str(attrs.get("host", "")), int(attrs.get("pid", 0) or 0)
    local = bool(host) and pid > 0 and host == socket.gethostname()
    process = None
    if local:
        ticks = int(attrs.get("pid_start", -1))  # -1: not recorded (no /proc)
        process = process_alive(pid, started_by=written, start=ticks if ticks >= 0 else None)
    age = None if written is None else max(0.0, now - written)
    return Writer(host, pid, age, local, process, stale_after(attrs))


def run_status(attrs: dict[str, Any], path: Path, *, now: float | None = None) -> tuple[str, str | None]:
    """The status of a run file as ``report`` shows it.

    Args:
        attrs: the file's root attributes (``status``, and when recorded ``host``, ``pid``,
            ``heartbeat``).
        path: the file (its modification time stands in for a missing heartbeat).
        now: the current time (seconds since the epoch; default: now).

    Returns:
        ``(state, text)``: ``state`` is the recorded status, or ``"interrupted"`` for a
        run whose writer is known to be gone (its process, on this host); ``text`` is what
        the table shows (``"running, last written 12 min ago"`` when we cannot tell), None
        when the file has no status.
    """
    status = attrs.get("status")
    if status is None:
        return "", None
    found = writer(attrs, path, now=now)
    if found is None:
        return str(status), str(status)
    if found.process is False:
        return INTERRUPTED, INTERRUPTED
    if found.age_s is None:
        return RUNNING, RUNNING
    return RUNNING, f"{RUNNING}, last written {ago(found.age_s)} ago"


def _heartbeat(value: Any) -> float | None:
    """Seconds since the epoch of an ISO 8601 time (UTC when it names no zone), or None."""
    if value is None:
        return None
    try:
        when = datetime.datetime.fromisoformat(str(value))
    except ValueError:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.UTC)
    return when.timestamp()


def ago(seconds: float) -> str:
    """A duration as people say it: ``40 s``, ``12 min``, ``5 h``, ``3 days``."""
    seconds = max(0.0, seconds)
    if seconds < 90:
        return f"{seconds:.0f} s"
    minutes = seconds / 60
    if minutes < 120:
        return f"{minutes:.0f} min"
    hours = minutes / 60
    if hours < 48:
        return f"{hours:.0f} h"
    return f"{hours / 24:.0f} days"


def process_alive(pid: int, *, started_by: float | None = None, start: int | None = None) -> bool | None:
    """Whether process ``pid`` of this host could still be the writer of a run file.

    Args:
        pid: the writer's process id.
        started_by: the writer's last heartbeat (seconds since the epoch): a process
            started after it is another one that got the same pid.
        start: the writer's recorded start (``pid_start``: clock ticks after boot,
            :func:`start_ticks`): a process that started at another tick is another one.

    Returns:
        False when there is no such process, or it is a zombie, or (where ``/proc``
        tells) its command line names neither Python nor hpcdl, or it started at another
        time than ``start``, or after ``started_by``; True when a process that fits is
        alive; None when we cannot tell.
    """
    if pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists and belongs to another user: look closer below
    except OSError:
        return None
    proc = Path("/proc") / str(pid)
    if not Path("/proc/self").is_dir():
        return True  # no /proc (macOS): alive is all we know
    try:
        stat = (proc / "stat").read_text()
        cmdline = (proc / "cmdline").read_bytes()
    except FileNotFoundError:
        return False  # it ended meanwhile
    except OSError:
        return True
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state is field 3 of stat(5)
    if fields and fields[0] in ("Z", "X", "x"):
        return False  # ended, not yet reaped
    words = cmdline.replace(b"\0", b" ").decode(errors="replace").lower()
    if "python" not in words and "hpcdl" not in words:
        return False  # the pid was reused by another program
    ticks = _start_ticks(fields)
    if start is not None and ticks is not None:
        return ticks == start  # the same process, exactly, or one that got its pid later
    if started_by is not None:
        begun = _process_start(ticks)
        if begun is not None and begun > started_by + _SLACK_S:
            return False  # a later process with the same pid
    return True


def start_ticks(pid: int | None = None) -> int | None:
    """When process ``pid`` (default: this one) started, in clock ticks after the host's boot.

    Field 22 of ``/proc/PID/stat``: with the pid, it names one process of the host's
    uptime (a later process that gets the same pid starts at another tick). None without
    ``/proc``.
    """
    try:
        stat = (Path("/proc") / str(os.getpid() if pid is None else pid) / "stat").read_text()
    except OSError:
        return None
    return _start_ticks(stat[stat.rindex(")") + 2 :].split())


def _start_ticks(fields: list[str]) -> int | None:
    """The start of a process in clock ticks after boot, from its ``/proc/PID/stat`` fields after the name."""
    try:
        return int(fields[19])  # field 22 of stat(5)
    except (IndexError, ValueError):
        return None


def _process_start(ticks: int | None) -> float | None:
    """A process's start in seconds since the epoch, from its start in clock ticks after boot."""
    if ticks is None:
        return None
    try:
        boot = next(
            float(line.split()[1])
            for line in Path("/proc/stat").read_text().splitlines()
            if line.startswith("btime")
        )
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (ValueError, OSError, StopIteration):
        return None
