"""Pick, per 16-block, the E4M3 block scale with the smallest squared error among candidates.

Every 16-block lies inside one INT4 group (16 divides 32), so a block's values are `s * q_i` with one
scale `s` and codes `q_i` in [-8, 7]. E2M1 rounding is symmetric, so the error of an element depends
only on `k = |q_i|`: the block error is `sum_k n_k * err_k` with `n_k` the block's histogram of
magnitudes 1..8 (magnitude 0 is always exact). That halves the work per candidate (8 magnitudes
instead of 16 elements) and is exact: `err_k` is computed with the very fp32 operations that
`quantize_nvfp4` and `dequantize_nvfp4` perform (`k*s` is exact; `d = float(b) * weight_scale_2`;
code = e2m1(k*s / d); error = (k*s - e2m1 * d)^2).

Layout: blocks are flattened to `B` and put LAST (`[C, 8, B]`), so every broadcast is over a leading
dimension and every elementwise op runs over contiguous memory (vectorised on CPU, coalesced on GPU).

Determinism across CPU and CUDA: only elementwise IEEE fp32 operations (no fused multiply-add:
each product is its own tensor op), integer histograms, sums in a fixed pairwise order, and a scan
over candidates that breaks ties toward the smaller scale.
"""

from __future__ import annotations

import torch

from ..constants import INT4_GROUP_SIZE, INT4_MIN, NVFP4_BLOCK_SIZE
from ..e2m1 import round_e2m1_magnitude
from ..e4m3 import E4M3_MAX_BITS, E4M3_MIN_POSITIVE_BITS, e4m3_bits_to_fp32

__all__ = [
    "MAGNITUDES",
    "ErrorTable",
    "block_max_code",
    "candidate_errors",
    "distinct_sorted",
    "flat_blocks",
    "magnitude_histogram",
    "magnitude_histogram_packed",
    "pairwise_sum_dim1",
    "select_best",
]

# |q| for q in [-8, 7]; magnitude 0 never contributes error.
MAGNITUDES = tuple(range(1, -INT4_MIN + 1))  # 1..8
_BLOCKS_PER_GROUP = INT4_GROUP_SIZE // NVFP4_BLOCK_SIZE
# Distinct group scales per step when building an ErrorTable: bounds its temporaries to 126*8*4096 fp32.
_TABLE_SCALES_PER_STEP = 4096


def flat_blocks(codes: torch.Tensor, group_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes `[R, in]`, fp32 group scales `[R, in/32]` -> codes `[B, 16]`, block scale `[B]` (B = R*in/16)."""
    block_codes = codes.reshape(-1, NVFP4_BLOCK_SIZE)
    block_scale = group_scale.repeat_interleave(_BLOCKS_PER_GROUP, dim=1).reshape(-1)
    return block_codes, block_scale


def block_max_code(block_codes: torch.Tensor) -> torch.Tensor:
    """Largest |code| per block, int16 `[B]`."""
    return block_codes.to(torch.int16).abs().amax(dim=-1)


def magnitude_histogram(block_codes: torch.Tensor) -> torch.Tensor:
    """int8 `[B, 16]` -> float32 counts `[8, B]` of |q| = 1..8 (exact small integers).

    One integer scatter-add (order-independent, so identical on every device) instead of 8 passes.
    """
    magnitude = block_codes.to(torch.int64).abs()
    counts = torch.zeros((block_codes.shape[0], len(MAGNITUDES) + 1), dtype=torch.int32, device=block_codes.device)
    counts.scatter_add_(-1, magnitude, torch.ones_like(magnitude, dtype=torch.int32))
    # A [8, B] view of [B, 8] storage: `ErrorTable.errors` multiplies along the contiguous [B, 8] layout.
    return counts[:, 1:].to(torch.float32).contiguous().t()


# Per-block counts of each |q| packed into one int64 (a 5-bit field per magnitude 1..8; a count is at
# most 16), so ONE row reduction replaces eight: reductions over 16-wide rows dominate on CUDA.
_COUNT_FIELD_BITS = 5
_COUNT_FIELD_MASK = (1 << _COUNT_FIELD_BITS) - 1


def _count_field_table(device: torch.device) -> torch.Tensor:
    fields = [0] + [1 << (_COUNT_FIELD_BITS * (k - 1)) for k in MAGNITUDES]  # |q| = 0 counts nowhere
    return torch.tensor(fields, dtype=torch.int64, device=device)


def magnitude_histogram_packed(block_codes: torch.Tensor) -> torch.Tensor:
    """`magnitude_histogram` (the same exact counts) as float32 `[8, B]` contiguous, through one int64
    row sum of packed per-magnitude fields instead of a scatter-add (atomics serialise on CUDA)."""
    magnitude = block_codes.to(torch.int32).abs_()
    fields = torch.index_select(_count_field_table(block_codes.device), 0, magnitude.reshape(-1))
    packed = fields.view(block_codes.shape).sum(dim=-1)
    counts = [(packed >> (_COUNT_FIELD_BITS * (k - 1))) & _COUNT_FIELD_MASK for k in MAGNITUDES]
    return torch.stack(counts).to(torch.float32)


def pairwise_sum_dim1(x: torch.Tensor) -> torch.Tensor:
    """Sum over dim 1 (a power of two long) in a fixed pairwise order, identical on every device."""
    while x.shape[1] > 1:
        if x.shape[1] % 2:
            raise ValueError("pairwise_sum_dim1 needs a power-of-two length")
        x = x[:, 0::2] + x[:, 1::2]
    return x[:, 0]


def candidate_errors(
    histogram: torch.Tensor, block_scale: torch.Tensor, candidate_bits: torch.Tensor, weight_scale_2: torch.Tensor
) -> torch.Tensor:
    """Squared error `[C, B]` of each block under each candidate E4M3 scale (uint8 bit patterns `[C, B]`).

    `histogram` is `[8, B]` (from `magnitude_histogram`), `block_scale` the group scale of each block `[B]`.
    """
    return pairwise_sum_dim1(_squared_errors(block_scale, candidate_bits, weight_scale_2) * histogram.unsqueeze(0))


def _squared_errors(block_scale: torch.Tensor, candidate_bits: torch.Tensor, weight_scale_2: torch.Tensor) -> torch.Tensor:
    """`(k*s - e2m1(k*s/d) * d)**2` for k = 1..8, `[C, 8, B]`, with d = float(bits) * weight_scale_2."""
    magnitudes = torch.tensor(MAGNITUDES, dtype=torch.float32, device=block_scale.device)
    values = magnitudes.unsqueeze(-1) * block_scale.abs().unsqueeze(0)  # [8, B], exact
    divisor = (e4m3_bits_to_fp32(candidate_bits) * weight_scale_2).unsqueeze(1)  # [C, 1, B]
    dequantized = round_e2m1_magnitude(values.unsqueeze(0) / divisor) * divisor  # [C, 8, B]
    error = values.unsqueeze(0) - dequantized
    return error * error


def select_best(errors: torch.Tensor, candidate_bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 bits `[B]`, error `[B]`) of the candidate with the smallest error; ties -> the smaller scale.

    A scan over the candidates with an explicit tie rule (positive E4M3 bit patterns order like their
    values), so candidates need not be sorted and the result does not depend on any reduction order.
    """
    best_error = errors[0]
    best_bits = candidate_bits[0]
    for c in range(1, errors.shape[0]):
        error, bits = errors[c], candidate_bits[c]
        better = (error < best_error) | ((error == best_error) & (bits < best_bits))
        best_error = torch.where(better, error, best_error)
        best_bits = torch.where(better, bits, best_bits)
    return best_bits, best_error


# bf16 has 16 bits: the high half of an fp32 that holds a bf16 value. Non-negative ones are < 2**15.
_BF16_SHIFT = 16
_BF16_LOW_MASK = (1 << _BF16_SHIFT) - 1
_NON_NEGATIVE_BF16_PATTERNS = 1 << 15


def distinct_sorted(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`torch.unique(values, sorted=True, return_inverse=True)` for non-negative scales, inverse as int32.

    Group scales are widened bf16, so there are at most 2**15 distinct non-negative finite values and
    their bit patterns order like their values: a bincount over the patterns, a cumulative sum and a
    gather replace unique's sort of every scale (the sort was ~10% of a CPU conversion). Anything else
    (values that are not bf16, negative or non-finite) goes through `torch.unique`.
    """
    flat = values.reshape(-1)
    bits = flat.view(torch.int32)
    is_bf16 = flat.numel() > 0 and bool(
        ((bits & _BF16_LOW_MASK) == 0).all() & (bits >= 0).all() & torch.isfinite(flat).all()
    )
    if not is_bf16:
        distinct, inverse = torch.unique(flat, sorted=True, return_inverse=True)
        return distinct, inverse.to(torch.int32)
    patterns = bits >> _BF16_SHIFT
    present = torch.bincount(patterns, minlength=_NON_NEGATIVE_BF16_PATTERNS) > 0
    rank = (torch.cumsum(present, dim=0, dtype=torch.int32) - 1).to(torch.int32)
    distinct = (torch.nonzero(present).reshape(-1).to(torch.int32) << _BF16_SHIFT).view(torch.float32)
    return distinct, torch.index_select(rank, 0, patterns)


class ErrorTable:
    """`err_k(s, b)` for every distinct group scale `s` of a matrix, every E4M3 scale `b` and k = 1..8.

    A block's error only depends on its scale `s`, its histogram and the candidate; a matrix has few
    distinct bf16 scales (thousands for millions of blocks), so computing `err_k` once per (s, b, k) and
    gathering it per block replaces the per-block division/rounding/error passes. The entries are the
    same fp32 values `candidate_errors` computes, so both give bit-identical block errors.
    """

    def __init__(
        self,
        group_scale: torch.Tensor,
        weight_scale_2: torch.Tensor,
        distinct: tuple[torch.Tensor, torch.Tensor] | None = None,
    ):
        """`distinct`: `distinct_sorted(group_scale.abs())` when the caller already has it (two tables of
        one matrix under different tensor scales share it)."""
        self.scales, inverse = distinct if distinct is not None else distinct_sorted(group_scale.abs())
        self.group_index = inverse.reshape(group_scale.shape)
        distinct = self.scales.numel()
        bits = torch.arange(E4M3_MIN_POSITIVE_BITS, E4M3_MAX_BITS + 1, dtype=torch.uint8, device=group_scale.device)
        columns = []
        for start in range(0, distinct, _TABLE_SCALES_PER_STEP):
            part = self.scales[start : start + _TABLE_SCALES_PER_STEP]
            candidate = bits.unsqueeze(-1).expand(-1, part.numel())
            columns.append(_squared_errors(part, candidate, weight_scale_2))  # [126, 8, U]
        # Rows (bits, scale), the 8 magnitudes contiguous: one block's errors under one candidate are one
        # 32-byte row, so `errors` gathers C*B rows instead of C*8*B scattered floats.
        self.table = torch.cat(columns, dim=-1).permute(0, 2, 1).reshape(-1, len(MAGNITUDES)).contiguous()
        self._rows_per_bits = distinct

    def block_scale_index(self, row_start: int, row_stop: int) -> torch.Tensor:
        """Index of each block's group scale in the table, `[B]` for rows [row_start, row_stop)."""
        rows = self.group_index[row_start:row_stop]
        return rows.repeat_interleave(_BLOCKS_PER_GROUP, dim=1).reshape(-1)

    def errors(self, histogram: torch.Tensor, scale_index: torch.Tensor, candidate_bits: torch.Tensor) -> torch.Tensor:
        """Squared error `[C, B]`; bit-identical to `candidate_errors` for the same blocks and candidates.

        The products and the pairwise sum over k are the same fp32 operations in the same order as
        `pairwise_sum_dim1` over `[C, 8, B]`, only with k as the last (contiguous) dimension.
        """
        rows = (candidate_bits.to(torch.int32) - E4M3_MIN_POSITIVE_BITS) * self._rows_per_bits + scale_index
        # index_select takes the int32 index as is (plain indexing would first widen it to int64).
        squared = torch.index_select(self.table, 0, rows.reshape(-1)).view(*rows.shape, len(MAGNITUDES))
        weighted = squared * histogram.t().unsqueeze(0)  # [C, B, 8]
        while weighted.shape[-1] > 1:
            weighted = weighted[..., 0::2] + weighted[..., 1::2]
        return weighted[..., 0]
