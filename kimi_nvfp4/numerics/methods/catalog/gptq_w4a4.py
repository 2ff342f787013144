"""`gptq-w4a4`: GPTQ for the layer SGLang serves, whose inputs are NVFP4-quantized too (GPTAQ-style).

`gptq` minimises `E||W x - Q x||^2`, the W4A16 error. SGLang's modelopt_fp4 path multiplies Q by x~, the input
fake-quantized per 16 values with the layer's static input scale, so what is served has the error
`E||W x - Q x~||^2 = ||Q - W'||^2_H~ + const` with `H~ = E[x~ x~^T]`, `C = E[x x~^T]` and the target
`W' = W C H~^-1` (`output_aware/served_target.py`: the Wiener filter, which shrinks the weights of channels that
activation quantization swamps with noise). So: int4-aware's tensor scale, then `output_aware/gptq_solver.py`
with Hessian H~ on target W'. W is the exact INT4 matrix (never BF16); H~ and C come from calibrate
`--expert-stats w4a4`, taken in calibrate's W4A4 pass with the scales it just chose (docs/requantize.md).

Noise: H~ and C are pulled toward their diagonals by the shrinkage `ExpertInputStats.hessian_shrinkage` estimates
for H of the same rows (x~ is x plus a bounded rounding error, so their sampling noise is of the same size);
with the diagonals alone (an expert that saw too few tokens for a dense H, `output_aware/refine.py`) the target is
`W[:, j] * C_jj / H~_jj` and the solver runs with the diagonal H~ (no error propagation: each block's scale is
the one with the least H~-weighted error to W'). The driver keeps int4-aware's result for any matrix whose
expected W4A4 error `E||W x - Q x~||^2` under the calibration statistics would not be smaller
(`output_aware/output_error.py`). CPU is the reference; GPU results can differ in rare codes (BLAS order).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...e2m1 import pack_e2m1
from ...nvfp4 import NVFP4Tensor
from ..output_aware.gptq_solver import gptq_quantize
from ..output_aware.refine import RefineInput
from ..output_aware.served_target import served_target
from ..registry import ExecutionPath, ScaleMethodSpec, StatisticsNeed
from .gptq import GptqOptions
from .int4_aware import INT4_AWARE_SEARCH


def _toward_diagonal(matrix: torch.Tensor, weight: float) -> torch.Tensor:
    if weight == 0.0:
        return matrix
    return (1.0 - weight) * matrix + weight * torch.diag(matrix.diagonal())


def served_moments(item: RefineInput, options: GptqOptions | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(H~, C) `[in, in]` float64 for one expert: shrunk dense moments, or the diagonal ones as matrices."""
    quantized = item.stats.quantized
    if quantized is None:
        raise ValueError("gptq-w4a4 needs statistics of the quantized inputs (calibrate --expert-stats w4a4)")
    if quantized.hessian is None:
        return torch.diag(quantized.energy), torch.diag(quantized.cross_energy)
    weight = (options or GptqOptions()).shrinkage(item)
    return _toward_diagonal(quantized.hessian, weight), _toward_diagonal(quantized.cross, weight)


def refine_served(
    items: Sequence[RefineInput], options: GptqOptions | None = None, *, dense_target: bool = True
) -> list[list[NVFP4Tensor]]:
    """GPTQ on `W C H~^-1` with Hessian H~ for one batch of experts (same shapes; dense or diagonal statistics).

    :param dense_target: the Wiener target from the dense C and H~ (True), or from their diagonals only, each
        column's own gain `(C_jj + d) / (H~_jj + d)`, the solver still running on the dense H~ (`gptq-w4a4-diag`).
    """
    if not items:
        return []
    options = options or GptqOptions()
    weight = torch.stack([torch.cat([m.values() for m in item.matrices]).double() for item in items])
    moments = [served_moments(item, options) for item in items]
    hessian = torch.stack([h for h, _ in moments]).to(weight.device)
    cross = torch.stack([c for _, c in moments]).to(weight.device)
    damping = dict(damping=options.damping, retries=options.damping_retries, growth=options.damping_growth)
    if dense_target:
        target = served_target(weight, cross, hessian, **damping)
    else:
        def diagonal(t):
            return torch.diag_embed(t.diagonal(dim1=-2, dim2=-1))

        target = served_target(weight, diagonal(cross), diagonal(hessian), **damping)
    scale_2 = torch.stack([item.search[0].weight_scale_2 for item in items])
    search_bits = torch.stack([torch.cat([q.weight_scale.view(torch.uint8) for q in item.search]) for item in items])
    codes, bits, _ = gptq_quantize(target, hessian, scale_2, search_bits, **options.solver_keywords())
    out = []
    for e, item in enumerate(items):
        tensors, start = [], 0
        for m in item.matrices:
            rows = slice(start, start + m.shape[0])
            block_scales = bits[e, rows].view(torch.float8_e4m3fn)
            tensors.append(NVFP4Tensor(pack_e2m1(codes[e, rows]), block_scales, scale_2[e]))
            start += m.shape[0]
        out.append(tensors)
    return out


PLUGIN = ScaleMethodSpec(
    name="gptq-w4a4",
    description=(
        "int4-aware's tensor scale, then GPTQ for the served W4A4 layer: Hessian E[x~x~ᵀ] of the NVFP4-quantized "
        "calibration inputs and target W·E[x x~ᵀ]·E[x~x~ᵀ]⁻¹ (the INT4 weights' Wiener filter for quantized "
        "inputs); never worse than int4-aware on the expected W4A4 output error. Experimental: measured worse "
        "than gptq in W4A4 KL on the demo model (the correction fits the calibration tokens; docs/benchmarks.md "
        "§13.3)."
    ),
    search=INT4_AWARE_SEARCH,
    statistics=StatisticsNeed.W4A4_HESSIAN,
    refine=refine_served,
    options_model=GptqOptions,
    paths=(ExecutionPath.CPU_REFERENCE, ExecutionPath.TORCH_CUDA, ExecutionPath.TRITON),
)
