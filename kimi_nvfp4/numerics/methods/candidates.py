"""Candidate E4M3 block scales, as uint8 bit patterns `[C, B]` (B = blocks; order irrelevant, see select_best).

All candidates are built from fp32 arithmetic that is identical on CPU and CUDA, then cast to e4m3
(round to nearest even, clamped to [2**-9, 448]); neighbours are bit patterns +-1.
"""

from __future__ import annotations

import torch

from ..constants import E2M1_MAX
from ..e4m3 import (
    E4M3_MAX_BITS,
    E4M3_MIN_POSITIVE_BITS,
    E4M3_NUM_POSITIVE,
    e4m3_bits,
    round_block_scale_to_e4m3,
)
from ..nvfp4 import ZERO_BLOCK_SCALE

__all__ = ["INT4_AWARE_CANDIDATES", "all_positive_bits", "int4_aware_bits", "model_optimizer_bits"]

# Targets for d = E4M3 scale * weight_scale_2, each tried at its rounded E4M3 value plus the listed
# neighbour offsets (bit patterns). Measured on synthetic K2.6 experts (docs/numerics.md) these seven
# candidates reach ~1.01x the exhaustive per-block optimum (the other neighbours, 9 in all: ~1.002x).
#   block_amax / 6: Model Optimizer's amax rule (the largest |code| on E2M1 6, nothing clips); keeping it
#                   makes the method never worse than `amax` on any block under the same tensor scale.
#   block_amax / 4: Four Over Six (the largest |code| on E2M1 4, finer steps below it).
#   INT4-aligned:   d = 2 * s_group makes codes 0, +-1..4, +-6, -8 exact (E2M1 * 2s = {0,1,2,3,4,6,8,12} s);
#                   for blocks whose largest |code| is <= 6 it is dominated by d = s_group (the grid of s
#                   holds every point of the grid of 2s up to 6s), so those blocks get d = s_group.
AMAX_TARGET = (E2M1_MAX, (0, 1))
FOUR_OVER_SIX_TARGET = (4.0, (-1, 0, 1))
INT4_ALIGNED_OFFSETS = (-1, 0)
# |code| >= 7 needs 2 * s_group (7 -> 3.5 -> 4, 8 -> 4); below that, s_group dominates.
INT4_ALIGNED_WIDE_FROM = 7
INT4_AWARE_CANDIDATES = len(AMAX_TARGET[1]) + len(FOUR_OVER_SIX_TARGET[1]) + len(INT4_ALIGNED_OFFSETS)


def all_positive_bits(blocks: int, device: torch.device) -> torch.Tensor:
    """All 126 positive E4M3 scales for every block (the exhaustive sweep), `[126, B]`."""
    bits = torch.arange(E4M3_MIN_POSITIVE_BITS, E4M3_MAX_BITS + 1, dtype=torch.uint8, device=device)
    assert bits.numel() == E4M3_NUM_POSITIVE
    return bits.unsqueeze(-1).expand(E4M3_NUM_POSITIVE, blocks)


def _rounded_bits(target_scale: torch.Tensor) -> torch.Tensor:
    return e4m3_bits(round_block_scale_to_e4m3(target_scale)).to(torch.int16)


def int4_aware_bits(
    block_max_code: torch.Tensor, group_scale: torch.Tensor, weight_scale_2: torch.Tensor
) -> torch.Tensor:
    """Candidates `[7, B]` from each block's largest |code| `[B]` and group scale `[B]`.

    Duplicates are kept (they keep the shape fixed; `select_best` breaks ties toward the smaller
    scale whatever the order). The amax target is computed exactly as Model Optimizer does
    (`block_amax / (6 * weight_scale_2)`), so its candidate IS Model Optimizer's block scale.
    """
    scale = group_scale.abs()
    block_amax = block_max_code.to(torch.float32) * scale
    columns = []
    for multiplier, offsets in (AMAX_TARGET, FOUR_OVER_SIX_TARGET):
        centre = _rounded_bits(block_amax / (multiplier * weight_scale_2))
        columns.extend(centre + offset for offset in offsets)
    aligned_multiplier = torch.where(block_max_code >= INT4_ALIGNED_WIDE_FROM, 2.0, 1.0)
    centre = _rounded_bits((aligned_multiplier * scale) / weight_scale_2)
    columns.extend(centre + offset for offset in INT4_ALIGNED_OFFSETS)
    return torch.stack(columns, dim=0).clamp(E4M3_MIN_POSITIVE_BITS, E4M3_MAX_BITS).to(torch.uint8)


def model_optimizer_bits(max_code: torch.Tensor, scale: torch.Tensor, weight_scale_2: torch.Tensor) -> torch.Tensor:
    """Model Optimizer's block scale bits (amax/6 rule) from each block's largest |code| and group scale.

    Same fp32 operations as `NVFP4QTensor.get_weights_scaling_factor`: block_amax / (6 * weight_scale_2), with
    block_amax = fl(max|q| * |s|), which is max over the block of fl(|q| * |s|) (rounding is monotone).
    """
    block_amax = max_code.to(torch.float32) * scale.abs()
    block_scale = block_amax / (E2M1_MAX * weight_scale_2)
    block_scale = torch.where(block_scale == 0, torch.full_like(block_scale, ZERO_BLOCK_SCALE), block_scale)
    return e4m3_bits(round_block_scale_to_e4m3(block_scale))
