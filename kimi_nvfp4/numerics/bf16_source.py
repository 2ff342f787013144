"""NVFP4 from a BF16 source weight (the shared experts, `convert --shared-experts nvfp4`).

The INT4 methods (numerics/methods) aim at reproducing INT4 values; a BF16 weight has no such grid, so this
module quantizes it the way Model Optimizer does (`NVFP4QTensor.quantize`, via `quantize_nvfp4`), with one
twist of the format: the matrices of a scale group share one `weight_scale_2` (the max of their amaxes).
A shared expert's gate_proj and up_proj form one group because SGLang loads them as one fused w13 linear
with a single per-tensor scale (modelopt_quant.py `ModelOptFp4LinearMethod.process_weights_after_loading`
keeps `weight_scale_2.max()` of the fused shards without requantizing), down_proj is a group of its own.

Two block-scale rules:
- `amax` (default): Model Optimizer's `clamp(block_amax / (6 * weight_scale_2))` cast to E4M3; bit-exact with
  `NVFP4QTensor` for a lone matrix.
- `mse`: per 16-element block, the E4M3 scale among the amax rule's and its neighbours in the E4M3 code
  order (`MSE_STEPS_BELOW` smaller, `MSE_STEPS_ABOVE` larger) with the least squared error against the
  source; the amax scale is kept unless another is strictly better, so its weight MSE is never worse.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum

import torch

from .e2m1 import decode_e2m1
from .nvfp4 import (
    NVFP4Tensor,
    amax_block_scales,
    dequantize_nvfp4,
    encode_with_block_scales,
    quantize_nvfp4,
    tensor_scale_from_amax,
)
from .constants import NVFP4_BLOCK_SIZE

__all__ = ["Bf16ScaleRule", "group_tensor_scale", "mse_block_scales", "quantize_bf16_group", "weight_mse"]

# E4M3 codes 0x01..0x7E are the positive finite values in increasing order (0x7F is NaN in float8_e4m3fn);
# stepping the code by one moves to the neighbouring representable scale.
_E4M3_SMALLEST_POSITIVE_CODE = 0x01
_E4M3_LARGEST_FINITE_CODE = 0x7E
# The search window around the amax scale, in E4M3 steps. Smaller scales trade clipping the block's largest
# value for finer steps on the rest (8 steps is about a factor 2 with 3 mantissa bits); a larger scale
# rarely helps (it only moves the block's max onto a coarser grid point), so two steps suffice.
MSE_STEPS_BELOW = 8
MSE_STEPS_ABOVE = 2


class Bf16ScaleRule(str, Enum):
    """How block scales are chosen for a BF16 source weight."""

    AMAX = "amax"  # Model Optimizer's rule (bit-exact with NVFP4QTensor)
    MSE = "mse"  # least squared error among the amax scale and its E4M3 neighbours


def _as_fp32(w: torch.Tensor) -> torch.Tensor:
    if w.ndim != 2 or not w.dtype.is_floating_point:
        raise ValueError(f"expected a 2-d floating-point weight, got {w.dtype} {tuple(w.shape)}")
    return w.to(torch.float32)


def group_tensor_scale(weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """One weight_scale_2 for a group of matrices: amax over all of them / (6 * 448), float32 0-d."""
    if not weights:
        raise ValueError("a scale group needs at least one matrix")
    amax = torch.stack([w.abs().amax().to(torch.float32) if w.numel() else torch.zeros(()) for w in weights]).amax()
    return tensor_scale_from_amax(amax)


def _block_errors(w: torch.Tensor, block_scale: torch.Tensor, weight_scale_2: torch.Tensor) -> torch.Tensor:
    """Sum of squared errors per block `[out, in/16]` of `w` quantized with these scales."""
    codes = encode_with_block_scales(w, block_scale, weight_scale_2)
    scale = block_scale.to(torch.float32) * weight_scale_2
    blocks = decode_e2m1(codes).reshape(w.shape[0], -1, NVFP4_BLOCK_SIZE) * scale.unsqueeze(-1)
    return (blocks - w.reshape(blocks.shape)).square().sum(dim=-1)


def mse_block_scales(w: torch.Tensor, weight_scale_2: torch.Tensor) -> torch.Tensor:
    """Per block, the E4M3 scale near the amax rule's with the least squared error (float8_e4m3fn `[out, in/16]`).

    Ties keep the amax rule's scale, so the result is never worse than `amax_block_scales` in weight MSE.
    """
    best = amax_block_scales(w, weight_scale_2)
    best_error = _block_errors(w, best, weight_scale_2)
    base = best.view(torch.uint8).to(torch.int16)
    for step in [*range(-MSE_STEPS_BELOW, 0), *range(1, MSE_STEPS_ABOVE + 1)]:
        code = (base + step).clamp(_E4M3_SMALLEST_POSITIVE_CODE, _E4M3_LARGEST_FINITE_CODE)
        candidate = code.to(torch.uint8).view(torch.float8_e4m3fn)
        error = _block_errors(w, candidate, weight_scale_2)
        better = error < best_error
        best = torch.where(better, candidate.view(torch.uint8), best.view(torch.uint8)).view(torch.float8_e4m3fn)
        best_error = torch.where(better, error, best_error)
    return best


def quantize_bf16_group(
    weights: Sequence[torch.Tensor], rule: Bf16ScaleRule | str = Bf16ScaleRule.AMAX
) -> list[NVFP4Tensor]:
    """Quantize the matrices of one scale group (BF16 or float32 `[out, in]`, in % 16 == 0) to NVFP4.

    :param weights: the group's matrices (a shared expert's gate_proj and up_proj, or its down_proj alone).
    :param rule: block-scale rule (`Bf16ScaleRule`).
    :returns: one `NVFP4Tensor` per matrix, in order, all with the same `weight_scale_2`. A lone matrix with
        the amax rule gives exactly `NVFP4QTensor.quantize(w.float(), 16)`'s bytes.
    """
    rule = Bf16ScaleRule(rule)
    w32 = [_as_fp32(w) for w in weights]
    scale_2 = group_tensor_scale(w32)
    out = []
    for w in w32:
        scale_2_here = scale_2.to(w.device)
        block = mse_block_scales(w, scale_2_here) if rule is Bf16ScaleRule.MSE else None
        out.append(quantize_nvfp4(w, scale_2_here, block))
    return out


def weight_mse(w: torch.Tensor, q: NVFP4Tensor) -> float:
    """Mean squared error of `q` dequantized against `w` (float64 sum)."""
    return (dequantize_nvfp4(q) - _as_fp32(w)).double().square().mean().item()
