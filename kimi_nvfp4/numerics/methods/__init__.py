"""Scale-selection methods for converting INT4 experts to NVFP4 (`convert --method`)."""

from .quantize import (
    DEFAULT_METHOD,
    quantize_int4_matrices,
    search_block_scales,
    shared_tensor_scale,
)
from .stats import MatrixErrorStats, error_stats
from .types import Int4Matrix, ScaleMethod

__all__ = [
    "DEFAULT_METHOD",
    "Int4Matrix",
    "MatrixErrorStats",
    "ScaleMethod",
    "error_stats",
    "quantize_int4_matrices",
    "search_block_scales",
    "shared_tensor_scale",
]
