"""The block-scale search as plain per-block torch operations: the definition every faster path must equal.

Every 16-block lies inside one INT4 group (16 divides 32), so a block's values are `s * q_i` with one scale `s`
and codes `q_i` in [-8, 7]. E2M1 rounding is symmetric, so an element's error depends only on `k = |q_i|`: the
block error under a candidate is `sum_k n_k * err_k` with `n_k` the block's histogram of magnitudes 1..8
(magnitude 0 is always exact) and `err_k = (k*s - e2m1(k*s/d) * d)**2`, `d = float(bits) * weight_scale_2`:
the very fp32 operations of `quantize_nvfp4` and `dequantize_nvfp4` (`k*s` is exact).

Layout: blocks are flattened to `B` and put LAST (`[C, 8, B]`), so every broadcast is over a leading dimension
and every elementwise op runs over contiguous memory (vectorised on CPU, coalesced on GPU).

Determinism across devices: only elementwise IEEE fp32 operations (no fused multiply-add: each product is its
own tensor op), integer histograms, sums in a fixed pairwise order, and a scan over the candidates that breaks
ties toward the smaller scale; nothing is read back to the host.
"""

from __future__ import annotations

import torch

from ...constants import INT4_GROUP_SIZE, INT4_MIN, NVFP4_BLOCK_SIZE
from ...e2m1 import round_e2m1_magnitude
from ...e4m3 import e4m3_bits_to_fp32
from ...nvfp4 import ZERO_BLOCK_SCALE
from ..int4_matrix import Int4Matrix
from .result import SearchResult
from .rule import CandidateSet, model_optimizer_bits

__all__ = [
    "MAGNITUDES",
    "block_max_code",
    "candidate_errors",
    "error_total_rows",
    "flat_blocks",
    "magnitude_histogram",
    "model_optimizer_block_bits",
    "search_reference",
    "select_best",
    "squared_errors",
]

# |q| for q in [-8, 7]; magnitude 0 never contributes error.
MAGNITUDES = tuple(range(1, -INT4_MIN + 1))  # 1..8
BLOCKS_PER_GROUP = INT4_GROUP_SIZE // NVFP4_BLOCK_SIZE
# Upper bound on elements of the largest temporary ([candidates, 8, blocks] fp32) per row chunk: 2**24 * 4 B =
# 64 MiB on CPU, so a [7168, 2048] matrix never needs 126x its size; on CUDA 16x that (1 GiB), so a whole K2.6
# expert matrix is one chunk. The chunk also fixes the order of the float64 error totals (every path adds its
# fp32 block errors chunk by chunk), so a new value can change a near-tie of the group fallback, never a block.
_WORK_ELEMENTS = {"cpu": 1 << 24, "cuda": 1 << 28}
# Per-block counts of each |q| packed into one int64 (a 5-bit field per magnitude 1..8; a count is at most 16),
# so ONE row reduction replaces eight (reductions over 16-wide rows dominate on CUDA, and a scatter-add
# serialises on CUDA atomics).
_COUNT_FIELD_BITS = 5
_COUNT_FIELD_MASK = (1 << _COUNT_FIELD_BITS) - 1


def error_total_rows(m: Int4Matrix, candidates: int) -> int:
    """Rows per float64 partial sum of a search's error totals (and per temporary of the reference)."""
    work = _WORK_ELEMENTS.get(m.device.type, _WORK_ELEMENTS["cpu"])
    blocks_per_row = m.shape[1] // NVFP4_BLOCK_SIZE
    return max(1, work // max(1, blocks_per_row * candidates * len(MAGNITUDES)))


def flat_blocks(codes: torch.Tensor, group_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes `[R, in]`, fp32 group scales `[R, in/32]` -> codes `[B, 16]`, block scale `[B]` (B = R*in/16)."""
    block_codes = codes.reshape(-1, NVFP4_BLOCK_SIZE)
    block_scale = group_scale.repeat_interleave(BLOCKS_PER_GROUP, dim=1).reshape(-1)
    return block_codes, block_scale


def block_max_code(block_codes: torch.Tensor) -> torch.Tensor:
    """Largest |code| per block, int16 `[B]`."""
    return block_codes.to(torch.int16).abs().amax(dim=-1)


def _count_field_table(device: torch.device) -> torch.Tensor:
    fields = [0] + [1 << (_COUNT_FIELD_BITS * (k - 1)) for k in MAGNITUDES]  # |q| = 0 counts nowhere
    return torch.tensor(fields, dtype=torch.int64, device=device)


def magnitude_histogram(block_codes: torch.Tensor) -> torch.Tensor:
    """int8 `[B, 16]` -> float32 counts `[8, B]` (contiguous) of |q| = 1..8: exact small integers, through one
    int64 row sum of packed per-magnitude fields."""
    magnitude = block_codes.to(torch.int32).abs_()
    fields = torch.index_select(_count_field_table(block_codes.device), 0, magnitude.reshape(-1))
    packed = fields.view(block_codes.shape).sum(dim=-1)
    counts = [(packed >> (_COUNT_FIELD_BITS * (k - 1))) & _COUNT_FIELD_MASK for k in MAGNITUDES]
    return torch.stack(counts).to(torch.float32)


def _pairwise_sum_dim1(x: torch.Tensor) -> torch.Tensor:
    """Sum over dim 1 (a power of two long) in a fixed pairwise order, identical on every device."""
    while x.shape[1] > 1:
        if x.shape[1] % 2:
            raise ValueError("_pairwise_sum_dim1 needs a power-of-two length")
        x = x[:, 0::2] + x[:, 1::2]
    return x[:, 0]


def squared_errors(block_scale: torch.Tensor, candidate_bits: torch.Tensor, weight_scale_2: torch.Tensor) -> torch.Tensor:
    """`(k*s - e2m1(k*s/d) * d)**2` for k = 1..8, `[C, 8, B]`, with d = float(bits) * weight_scale_2."""
    magnitudes = torch.tensor(MAGNITUDES, dtype=torch.float32, device=block_scale.device)
    values = magnitudes.unsqueeze(-1) * block_scale.abs().unsqueeze(0)  # [8, B], exact
    divisor = (e4m3_bits_to_fp32(candidate_bits) * weight_scale_2).unsqueeze(1)  # [C, 1, B]
    dequantized = round_e2m1_magnitude(values.unsqueeze(0) / divisor) * divisor  # [C, 8, B]
    error = values.unsqueeze(0) - dequantized
    return error * error


def candidate_errors(
    histogram: torch.Tensor, block_scale: torch.Tensor, candidate_bits: torch.Tensor, weight_scale_2: torch.Tensor
) -> torch.Tensor:
    """Squared error `[C, B]` of each block under each candidate (uint8 `[C, B]`); `histogram` `[8, B]`."""
    return _pairwise_sum_dim1(squared_errors(block_scale, candidate_bits, weight_scale_2) * histogram.unsqueeze(0))


def select_best(errors: torch.Tensor, candidate_bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 bits `[B]`, error `[B]`) of the candidate with the smallest error; ties -> the smaller scale.

    A scan over the candidates with an explicit tie rule (positive E4M3 bit patterns order like their values),
    so candidates need not be sorted and the result does not depend on any reduction order.
    """
    best_error = errors[0]
    best_bits = candidate_bits[0]
    for c in range(1, errors.shape[0]):
        error, bits = errors[c], candidate_bits[c]
        better = (error < best_error) | ((error == best_error) & (bits < best_bits))
        best_error = torch.where(better, error, best_error)
        best_bits = torch.where(better, bits, best_bits)
    return best_bits, best_error


def model_optimizer_block_bits(m: Int4Matrix, weight_scale_2: torch.Tensor) -> torch.Tensor:
    """Model Optimizer's block scales of `m` under `weight_scale_2`, uint8 `[out, in/16]`."""
    block_codes, block_scale = flat_blocks(m.codes, m.group_scale)
    bits = model_optimizer_bits(block_max_code(block_codes), block_scale, weight_scale_2)
    return bits.view(m.shape[0], m.shape[1] // NVFP4_BLOCK_SIZE)


def search_reference(
    m: Int4Matrix, weight_scale_2: torch.Tensor, baseline_scale_2: torch.Tensor, candidates: CandidateSet
) -> SearchResult:
    """Each block's best candidate under `weight_scale_2` and Model Optimizer's scale under `baseline_scale_2`,
    computed block by block in row chunks (`error_total_rows`); nothing read back."""
    out_features, in_features = m.shape
    blocks_per_row = in_features // NVFP4_BLOCK_SIZE
    chosen = torch.empty((out_features * blocks_per_row,), dtype=torch.uint8, device=m.device)
    baseline = torch.empty_like(chosen)
    one = torch.tensor(ZERO_BLOCK_SCALE, dtype=torch.float8_e4m3fn, device=m.device).view(torch.uint8)
    chosen_error = torch.zeros((), dtype=torch.float64, device=m.device)
    baseline_error = torch.zeros((), dtype=torch.float64, device=m.device)
    row_chunk = error_total_rows(m, candidates.count)
    for start in range(0, out_features, row_chunk):
        stop = min(out_features, start + row_chunk)
        block_codes, block_scale = flat_blocks(m.codes[start:stop], m.group_scale[start:stop])
        max_code = block_max_code(block_codes)
        histogram = magnitude_histogram(block_codes)
        bits = candidates.bits(max_code, block_scale, weight_scale_2)
        best, best_error = select_best(candidate_errors(histogram, block_scale, bits, weight_scale_2), bits)
        chosen_error = chosen_error + best_error.double().sum()
        baseline_bits = model_optimizer_bits(max_code, block_scale, baseline_scale_2).unsqueeze(0)
        errors = candidate_errors(histogram, block_scale, baseline_bits, baseline_scale_2)
        baseline_error = baseline_error + errors.double().sum()
        rows = slice(start * blocks_per_row, stop * blocks_per_row)
        baseline[rows] = baseline_bits[0]
        # An all-zero block is exact under any scale; keep Model Optimizer's 1.0 for it.
        zero = (histogram.sum(dim=0) == 0) | (block_scale == 0)
        chosen[rows] = torch.where(zero, one, best)
    shape = (out_features, blocks_per_row)
    return SearchResult(chosen.view(shape), baseline.view(shape), chosen_error, baseline_error)
