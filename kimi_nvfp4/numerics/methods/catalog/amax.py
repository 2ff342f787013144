"""`amax`: Model Optimizer's rule, bit-identical to `NVFP4QTensor.quantize` on the exact INT4 values.

Tensor scale amax / (6 * 448); block scale e4m3(block_amax / (6 * weight_scale_2)), an all-zero block 1.0.
"""

from __future__ import annotations

from ..registry import ScaleMethodSpec
from ..search.group import BlockSearch

PLUGIN = ScaleMethodSpec(
    name="amax",
    description="Model Optimizer's rule, block scale `amax(block) / 6` rounded to E4M3 (bit-exact with NVFP4QTensor).",
    search=BlockSearch(candidates=None),
)
