"""The one error type of the data package."""

from __future__ import annotations

from ..errors import KimiNvfp4Error


class DataError(KimiNvfp4Error):
    """A data source is missing, holds nothing usable, or a --data spec is malformed."""
