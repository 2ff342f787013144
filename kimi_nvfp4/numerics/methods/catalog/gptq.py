"""`gptq`: GPTQ against the INT4 model's outputs, with each expert's input Hessian; act-diag where it has none.

Starting from int4-aware's tensor scale, the input columns are quantized in order, 16-column blocks sharing a
scale chosen from the block's error-updated weights, and each column's error is pushed onto the columns not yet
quantized through the Cholesky factor of the dampened inverse Hessian (`output_aware/gptq_solver.py`), batched
over experts. H is first pulled toward its diagonal as far as its own sampling noise says
(`ExpertInputStats.hessian_shrinkage`, Ledoit-Wolf with a diagonal target, times `shrinkage_scale`): with few tokens per input channel a
raw H makes GPTQ fit the calibration rows' noise (measured: bench/quality/output_aware.py --token-sweep). Experts whose statistics fall back to a diagonal (too few tokens, `output_aware/refine.py`) get
act-diag. Options (off by default): `pool_tokens` blends a gate/up H with the layer's all-token H, `block_order`
quantizes whole 16-column blocks by decreasing input energy (docs/numerics.md, measured there). The driver keeps int4-aware's result for any matrix whose `tr((W - Q) H (W - Q)^T)` would not be
smaller. CPU is the reference; GPU results can differ in rare codes (BLAS summation order).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from pydantic import Field, field_validator, model_validator

from ...constants import NVFP4_BLOCK_SIZE
from ...e2m1 import pack_e2m1
from ...nvfp4 import NVFP4Tensor
from ..output_aware import gptq_solver
from ..output_aware.refine import RefineInput
from ..registry import ExecutionPath, ScaleMethodSpec, StatisticsNeed
from .act_diag import ActDiagOptions, refine_diagonal
from .int4_aware import INT4_AWARE_SEARCH


class GptqOptions(ActDiagOptions):
    """gptq's options (and gptq-w4a4's): the solver's statistics levers and its batching; act-diag's for the
    experts that fall back to it. Defaults are the solver's constants (output_aware/gptq_solver.py)."""

    damping: float = Field(gptq_solver.HESSIAN_DAMPING, gt=0,
                           description="H + damping * mean(diag H) * I (GPTQ's percdamp)")
    damping_retries: int = Field(gptq_solver.DAMPING_RETRIES, ge=0,
                                 description="retries of a failed Cholesky factorisation, the damping grown each time")
    damping_growth: float = Field(gptq_solver.DAMPING_GROWTH, gt=1, description="damping multiplier per retry")
    shrinkage_scale: float = Field(1.0, ge=0, description="multiplies the Ledoit-Wolf weight pulling H toward its "
                                                          "diagonal (capped at 1)")
    block_columns: int = Field(gptq_solver.BLOCK_COLUMNS, ge=NVFP4_BLOCK_SIZE,
                               description="columns per lazy batch update (a multiple of 16)")
    scale_window: tuple[int, int] = Field(gptq_solver.SCALE_WINDOW, description="lowest,highest E4M3 bit offset "
                                                                                "tried around a block's amax/6 scale")
    fused_kernel: bool = Field(True, description="on CUDA, a block's scale choice and 16 column steps as one Triton "
                                                 "kernel (same bits)")
    pool_tokens: float = Field(0.0, ge=0, description="gate/up: an expert's (shrunk) H blended with the layer's "
                                                      "all-token H as (n H + k H_pool) / (n + k), k this many "
                                                      "tokens (0: the expert's own H; gptq only)")
    block_order: bool = Field(False, description="quantize each expert's 16-column blocks by decreasing input "
                                                 "energy (act-order with the NVFP4 scale groups kept whole)")

    @field_validator("scale_window", mode="before")
    @classmethod
    def _pair(cls, value: Any) -> Any:
        """`"-3,7"` (a --method-option value) as the pair (-3, 7)."""
        return tuple(part.strip() for part in value.split(",")) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _shapes(self) -> GptqOptions:
        if self.block_columns % NVFP4_BLOCK_SIZE:
            raise ValueError(f"block_columns {self.block_columns} is not a multiple of {NVFP4_BLOCK_SIZE}")
        if self.scale_window[0] > self.scale_window[1]:
            raise ValueError(f"scale_window {self.scale_window}: lowest above highest")
        return self

    def solver_keywords(self) -> dict[str, Any]:
        """The keywords of `gptq_solver.gptq_quantize` these options set."""
        return dict(block_columns=self.block_columns, damping=self.damping, retries=self.damping_retries,
                    growth=self.damping_growth, scale_window=self.scale_window, fused=self.fused_kernel,
                    block_order=self.block_order)

    def shrinkage(self, item: RefineInput) -> float:
        """The weight of diag(H) in the shrunk H: the statistics' own estimate times `shrinkage_scale`, at most 1."""
        return min(1.0, self.shrinkage_scale * item.stats.hessian_shrinkage())


def _toward_diagonal(hessian: torch.Tensor, weight: float) -> torch.Tensor:
    if weight == 0.0:
        return hessian
    return (1.0 - weight) * hessian + weight * torch.diag(hessian.diagonal())


def _shrunk_hessian(item: RefineInput, options: GptqOptions | None = None) -> torch.Tensor:
    """H pulled toward its diagonal by the statistics' own noise estimate (`ExpertInputStats.hessian_shrinkage`);
    with `pool_tokens` k > 0 and the layer's all-token statistics at hand (gate/up), blended with their H (shrunk
    the same way) as `(n H + k H_pool) / (n + k)`, n the expert's tokens: a prior worth k tokens."""
    options = options or GptqOptions()
    hessian = _toward_diagonal(item.stats.hessian, options.shrinkage(item))
    shared = item.shared
    if options.pool_tokens == 0 or shared is None or shared.hessian is None:
        return hessian
    pool = _toward_diagonal(shared.hessian, min(1.0, options.shrinkage_scale * shared.hessian_shrinkage()))
    tokens, k = item.stats.tokens, options.pool_tokens
    return (tokens * hessian + k * pool.to(hessian.device)) / (tokens + k)


def refine_dense(items: Sequence[RefineInput], options: GptqOptions | None = None) -> list[list[NVFP4Tensor]]:
    """GPTQ for the items with a dense Hessian (one batch: same shapes), act-diag for the others."""
    options = options or GptqOptions()
    out: list[list[NVFP4Tensor] | None] = [None] * len(items)
    dense = [i for i, item in enumerate(items) if item.stats.hessian is not None]
    diagonal = [i for i in range(len(items)) if i not in dense]
    for i, result in zip(diagonal, refine_diagonal([items[i] for i in diagonal], options)):
        out[i] = result
    if dense:
        batch = [items[i] for i in dense]
        weight = torch.stack([torch.cat([m.values() for m in item.matrices]).double() for item in batch])
        hessian = torch.stack([_shrunk_hessian(item, options) for item in batch])
        scale_2 = torch.stack([item.search[0].weight_scale_2 for item in batch])
        search_bits = torch.stack([torch.cat([q.weight_scale.view(torch.uint8) for q in item.search]) for item in batch])
        codes, bits, _ = gptq_solver.gptq_quantize(weight, hessian, scale_2, search_bits, **options.solver_keywords())
        for e, (i, item) in enumerate(zip(dense, batch)):
            tensors, start = [], 0
            for m in item.matrices:
                rows = slice(start, start + m.shape[0])
                tensors.append(NVFP4Tensor(pack_e2m1(codes[e, rows]), bits[e, rows].view(torch.float8_e4m3fn), scale_2[e]))
                start += m.shape[0]
            out[i] = tensors
    return out


PLUGIN = ScaleMethodSpec(
    name="gptq",
    description=(
        "int4-aware's tensor scale, then GPTQ against the INT4 weights with each expert's calibration input Hessian "
        "(columns in order, errors pushed onto later columns, NVFP4 block scales chosen on the updated weights); "
        "act-diag where an expert saw too few tokens; never worse than int4-aware on the weighted output error."
    ),
    search=INT4_AWARE_SEARCH,
    statistics=StatisticsNeed.HESSIAN,
    refine=refine_dense,
    options_model=GptqOptions,
    # Triton: a block's scale choice and column steps (numerics/gptq_block_kernel.py), with `fused_kernel`
    paths=(ExecutionPath.CPU_REFERENCE, ExecutionPath.TORCH_CUDA, ExecutionPath.TRITON),
)
