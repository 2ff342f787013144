"""A candidate rule's search on the CPU, from one table row per (group scale, largest |code|) key.

The candidates of a block (`CandidateRule.bits`) and Model Optimizer's scale are functions of the block's group
scale `s` and largest |code| only, so they, and the squared errors `err_k(s, b)` of every magnitude k under each,
are computed once per (distinct `s`, max |q| in 0..8) key with the very functions the reference uses. A block
then gathers its key's column (C + 1 candidates x 8 magnitudes), multiplies it by its histogram and adds the 8
products in the reference's pairwise order (((1+2)+(3+4))+((5+6)+(7+8))): the magnitudes are stored in the order
1 5 3 7 2 6 4 8, so each level is one add of the two contiguous halves (fp32 addition commutes, so these are the
same IEEE operations).

Selection: the candidates of a key are stored sorted by bit pattern (ascending = by value), so the reference scan
(`select_best`: smaller error wins, a tie goes to the smaller scale) picks the FIRST candidate whose error equals
the minimum. A block computes the minimum (`amin`) and a (C-1)-bit mask of which of the first C-1 candidates miss
it; a table per (key, mask) holds the bits of the first candidate not in the mask. That is exact when no error
is NaN: the table is used only when every entry is finite and small enough that 16 x 8 x entry stays finite (no
product or sum can then be inf or NaN); otherwise `KeyTable.usable` is false and the caller keeps the reference.
Error totals are summed in float64 over the reference's row chunks, so they are bit-identical too.
"""

from __future__ import annotations

import torch

from ...nvfp4 import ZERO_BLOCK_SCALE
from .cpu_tables import KEY_CLASSES, BlockKeys
from .reference import MAGNITUDES, squared_errors
from .result import SearchResult
from .rule import CandidateRule, model_optimizer_bits

__all__ = ["KeyTable", "key_bits"]

# Storage order of magnitudes k = 1..8 (0-based k-1): halves [0,4,2,6] + [1,5,3,7] pair (1,2),(5,6),(3,4),(7,8),
# then halves of [1+2, 5+6] + [3+4, 7+8] pair (1+2, 3+4) and (5+6, 7+8), then the two halves.
_MAGNITUDE_ORDER = (0, 4, 2, 6, 1, 5, 3, 7)
# 16 (largest count) x 8 (terms) x entry must stay below fp32's max (2**128).
_LARGEST_SAFE_ENTRY = 2.0**120
# Blocks per step: the gathered [64, blocks] fp32 rows (4 MiB) stay in the two cores' L2 and L3 (measured best).
_BLOCKS_PER_STEP = 16384
# Mask bits are weighted in uint8 (products of a 0/1 byte and a bit weight), so at most 8 of them.
_LARGEST_MASK_BITS = 8


def _key_inputs(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(largest |q| int16, |group scale| fp32) of every key `scale index * 9 + largest |q|`."""
    max_code = torch.arange(KEY_CLASSES, dtype=torch.int16).repeat(scales.numel())
    return max_code, scales.abs().repeat_interleave(KEY_CLASSES)


def key_bits(keys: BlockKeys, weight_scale_2: torch.Tensor) -> torch.Tensor:
    """uint8 `[out, in/16]`: Model Optimizer's block scales under `weight_scale_2`, once per key, gathered per block."""
    max_code, scale = _key_inputs(keys.values)
    bits = torch.index_select(model_optimizer_bits(max_code, scale, weight_scale_2), 0, keys.key)
    return bits.view(keys.block_id.shape)


def _winner_by_mask(count: int) -> torch.Tensor:
    """int64 `[2**(count-1)]`: the lowest clear bit of each mask of the first count-1 candidates (count-1 if none)."""
    masks = 1 << (count - 1)
    mask = torch.arange(masks)
    winner = torch.full((masks,), count - 1)
    for c in reversed(range(count - 1)):
        winner = torch.where((mask >> c) & 1 == 0, c, winner)
    return winner


class KeyTable:
    """Per key `distinct scale * 9 + largest |q|`: the winner's bits by (key, mask) (zero keys: 1.0's bits), Model
    Optimizer's bits `[N]` and fp32 `err_k` `[(C + 1) * 8, N]` (the rule's C candidates, then the baseline)."""

    @staticmethod
    def holds(rule: CandidateRule) -> bool:
        """Whether the rule's candidates fit the mask table."""
        return 1 <= rule.count - 1 <= _LARGEST_MASK_BITS

    def __init__(
        self, scales: torch.Tensor, rule: CandidateRule, weight_scale_2: torch.Tensor, baseline_scale_2: torch.Tensor
    ):
        self.count = rule.count
        max_code, scale = _key_inputs(scales)
        candidates = torch.sort(rule.bits(max_code, scale, weight_scale_2), dim=0, stable=True).values  # [C, N]
        self.baseline_bits = model_optimizer_bits(max_code, scale, baseline_scale_2)
        errors = torch.cat([
            squared_errors(scale, candidates, weight_scale_2),  # [C, 8, N]
            squared_errors(scale, self.baseline_bits.unsqueeze(0), baseline_scale_2),
        ]).index_select(1, torch.tensor(_MAGNITUDE_ORDER))
        # [(C + 1) * 8, N]: a step gathers its blocks' columns, so blocks stay the contiguous (vectorised) dimension.
        self.errors = errors.reshape(errors.shape[0] * errors.shape[1], max_code.numel())
        # An all-zero block (or a zero group scale) is exact under any scale: keep Model Optimizer's 1.0.
        zero = (max_code == 0) | (scale == 0)
        one = torch.tensor(ZERO_BLOCK_SCALE, dtype=torch.float8_e4m3fn).view(torch.uint8)
        chosen = torch.where(zero.unsqueeze(0), one, candidates)  # [C, N]
        self.chosen_bits = chosen.index_select(0, _winner_by_mask(self.count)).t().contiguous().reshape(-1)

    def usable(self) -> bool:
        """No block error can be inf or NaN (then the minimum and mask select as the reference scan does)."""
        return self.errors.numel() == 0 or bool(self.errors.max() < _LARGEST_SAFE_ENTRY)

    def search(self, keys: BlockKeys, total_rows: int) -> SearchResult:
        """The reference search's bits and totals from `keys` (see the module docstring); `total_rows`: rows per
        float64 partial sum of the error totals (`reference.error_total_rows`)."""
        shape = keys.block_id.shape  # [out, in/16]
        blocks, total_step = shape[0] * shape[1], total_rows * shape[1]
        count, masks = self.count, 1 << (self.count - 1)
        mask_weights = (1 << torch.arange(count - 1, dtype=torch.int32)).to(torch.uint8).unsqueeze(1)
        order = torch.tensor(_MAGNITUDE_ORDER)
        histogram = keys.histogram.view(torch.uint8).view(-1, len(MAGNITUDES))  # [B, 8]: byte k-1 counts |q| = k
        chosen = torch.empty(blocks, dtype=torch.uint8)
        chosen_error = torch.empty(blocks, dtype=torch.float32)
        baseline_error = torch.empty(blocks, dtype=torch.float32)
        for start in range(0, blocks, _BLOCKS_PER_STEP):
            stop = min(blocks, start + _BLOCKS_PER_STEP)
            part = keys.key[start:stop]
            weighted = torch.index_select(self.errors, 1, part).view(count + 1, len(MAGNITUDES), -1)
            weighted.mul_(torch.index_select(histogram[start:stop].t(), 0, order).to(torch.float32))
            half = weighted[:, :4] + weighted[:, 4:]
            half = half[:, :2] + half[:, 2:]
            errors = half[:, 0] + half[:, 1]  # [C + 1, n]
            best = torch.amin(errors[:count], dim=0)
            chosen_error[start:stop] = best
            missed = (errors[: count - 1] != best).view(torch.uint8)
            row = (missed * mask_weights).sum(dim=0, dtype=torch.int32).add_(part * masks)
            torch.index_select(self.chosen_bits, 0, row, out=chosen[start:stop])
            baseline_error[start:stop] = errors[count]
        baseline = torch.index_select(self.baseline_bits, 0, keys.key).view(shape)
        return SearchResult(
            chosen.view(shape), baseline, _chunked_total(chosen_error, total_step),
            _chunked_total(baseline_error, total_step),
        )


def _chunked_total(errors: torch.Tensor, step: int) -> torch.Tensor:
    """float64 sum of `errors` as the reference adds it: one float64 `sum` per step, the steps in order."""
    total = torch.zeros((), dtype=torch.float64)
    for start in range(0, errors.numel(), max(1, step)):
        total = total + errors[start : start + step].double().sum()
    return total
