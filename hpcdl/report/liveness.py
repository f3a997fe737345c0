"""Whether a run file marked ``running`` is still being written, from its writer's host, pid and heartbeat.

The training command records, as root attributes of the run file, rank 0's ``host``
(``socket.gethostname()``), ``pid`` and a ``heartbeat`` (ISO 8601, UTC) that every flush
renews while ``status == "running"``. A run killed with SIGKILL, a second Ctrl-C or a
dead rank never gets to set another status. On the writer's host we can tell: when its
process is gone (or the pid now belongs to another program, or to a process started
after the last heartbeat) the run was **interrupted**. Elsewhere, or for files written
before these attributes existed, we say how long ago the file was last written.
"""

from __future__ import annotations

import datetime
import os
import socket
from pathlib import Path
from typing import Any

__all__ = ["RUNNING", "INTERRUPTED", "run_status", "process_alive", "ago"]

RUNNING = "running"
INTERRUPTED = "interrupted"

#: seconds of tolerance when comparing a process's start with the heartbeat (whole seconds
#: in the file; the boot time in /proc/stat is whole seconds too)
_SLACK_S = 2.0


def run_status(attrs: dict[str, Any], path: Path, *, now: float | None = None) -> tuple[str, str | None]:
    """The status of a run file as ``report`` shows it.

    Args:
        attrs: the file's root attributes (``status``, and when recorded ``host``, ``pid``,
            ``heartbeat``).
        path: the file (its modification time stands in for a missing heartbeat).
        now: the current time (seconds since the epoch; default: now).

    Returns:
        ``(state, text)``: ``state`` is the recorded status, or ``"interrupted"`` for a
        run whose writer is known to be gone; ``text`` is what the table shows
        (``"running, last written 12 min ago"`` when we cannot tell), None when the
        file has no status.
    """
    status = attrs.get("status")
    if status is None:
        return "", None
    status = str(status)
    if status != RUNNING:
        return status, status
    written = _heartbeat(attrs.get("heartbeat"))
    if written is None:
        try:
            written = path.stat().st_mtime
        except OSError:
            written = None
    host, pid = attrs.get("host"), attrs.get("pid")
    if host is not None and pid is not None and str(host) == socket.gethostname():
        if process_alive(int(pid), started_by=written) is False:
            return INTERRUPTED, INTERRUPTED
    if written is None:
        return RUNNING, RUNNING
    now = datetime.datetime.now(datetime.UTC).timestamp() if now is None else now
    return RUNNING, f"{RUNNING}, last written {ago(now - written)} ago"


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


def process_alive(pid: int, *, started_by: float | None = None) -> bool | None:
    """Whether process ``pid`` of this host could still be the writer of a run file.

    Args:
        pid: the writer's process id.
        started_by: the writer's last heartbeat (seconds since the epoch): a process
            started after it is another one that got the same pid.

    Returns:
        False when there is no such process, or it is a zombie, or (where ``/proc``
        tells) its command line names neither Python nor hpcdl, or it started after
        ``started_by``; True when a process that fits is alive; None when we cannot tell.
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
    if started_by is not None:
        start = _process_start(fields)
        if start is not None and start > started_by + _SLACK_S:
            return False  # a later process with the same pid
    return True


def _process_start(fields: list[str]) -> float | None:
    """A process's start in seconds since the epoch, from its ``/proc/PID/stat`` fields after the name."""
    try:
        ticks = int(fields[19])  # field 22 of stat(5): start time in clock ticks after boot
        boot = next(
            float(line.split()[1])
            for line in Path("/proc/stat").read_text().splitlines()
            if line.startswith("btime")
        )
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (IndexError, ValueError, OSError, StopIteration):
        return None
