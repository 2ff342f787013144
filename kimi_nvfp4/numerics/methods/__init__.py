"""Scale-selection methods for converting INT4 experts to NVFP4 (`convert --method`, `registry.py`).

Layout: `catalog/` holds one module per method; `search/` the weight-error block-scale search (one rule, several
execution paths, one place that picks the path); `quantize.py` the conversion API on top; `stats.py` the error
statistics against the INT4 values; `output_aware/` the machinery of the methods that use calibration statistics
of the experts' inputs, run by `requantize.py`.
"""

from .int4_matrix import Int4Matrix
from .output_aware.input_stats import ExpertInputStats, InputStatsAccumulator
from .output_aware.output_error import output_error
from .output_aware.refine import ExpertMatrices, RefinedExpert, RefineSummary, StatisticsSource
from .quantize import GroupBatch, quantize_int4_groups, quantize_int4_matrices
from .registry import (
    DEFAULT_METHOD,
    METHODS,
    ExecutionPath,
    ScaleMethod,
    ScaleMethodSpec,
    StatisticsNeed,
    method_options,
    method_spec,
    weight_only_methods,
)
from .requantize import requantize_experts
from .search.group import SearchPath
from .stats import MatrixErrorStats, error_stats, stats_from_sums

__all__ = [
    "DEFAULT_METHOD",
    "ExecutionPath",
    "METHODS",
    "ExpertInputStats",
    "ExpertMatrices",
    "GroupBatch",
    "InputStatsAccumulator",
    "Int4Matrix",
    "MatrixErrorStats",
    "RefineSummary",
    "RefinedExpert",
    "ScaleMethod",
    "ScaleMethodSpec",
    "SearchPath",
    "StatisticsNeed",
    "StatisticsSource",
    "error_stats",
    "method_options",
    "method_spec",
    "output_error",
    "quantize_int4_groups",
    "quantize_int4_matrices",
    "requantize_experts",
    "stats_from_sums",
    "weight_only_methods",
]
