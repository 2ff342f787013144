"""Scale-selection methods for converting INT4 experts to NVFP4 (`convert --method`, `registry.py`).

Layout: `catalog/` holds one module per method; `search/` the weight-error block-scale search (one rule, several
execution paths, one place that picks the path); `quantize.py` the conversion API on top; `stats.py` the error
statistics against the INT4 values.
"""

from .int4_matrix import Int4Matrix
from .quantize import GroupBatch, quantize_int4_groups, quantize_int4_matrices
from .registry import DEFAULT_METHOD, ScaleMethod, ScaleMethodSpec, StatisticsNeed, method_spec, weight_only_methods
from .search.group import SearchPath
from .stats import MatrixErrorStats, error_stats, stats_from_sums

__all__ = [
    "DEFAULT_METHOD",
    "GroupBatch",
    "Int4Matrix",
    "MatrixErrorStats",
    "ScaleMethod",
    "ScaleMethodSpec",
    "SearchPath",
    "StatisticsNeed",
    "error_stats",
    "method_spec",
    "quantize_int4_groups",
    "quantize_int4_matrices",
    "stats_from_sums",
    "weight_only_methods",
]
