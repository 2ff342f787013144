"""The search for any candidate set on the CPU, from a table of `err_k(s, b)` over the matrix's distinct scales.

A block's error depends only on its group scale `s`, its histogram and the candidate; a matrix has few distinct
bf16 scales (506 in a 512x7168 synthetic slice, 229k groups), so `err_k` is computed once per (distinct `s`,
each of the 126 E4M3 values `b`, k = 1..8) and each block gathers 8 values per candidate, multiplies them by its
histogram and adds them in the reference's pairwise order. The entries are the very fp32 values
`reference.squared_errors` computes, so block errors, choices and totals are bit-identical to the reference.
Used for candidate sets the key tables do not hold (the 126-candidate sweep) and when they refuse a matrix.
"""

from __future__ import annotations

import torch

from ...constants import NVFP4_BLOCK_SIZE
from ...e4m3 import E4M3_MAX_BITS, E4M3_MIN_POSITIVE_BITS
from ...nvfp4 import ZERO_BLOCK_SCALE
from ..int4_matrix import Int4Matrix
from .cpu_tables import BlockKeys
from .reference import MAGNITUDES, candidate_errors, error_total_rows, select_best, squared_errors
from .result import SearchResult
from .rule import CandidateSet, model_optimizer_bits

__all__ = ["ScaleTable", "search_by_scale_table"]

# Distinct group scales per step when building a table: bounds its temporaries to 126*8*4096 fp32.
_TABLE_SCALES_PER_STEP = 4096


class ScaleTable:
    """`err_k(s, b)` for every distinct group scale `s` (`BlockKeys.values`), every positive E4M3 `b`, k = 1..8."""

    def __init__(self, scales: torch.Tensor, weight_scale_2: torch.Tensor):
        bits = torch.arange(E4M3_MIN_POSITIVE_BITS, E4M3_MAX_BITS + 1, dtype=torch.uint8, device=scales.device)
        columns = []
        for start in range(0, scales.numel(), _TABLE_SCALES_PER_STEP):
            part = scales[start : start + _TABLE_SCALES_PER_STEP]
            columns.append(squared_errors(part, bits.unsqueeze(-1).expand(-1, part.numel()), weight_scale_2))
        # Rows (bits, scale), the 8 magnitudes contiguous: one block's errors under one candidate are one
        # 32-byte row, so `errors` gathers C*B rows instead of C*8*B scattered floats.
        self.table = torch.cat(columns, dim=-1).permute(0, 2, 1).reshape(-1, len(MAGNITUDES)).contiguous()
        self._rows_per_bits = scales.numel()

    def errors(self, histogram: torch.Tensor, scale_index: torch.Tensor, candidate_bits: torch.Tensor) -> torch.Tensor:
        """Squared error `[C, B]`, bit-identical to `reference.candidate_errors` for the same blocks and candidates:
        the same products and pairwise sum over k, only with k as the last (contiguous) dimension.

        `histogram`: float32 `[B, 8]`; `scale_index`: int32 `[B]` into the table's scales; bits uint8 `[C, B]`.
        """
        rows = (candidate_bits.to(torch.int32) - E4M3_MIN_POSITIVE_BITS) * self._rows_per_bits + scale_index
        # index_select takes the int32 index as is (plain indexing would first widen it to int64).
        squared = torch.index_select(self.table, 0, rows.reshape(-1)).view(*rows.shape, len(MAGNITUDES))
        weighted = squared * histogram.unsqueeze(0)  # [C, B, 8]
        while weighted.shape[-1] > 1:
            weighted = weighted[..., 0::2] + weighted[..., 1::2]
        return weighted[..., 0]


def search_by_scale_table(
    m: Int4Matrix, keys: BlockKeys, weight_scale_2: torch.Tensor, baseline_scale_2: torch.Tensor,
    candidates: CandidateSet,
) -> SearchResult:
    """`reference.search_reference` (same bits, same totals, same row chunks) with errors from a `ScaleTable`."""
    out_features, in_features = m.shape
    blocks_per_row = in_features // NVFP4_BLOCK_SIZE
    table = ScaleTable(keys.values, weight_scale_2)
    histograms = keys.histogram.view(torch.uint8).view(-1, len(MAGNITUDES))  # byte k-1 counts |q| = k
    block_id = keys.block_id.reshape(-1)
    chosen = torch.empty((out_features * blocks_per_row,), dtype=torch.uint8)
    baseline = torch.empty_like(chosen)
    one = torch.tensor(ZERO_BLOCK_SCALE, dtype=torch.float8_e4m3fn).view(torch.uint8)
    chosen_error = torch.zeros((), dtype=torch.float64)
    baseline_error = torch.zeros((), dtype=torch.float64)
    row_chunk = error_total_rows(m, candidates.count)
    for start in range(0, out_features, row_chunk):
        rows = slice(start * blocks_per_row, min(out_features, start + row_chunk) * blocks_per_row)
        scale_index = block_id[rows]
        block_scale = torch.index_select(keys.values, 0, scale_index)
        max_code = keys.max_code[rows]
        histogram = histograms[rows].to(torch.float32)
        bits = candidates.bits(max_code, block_scale, weight_scale_2)
        best, best_error = select_best(table.errors(histogram, scale_index, bits), bits)
        chosen_error = chosen_error + best_error.double().sum()
        baseline_bits = model_optimizer_bits(max_code, block_scale, baseline_scale_2).unsqueeze(0)
        errors = candidate_errors(histogram.t(), block_scale, baseline_bits, baseline_scale_2)
        baseline_error = baseline_error + errors.double().sum()
        baseline[rows] = baseline_bits[0]
        zero = (max_code == 0) | (block_scale == 0)  # exact under any scale: Model Optimizer's 1.0
        chosen[rows] = torch.where(zero, one, best)
    shape = (out_features, blocks_per_row)
    return SearchResult(chosen.view(shape), baseline.view(shape), chosen_error, baseline_error)
