"""Error types of the data package."""

from __future__ import annotations

from ..errors import CheckpointError, KimiNvfp4Error


class DataError(KimiNvfp4Error):
    """A data source is missing, holds nothing usable, or a --data spec is malformed."""


class ChatTemplateError(CheckpointError):
    """A checkpoint's chat template does not parse, fails to render, or goes past a rendering limit."""
