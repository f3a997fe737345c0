"""Files written atomically (a temporary file beside the target, then a rename), and a check
that a file can be written at all, made before the work that produces it."""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from hpcdl.errors import file_error

__all__ = ["write_text_atomic", "write_atomic", "check_writable", "temporary_name"]


def temporary_name(path: Path) -> Path:
    """The temporary file beside ``path`` that :func:`write_atomic` writes first (hidden, per process)."""
    return path.with_name(f".{path.name}.tmp{os.getpid()}")


def write_atomic(
    path: str | os.PathLike[str], write: Callable[[BinaryIO], object], *, what: str, fix: str = ""
) -> None:
    """Write a file so that readers see the old file or the whole new one, never a part.

    ``write(f)`` fills a temporary file beside ``path``, which is then renamed over it.
    After a failure (permissions, a full disk, a file size limit) the temporary file is
    removed and a file already at ``path`` is left as it was.

    Args:
        path: the file.
        write: writes the contents into the binary file object it is given.
        what: what the file is, for the error (e.g. ``"the auto table"``).
        fix: what to do about a failure (default: chosen from the error, see
            :func:`hpcdl.errors.file_error`).

    Raises:
        FileError: the file cannot be written (one line naming ``path`` and the fix).
    """
    path = Path(path)
    tmp = temporary_name(path)
    try:
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except OSError as err:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise file_error(path, err, what=what, fix=fix) from None


def write_text_atomic(path: str | os.PathLike[str], text: str, *, what: str, fix: str = "") -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically, as :func:`write_atomic` does.

    Raises:
        FileError: the file cannot be written (nothing is left behind; an old file is kept).
    """
    write_atomic(path, lambda f: f.write(text.encode("utf-8")), what=what, fix=fix)


def check_writable(path: str | os.PathLike[str], *, what: str, fix: str = "") -> None:
    """Check that :func:`write_atomic` can create ``path``, before the work that produces it.

    Creates and removes the temporary file beside ``path``: permissions, a missing
    directory or a path component that is a file show now, not after a long run (a full
    disk still shows only when the file is written).

    Raises:
        FileError: ``path`` is a directory, or its directory does not let us create a file.
    """
    path = Path(path)
    if path.is_dir():
        raise file_error(path, IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR)), what=what, fix=fix)
    tmp = temporary_name(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError as err:
        raise file_error(path, err, what=what, fix=fix) from None
    os.close(fd)
    with contextlib.suppress(OSError):
        tmp.unlink()
