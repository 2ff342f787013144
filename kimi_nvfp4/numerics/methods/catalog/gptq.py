"""`gptq`: GPTQ against the INT4 model's outputs, with each expert's input Hessian; act-diag where it has none.

Starting from int4-aware's tensor scale, the input columns are quantized in order, 16-column blocks sharing a
scale chosen from the block's error-updated weights, and each column's error is pushed onto the columns not yet
quantized through the Cholesky factor of the dampened inverse Hessian (`output_aware/gptq_solver.py`), batched
over experts. H is first pulled toward its diagonal as far as its own sampling noise says
(`ExpertInputStats.hessian_shrinkage`, Ledoit-Wolf with a diagonal target): with few tokens per input channel a
raw H makes GPTQ fit the calibration rows' noise (measured: bench/bench_output_aware.py --token-sweep). Experts whose statistics fall back to a diagonal (too few tokens, `output_aware/refine.py`) get
act-diag. The driver keeps int4-aware's result for any matrix whose `tr((W - Q) H (W - Q)^T)` would not be
smaller. CPU is the reference; GPU results can differ in rare codes (BLAS summation order).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...e2m1 import pack_e2m1
from ...nvfp4 import NVFP4Tensor
from ..output_aware.gptq_solver import gptq_quantize
from ..output_aware.refine import RefineInput
from ..registry import ScaleMethodSpec, StatisticsNeed
from .act_diag import refine_diagonal
from .int4_aware import INT4_AWARE_SEARCH


def _shrunk_hessian(item: RefineInput) -> torch.Tensor:
    """H pulled toward its diagonal by the statistics' own noise estimate (`ExpertInputStats.hessian_shrinkage`)."""
    hessian = item.stats.hessian
    weight = item.stats.hessian_shrinkage()
    if weight == 0.0:
        return hessian
    return (1.0 - weight) * hessian + weight * torch.diag(hessian.diagonal())


def refine_dense(items: Sequence[RefineInput]) -> list[list[NVFP4Tensor]]:
    """GPTQ for the items with a dense Hessian (one batch: same shapes), act-diag for the others."""
    out: list[list[NVFP4Tensor] | None] = [None] * len(items)
    dense = [i for i, item in enumerate(items) if item.stats.hessian is not None]
    diagonal = [i for i in range(len(items)) if i not in dense]
    for i, result in zip(diagonal, refine_diagonal([items[i] for i in diagonal])):
        out[i] = result
    if dense:
        batch = [items[i] for i in dense]
        weight = torch.stack([torch.cat([m.values() for m in item.matrices]).double() for item in batch])
        hessian = torch.stack([_shrunk_hessian(item) for item in batch])
        scale_2 = torch.stack([item.search[0].weight_scale_2 for item in batch])
        search_bits = torch.stack([torch.cat([q.weight_scale.view(torch.uint8) for q in item.search]) for item in batch])
        codes, bits, _ = gptq_quantize(weight, hessian, scale_2, search_bits)
        for e, (i, item) in enumerate(zip(dense, batch)):
            tensors, start = [], 0
            for m in item.matrices:
                rows = slice(start, start + m.shape[0])
                tensors.append(NVFP4Tensor(pack_e2m1(codes[e, rows]), bits[e, rows].view(torch.float8_e4m3fn), scale_2[e]))
                start += m.shape[0]
            out[i] = tensors
    return out


METHOD = ScaleMethodSpec(
    name="gptq",
    description=(
        "int4-aware's tensor scale, then GPTQ against the INT4 weights with each expert's calibration input Hessian "
        "(columns in order, errors pushed onto later columns, NVFP4 block scales chosen on the updated weights); "
        "act-diag where an expert saw too few tokens; never worse than int4-aware on the weighted output error."
    ),
    search=INT4_AWARE_SEARCH,
    statistics=StatisticsNeed.HESSIAN,
    refine=refine_dense,
)
