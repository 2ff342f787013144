"""Pick, per 16-block, the E4M3 block scale with the smallest squared error among candidates.

Every 16-block lies inside one INT4 group (16 divides 32), so a block's values are `s * q_i` with one
scale `s` and codes `q_i` in [-8, 7]. E2M1 rounding is symmetric, so the error of an element depends
only on `k = |q_i|`: the block error is `sum_k n_k * err_k` with `n_k` the block's histogram of
magnitudes 1..8 (magnitude 0 is always exact). That halves the work per candidate (8 magnitudes
instead of 16 elements) and is exact: `err_k` is computed with the very fp32 operations that
`quantize_nvfp4` and `dequantize_nvfp4` perform (`k*s` is exact; `d = float(b) * weight_scale_2`;
code = e2m1(k*s / d); error = (k*s - e2m1 * d)^2).

Determinism across CPU and CUDA: only elementwise IEEE fp32 operations (no fused multiply-add:
each product is its own tensor op), sums in a fixed pairwise order, and `argmin` over candidates sorted
by increasing scale (`torch.argmin` returns the first minimum, so ties go to the smaller scale).
"""

from __future__ import annotations

import torch

from ..constants import INT4_GROUP_SIZE, INT4_MIN, NVFP4_BLOCK_SIZE
from ..e2m1 import round_e2m1_magnitude
from ..e4m3 import e4m3_bits_to_fp32

__all__ = ["MAGNITUDES", "block_codes_and_scales", "magnitude_histogram", "candidate_errors", "select_best"]

# |q| for q in [-8, 7]; magnitude 0 never contributes error.
MAGNITUDES = tuple(range(1, -INT4_MIN + 1))  # 1..8
_BLOCKS_PER_GROUP = INT4_GROUP_SIZE // NVFP4_BLOCK_SIZE


def pairwise_sum_last(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dimension (a power of two) in a fixed pairwise order, identical on every device."""
    while x.shape[-1] > 1:
        if x.shape[-1] % 2:
            raise ValueError("pairwise_sum_last needs a power-of-two length")
        x = x[..., 0::2] + x[..., 1::2]
    return x[..., 0]


def block_codes_and_scales(codes: torch.Tensor, group_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes `[R, in]`, fp32 group scales `[R, in/32]` -> codes `[R, nb, 16]`, per-block scale `[R, nb]`."""
    rows, in_features = codes.shape
    blocks = codes.reshape(rows, in_features // NVFP4_BLOCK_SIZE, NVFP4_BLOCK_SIZE)
    block_scale = group_scale.repeat_interleave(_BLOCKS_PER_GROUP, dim=1)
    return blocks, block_scale


def magnitude_histogram(block_codes: torch.Tensor) -> torch.Tensor:
    """int8 `[R, nb, 16]` -> float32 counts `[R, nb, 8]` of |q| = 1..8 (exact small integers).

    One integer scatter-add (order-independent, so identical on every device) instead of 8 passes.
    """
    magnitude = block_codes.to(torch.int64).abs()
    counts = torch.zeros((*block_codes.shape[:-1], len(MAGNITUDES) + 1), dtype=torch.int32, device=block_codes.device)
    counts.scatter_add_(-1, magnitude, torch.ones_like(magnitude, dtype=torch.int32))
    return counts[..., 1:].to(torch.float32)


def candidate_errors(
    histogram: torch.Tensor, group_scale: torch.Tensor, candidate_bits: torch.Tensor, weight_scale_2: torch.Tensor
) -> torch.Tensor:
    """Squared error `[R, nb, C]` of each block under each candidate E4M3 scale (uint8 bits `[R, nb, C]`)."""
    magnitudes = torch.tensor(MAGNITUDES, dtype=torch.float32, device=histogram.device)
    values = magnitudes * group_scale.abs().unsqueeze(-1)  # [R, nb, 8], exact
    divisor = e4m3_bits_to_fp32(candidate_bits) * weight_scale_2  # [R, nb, C]
    scaled = values.unsqueeze(-2) / divisor.unsqueeze(-1)  # [R, nb, C, 8]
    dequantized = round_e2m1_magnitude(scaled) * divisor.unsqueeze(-1)
    error = values.unsqueeze(-2) - dequantized
    squared = error * error
    weighted = squared * histogram.unsqueeze(-2)
    return pairwise_sum_last(weighted)


def select_best(errors: torch.Tensor, candidate_bits: torch.Tensor) -> torch.Tensor:
    """uint8 bits `[R, nb]` of the candidate with the smallest error; ties -> first (smallest scale)."""
    best = torch.argmin(errors, dim=-1, keepdim=True)
    return torch.gather(candidate_bits, -1, best).squeeze(-1)
