"""User-facing errors: each carries one line naming the problem and the fix."""

from __future__ import annotations

import errno as _errno
import os
import re

__all__ = ["HpcdlError", "ConfigError", "DataError", "FileError", "file_error", "os_reason"]


class HpcdlError(Exception):
    """An error caused by the user's input (config, data, rank count, files).

    Commands print ``str(err)`` as one line and exit with status 2, without a
    traceback: the message must name the problem and how to fix it.
    """

    #: the exit status of a command that ends with this error
    exit_status: int = 2


class ConfigError(HpcdlError, ValueError):
    """A config key is unknown, has the wrong type, or an invalid value."""


class DataError(HpcdlError, ValueError):
    """A data file is missing, truncated or malformed, or does not fit the run."""


class FileError(HpcdlError):
    """A file or directory cannot be created, written or read (permissions, full disk, ...)."""


class NodeMemoryError(HpcdlError):
    """The memory the ranks of a node share (``/dev/shm`` under MPI) cannot hold what was asked for."""


# h5py reports the C library's errno inside its message text:
# "Unable to synchronously create file (unable to open file: name = 'x', errno = 13,
#  error message = 'Permission denied', flags = 15, o_flags = c2)"
_H5_ERRNO = re.compile(r"errno = (\d+)")

#: what to do about a failure, by errno
_FIXES = {
    _errno.EACCES: "choose a writable place or fix the permissions",
    _errno.EPERM: "choose a writable place or fix the permissions",
    _errno.EROFS: "the file system is read-only: choose another place",
    _errno.ENOSPC: "free space on that file system or write elsewhere",
    _errno.EDQUOT: "free space in your quota or write elsewhere",
    _errno.EFBIG: "the file size limit (ulimit -f) was reached: raise it or write elsewhere",
    _errno.ENOTDIR: "a component of the path is a file, not a directory: choose another path",
    _errno.ENOENT: "the directory does not exist: create it or choose another path",
    _errno.EISDIR: "the path is a directory: give a file name",
    _errno.EEXIST: "it exists already: choose another name",
    _errno.ENAMETOOLONG: "choose a shorter path",
}


def _errno_of(err: OSError) -> int | None:
    if err.errno is not None:
        return err.errno
    found = _H5_ERRNO.search(str(err))
    return int(found.group(1)) if found else None


def os_reason(err: OSError) -> str:
    """The short reason of an ``OSError`` (``os.strerror`` text), also for h5py's long messages.

    HDF5's file-locking failure (``unable to lock file``) names the usual fix.
    """
    text = str(err)
    if "unable to lock file" in text:
        return "the file is locked (another process, or a file system without locks)"
    code = _errno_of(err)
    if code is not None and code > 0:
        return os.strerror(code)
    return err.strerror or text.split("(", maxsplit=1)[0].strip() or type(err).__name__


def file_error(
    path: str | os.PathLike[str] | None,
    err: OSError,
    *,
    what: str = "file",
    verb: str = "write",
    fix: str = "",
) -> FileError:
    """One line for a failed file-system operation: what, where, why, and what to do.

    Args:
        path: the file or directory (``err.filename`` when None).
        err: the ``OSError`` (h5py's included: its errno is read from the message).
        what: what the file is, e.g. ``"run file"``, ``"the JSON rows"``.
        verb: ``write``, ``create``, ``read``, ``open``.
        fix: what to do; by default a fix chosen from the errno.

    Returns:
        A :class:`FileError` to raise (``raise file_error(...) from None``).
    """
    where = path if path is not None else (err.filename or "?")
    if "unable to lock file" in str(err):
        return FileError(
            f"cannot {verb} {what} {where}: the file is locked by another process (a run writing it, or "
            "a program that has it open), or the file system does not support locks: then set "
            "HDF5_USE_FILE_LOCKING=FALSE, which leaves hpcdl's check of a run's writer (its host, pid "
            "and heartbeat) as the only guard against two jobs writing one run"
        )
    code = _errno_of(err)
    reason = os_reason(err)
    fix = fix or _FIXES.get(code or 0, "check the path and its file system")
    return FileError(f"cannot {verb} {what} {where}: {reason}; {fix}")
