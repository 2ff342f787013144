"""Error types of the data package."""

from __future__ import annotations

from pathlib import Path

from ..errors import CheckpointError, KimiNvfp4Error


class DataError(KimiNvfp4Error):
    """A data source is missing, holds nothing usable or too many bad records, a --data spec is malformed, or the
    data does not fit the checkpoint (ids outside its vocabulary, sequences shorter than asked). Raised before any
    weights load, so nothing is lost or half-written."""

    exit_code = 9

    def __init__(self, message: str, *, file: str | Path | None = None, record: str | int | None = None):
        self.file = str(file) if file is not None else None
        self.record = record
        where = []
        if self.file:
            where.append(f"file {self.file}")
        if record is not None:
            where.append(f"record {record}")
        super().__init__((f"{', '.join(where)}: " if where else "") + message)


class UnsafePickleError(DataError):
    """A pickle names a global outside the allow-list (os.system, subprocess, torch, numpy, ...): refused, never
    imported or called."""


class TruncatedLogError(DataError):
    """A request log written at a level that cuts long text or token lists (SGLang --log-requests-level <= 2)."""


class ChatTemplateError(CheckpointError):
    """A checkpoint's chat template does not parse, fails to render, or goes past a rendering limit."""
