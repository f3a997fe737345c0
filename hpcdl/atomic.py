"""Small text files written atomically: a temporary file beside the target, then a rename."""

from __future__ import annotations

import os
from pathlib import Path

from hpcdl.errors import ConfigError

__all__ = ["write_text_atomic"]


def write_text_atomic(path: str | os.PathLike[str], text: str, *, what: str, fix: str) -> None:
    """Write ``text`` to ``path`` so that readers see the old file or the whole new one.

    Args:
        path: the file.
        text: its new contents (UTF-8).
        what: what the file is, for the error (e.g. ``"the auto table"``).
        fix: what to do about a failure (e.g. ``"give a --table path in a writable directory"``).

    Raises:
        ConfigError: the file cannot be written (nothing is left behind).
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise ConfigError(f"cannot write {what} {path} ({err.strerror or err}): {fix}") from None
