"""The int4-aware block-scale search on the CPU, from one table row per (group scale, largest |q|).

The 7 candidates of a block (`int4_aware_bits`) and Model Optimizer's scale (`amax_block_bits`) are functions
of the block's group scale `s` and largest |code| only, so they, and the squared errors `err_k(s, b)` of every
magnitude k under each of them, are computed once per (distinct `s`, max |q| in 0..8) key with the very
functions the per-block path uses. A block then gathers its key's row (8 candidates x 8 magnitudes), multiplies
it by its histogram and adds the 8 products in the same pairwise order as `pairwise_sum_dim1`
(((1+2)+(3+4))+((5+6)+(7+8))): the magnitudes are stored in the order 1 5 3 7 2 6 4 8, so each level is one
add of the two contiguous halves (fp32 addition commutes, so these are the same IEEE operations).

Selection: the candidates of a key are stored sorted by bit pattern (ascending = by value), so the reference
scan (`select_best`: smaller error wins, a tie goes to the smaller scale) picks the FIRST candidate whose error
equals the minimum. A block computes the minimum (`amin`) and a 6-bit mask of which of the first 6 candidates
miss it; a table per (key, mask) holds the bits of the first candidate not in the mask. That is exact when no
error is NaN: the table is used only when every entry is finite and small enough that 16 x 8 x entry stays
finite (no product or sum can then be inf or NaN); otherwise the caller keeps the reference path. Chosen error
totals are summed in float64 over the reference's row chunks, so they are bit-identical too.
"""

from __future__ import annotations

import torch

from ..nvfp4 import ZERO_BLOCK_SCALE
from .block_search import MAGNITUDES, _squared_errors
from .candidates import INT4_AWARE_CANDIDATES, int4_aware_bits, model_optimizer_bits
from .lut import KEY_CLASSES, BlockKeys

__all__ = ["KeyTable", "key_bits", "search_by_key"]

# Storage order of magnitudes k = 1..8 (0-based k-1): halves [0,4,2,6] + [1,5,3,7] pair (1,2),(5,6),(3,4),(7,8),
# then halves of [1+2, 5+6] + [3+4, 7+8] pair (1+2, 3+4) and (5+6, 7+8), then the two halves.
_MAGNITUDE_ORDER = (0, 4, 2, 6, 1, 5, 3, 7)
# 16 (largest count) x 8 (terms) x entry must stay below fp32's max (2**128).
_LARGEST_SAFE_ENTRY = 2.0**120
# Blocks per step: the gathered [64, blocks] fp32 rows (4 MiB) stay in the two cores' L2 and L3 (measured best).
_BLOCKS_PER_STEP = 16384


def _key_inputs(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(largest |q| int16, |group scale| fp32) of every key `scale index * 9 + largest |q|`."""
    max_code = torch.arange(KEY_CLASSES, dtype=torch.int16).repeat(scales.numel())
    return max_code, scales.abs().repeat_interleave(KEY_CLASSES)


def key_bits(keys: BlockKeys, rule, weight_scale_2: torch.Tensor) -> torch.Tensor:
    """uint8 `[B]`: `rule(max_code, group_scale, weight_scale_2)` (elementwise, e.g. `model_optimizer_bits`)
    evaluated once per key and gathered per block."""
    max_code, scale = _key_inputs(keys.values)
    return torch.index_select(rule(max_code, scale, weight_scale_2), 0, keys.key)


# Bit c of a block's mask: candidate c (of the first 6) misses the minimum; the winner is the lowest clear bit.
_MASKS = 1 << (INT4_AWARE_CANDIDATES - 1)
_MASK_WEIGHTS = (1 << torch.arange(INT4_AWARE_CANDIDATES - 1, dtype=torch.int32)).to(torch.uint8).unsqueeze(1)


def _winner_by_mask() -> torch.Tensor:
    """int64 `[64]`: the lowest clear bit of each 6-bit mask (6 when all are set)."""
    mask = torch.arange(_MASKS)
    winner = torch.full((_MASKS,), INT4_AWARE_CANDIDATES - 1)
    for c in reversed(range(INT4_AWARE_CANDIDATES - 1)):
        winner = torch.where((mask >> c) & 1 == 0, c, winner)
    return winner


class KeyTable:
    """Per key `distinct scale * 9 + largest |q|`: the winner's bits `[N * 64]` by (key, mask) (zero keys:
    1.0's bits), Model Optimizer's bits `[N]` and fp32 `err_k` `[C * 8, N]` (C = 7 candidates, plus the
    baseline if any)."""

    def __init__(self, scales: torch.Tensor, weight_scale_2: torch.Tensor, baseline_scale_2: torch.Tensor | None):
        max_code, scale = _key_inputs(scales)
        candidates = int4_aware_bits(max_code, scale, weight_scale_2)  # [7, N]
        candidates = torch.sort(candidates, dim=0, stable=True).values
        errors = [_squared_errors(scale, candidates, weight_scale_2)]  # [7, 8, N]
        self.baseline_bits = None
        if baseline_scale_2 is not None:
            self.baseline_bits = model_optimizer_bits(max_code, scale, baseline_scale_2)
            errors.append(_squared_errors(scale, self.baseline_bits.unsqueeze(0), baseline_scale_2))
        order = torch.tensor(_MAGNITUDE_ORDER)
        # [C * 8, N]: a step gathers its blocks' columns, so blocks stay the contiguous (vectorised) dimension.
        errors = torch.cat(errors).index_select(1, order)
        self.errors = errors.reshape(errors.shape[0] * errors.shape[1], max_code.numel())
        # An all-zero block (or a zero group scale) is exact under any scale: keep Model Optimizer's 1.0.
        zero = (max_code == 0) | (scale == 0)
        one = torch.tensor(ZERO_BLOCK_SCALE, dtype=torch.float8_e4m3fn).view(torch.uint8)
        chosen = torch.where(zero.unsqueeze(0), one, candidates)  # [7, N]
        self.chosen_bits = chosen.index_select(0, _winner_by_mask()).t().contiguous().reshape(-1)

    def usable(self) -> bool:
        """No block error can be inf or NaN (then the minimum and mask select as the reference scan does)."""
        return self.errors.numel() == 0 or bool(self.errors.max() < _LARGEST_SAFE_ENTRY)


def search_by_key(
    keys: BlockKeys, table: KeyTable, total_rows: int
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """`search_block_bits` for INT4_AWARE from `keys` and `table` (see the module docstring).

    `total_rows`: rows per float64 partial sum of the error totals (the reference's row chunk).
    """
    shape = keys.block_id.shape  # [out, in/16]
    blocks, total_step = shape[0] * shape[1], total_rows * shape[1]
    key = keys.key
    candidates = table.errors.shape[0] // len(MAGNITUDES)
    order = torch.tensor(_MAGNITUDE_ORDER)
    histogram = keys.histogram.view(torch.uint8).view(-1, len(MAGNITUDES))  # [B, 8]: byte k-1 counts |q| = k
    chosen = torch.empty(blocks, dtype=torch.uint8)
    chosen_error = torch.empty(blocks, dtype=torch.float32)
    with_baseline = table.baseline_bits is not None
    baseline_error = torch.empty(blocks if with_baseline else 0, dtype=torch.float32)
    for start in range(0, blocks, _BLOCKS_PER_STEP):
        stop = min(blocks, start + _BLOCKS_PER_STEP)
        part = key[start:stop]
        weighted = torch.index_select(table.errors, 1, part).view(candidates, len(MAGNITUDES), -1)
        weighted.mul_(torch.index_select(histogram[start:stop].t(), 0, order).to(torch.float32))
        half = weighted[:, :4] + weighted[:, 4:]
        half = half[:, :2] + half[:, 2:]
        errors = half[:, 0] + half[:, 1]  # [C, n]
        best = torch.amin(errors[:INT4_AWARE_CANDIDATES], dim=0)
        chosen_error[start:stop] = best
        missed = (errors[: INT4_AWARE_CANDIDATES - 1] != best).view(torch.uint8)
        row = (missed * _MASK_WEIGHTS).sum(dim=0, dtype=torch.int32).add_(part * _MASKS)
        torch.index_select(table.chosen_bits, 0, row, out=chosen[start:stop])
        if with_baseline:
            baseline_error[start:stop] = errors[INT4_AWARE_CANDIDATES]
    chosen_total = _chunked_total(chosen_error, total_step)
    baseline, baseline_total = None, torch.zeros((), dtype=torch.float64)
    if with_baseline:
        baseline = torch.index_select(table.baseline_bits, 0, key).view(shape)
        baseline_total = _chunked_total(baseline_error, total_step)
    return chosen.view(shape), baseline, chosen_total, baseline_total


def _chunked_total(errors: torch.Tensor, step: int) -> torch.Tensor:
    """float64 sum of `errors` as the reference adds it: one float64 `sum` per step, the steps in order."""
    total = torch.zeros((), dtype=torch.float64)
    for start in range(0, errors.numel(), max(1, step)):
        total = total + errors[start : start + step].double().sum()
    return total
