"""What the report tests share beside the ``figures`` fixture (conftest.py): the plots it wrote."""

from __future__ import annotations

from pathlib import Path


def written_plots(out: str) -> list[str]:
    """The file names of the plots the report printed it wrote (one path a line)."""
    return sorted(Path(line).name for line in out.splitlines() if line.startswith("/"))
