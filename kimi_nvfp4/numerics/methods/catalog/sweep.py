"""`sweep`: all 126 positive E4M3 block scales tried per block, under int4-aware's tensor scale (the quality
reference for the weight error; int4-aware reaches ~1.006x its error at a fraction of the cost)."""

from __future__ import annotations

from ..registry import ExecutionPath, ScaleMethodSpec
from ..search.group import BlockSearch
from ..search.rule import EveryE4M3Scale
from .int4_aware import INT4_AWARE_RULE

PLUGIN = ScaleMethodSpec(
    name="sweep",
    description=(
        "per 16-value block, all 126 positive E4M3 scales tried, the one with the least error against the INT4 "
        "values kept (the quality reference)."
    ),
    search=BlockSearch(EveryE4M3Scale(), INT4_AWARE_RULE.tensor_scale_headroom),
    paths=(ExecutionPath.CPU_REFERENCE, ExecutionPath.CPU_TABLES, ExecutionPath.TORCH_CUDA),
    no_triton="the kernels hold two amax-fraction targets and an aligned one, not 126 candidates",
)
