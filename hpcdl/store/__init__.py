"""What a run leaves behind: the HDF5 run file and its checkpoints."""

from __future__ import annotations

from hpcdl.store.runfile import FORMAT_VERSION, METRICS, RANK_SERIES, TRACE_FIELDS, RunFile, RunFileError

__all__ = ["FORMAT_VERSION", "METRICS", "RANK_SERIES", "TRACE_FIELDS", "RunFile", "RunFileError"]
