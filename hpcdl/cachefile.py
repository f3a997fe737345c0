"""Per-machine caches: JSON files of entries by key under ``$XDG_CACHE_HOME/hpcdl``, shared by jobs.

Two caches are written this way: ``auto``'s allreduce timings
(:mod:`hpcdl.comm.collectives.tune`, ``auto-tables.json``) and the convolution products'
timings (:mod:`hpcdl.driver.convplan`, ``conv-times.json``). A file is ``{"format": F,
"entries": {key: entry}}``; jobs that time on one machine at once read, change one entry and
replace the file while holding an ``flock`` on ``<file>.lock``, so that none loses another's
entry (a file system without ``flock``, such as Lustre mounted without ``-o flock``, is written
unlocked), and the file is replaced atomically, never seen half written.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from hpcdl.atomic import write_text_atomic

__all__ = ["cache_dir", "entry_key", "locked", "read_entries", "update_entry"]


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/hpcdl`` (``~/.cache/hpcdl`` when the variable is unset or empty)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hpcdl"


def entry_key(fields: Mapping[str, Any]) -> str:
    """An entry's key from what it was measured under: ``cpu=... | blas=... | ...``, in order."""
    return " | ".join(f"{k}={v}" for k, v in fields.items())


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``<path>.lock`` for the ``with`` block (none where the file
    system has no ``flock``: ENOSYS, ENOLCK, EOPNOTSUPP, EINVAL).

    Raises:
        OSError: the lock file cannot be created.
    """
    import fcntl  # noqa: PLC0415 - POSIX only, read where a cache is written

    with open(path.with_name(path.name + ".lock"), "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when closed
        except OSError as err:
            if err.errno not in (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
                raise
        yield


def read_entries(path: Path, fmt: int, kind: str) -> tuple[dict[str, Any], str]:
    """The entries of the cache file ``path``, and why it was not usable ("" if it was, or is absent).

    Args:
        path: the file.
        fmt: the layout version this hpcdl writes; another is not read.
        kind: what the file is, for the reason (``"an auto cache"``).
    """
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}, ""
    except (OSError, UnicodeDecodeError) as err:
        return {}, f"cannot be read: {getattr(err, 'strerror', None) or err}"
    except json.JSONDecodeError as err:
        return {}, f"not JSON: {err.msg}, line {err.lineno}"
    if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
        return {}, f'not {kind}: no "entries" object'
    if data.get("format") != fmt:
        return {}, f"format {data.get('format')!r}, this hpcdl writes {fmt}"
    return data["entries"], ""


def update_entry(
    path: Path, key: str, update: Callable[[Any], dict[str, Any]], fmt: int, *, what: str
) -> None:
    """Replace the entry ``key`` of the cache file ``path`` by ``update(old entry or None)``, the
    other entries kept (an unreadable file is started afresh), under :func:`locked`.

    Raises:
        OSError: the directory or the lock file cannot be made.
        FileError: the file cannot be written (the old one is kept).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with locked(path):
        entries, _ = read_entries(path, fmt, what)
        entries[key] = update(entries.get(key))
        text = json.dumps({"format": fmt, "entries": entries}, indent=1, sort_keys=True)
        write_text_atomic(path, text + "\n", what=what)
