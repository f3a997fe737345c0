"""User-facing errors: each carries one line naming the problem and the fix."""

from __future__ import annotations


class HpcdlError(Exception):
    """An error caused by the user's input (config, data, rank count, files).

    Commands print ``str(err)`` as one line and exit with status 2, without a
    traceback: the message must name the problem and how to fix it.
    """


class ConfigError(HpcdlError, ValueError):
    """A config key is unknown, has the wrong type, or an invalid value."""


class DataError(HpcdlError, ValueError):
    """A data file is missing, truncated or malformed, or does not fit the run."""
