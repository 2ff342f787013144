"""`gptq-w4a4-diag`: `gptq-w4a4` with each input channel's own Wiener gain instead of the dense Wiener filter.

`gptq-w4a4`'s target `W' = W + W (C - H~)(H~ + dI)^-1` is a regression of the activation-quantization noise on
all `in` quantized channels: `in` coefficients per output row, fitted on the expert's calibration tokens. With the
few tokens per input channel a routed expert sees (the demo: 2-5; K2.6 at 512 x 2048 calibration tokens: ~3 for
gate/up) that regression fits the calibration rows (measured on the demo: docs/benchmarks.md §13.3). This
variant keeps only the diagonal of the correction, `W'[:, j] = W[:, j] (C_jj + d) / (H~_jj + d)` (one gain per
input channel, estimated from all of the expert's tokens), and runs the same GPTQ solver with the dense H~ of
the quantized inputs. Statistics, fallback and guard are `gptq-w4a4`'s (catalog/gptq_w4a4.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from ...nvfp4 import NVFP4Tensor
from ..output_aware.refine import RefineInput
from ..registry import ExecutionPath, ScaleMethodSpec, StatisticsNeed
from .gptq import GptqOptions
from .gptq_w4a4 import refine_served
from .int4_aware import INT4_AWARE_SEARCH


def refine_served_channel_gain(
    items: Sequence[RefineInput], options: GptqOptions | None = None
) -> list[list[NVFP4Tensor]]:
    return refine_served(items, options, dense_target=False)


PLUGIN = ScaleMethodSpec(
    name="gptq-w4a4-diag",
    description=(
        "gptq-w4a4 with a per-input-channel Wiener gain E[x_j x~_j]/E[x~_j²] on the INT4 weights instead of the dense "
        "Wiener filter (fewer coefficients to fit from an expert's tokens); GPTQ with the quantized inputs' Hessian; "
        "never worse than int4-aware on the expected W4A4 output error. Experimental: measured worse than gptq "
        "in W4A4 KL on the demo model (the correction fits the calibration tokens; docs/benchmarks.md §13.3)."
    ),
    search=INT4_AWARE_SEARCH,
    statistics=StatisticsNeed.W4A4_HESSIAN,
    refine=refine_served_channel_gain,
    options_model=GptqOptions,
    paths=(ExecutionPath.CPU_REFERENCE, ExecutionPath.TORCH_CUDA, ExecutionPath.TRITON),
)
