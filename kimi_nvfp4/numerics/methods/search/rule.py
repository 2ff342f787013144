"""Which E4M3 block scales a search tries, and the tensor scales it tries them under: the rules as data.

A block scale is tried as its E4M3 bit pattern (uint8; positive E4M3 values order like their patterns, so
"the neighbour" is the pattern plus or minus one). Candidates are formed by fp32 arithmetic that is the same
on every device and then cast to E4M3 as Model Optimizer casts block scales (clamp to [2**-9, 448], round to
nearest even). Every execution path of the search (`reference.py`, `cpu_search.py`, `triton_kernels.py`)
evaluates the rule objects defined here; the Triton kernel takes its constants from them
(`triton_kernels.kernel_constants`), so a rule exists once.

Why these candidates and this tensor scale: docs/numerics.md ("Why these candidates").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...constants import E2M1_MAX, E4M3_MAX
from ...e4m3 import E4M3_MAX_BITS, E4M3_MIN_POSITIVE_BITS, E4M3_NUM_POSITIVE, e4m3_bits, round_block_scale_to_e4m3
from ...nvfp4 import ZERO_BLOCK_SCALE, divide_exactly, tensor_scales_from_amax

__all__ = [
    "AlignedTarget",
    "AmaxFractionTarget",
    "CandidateRule",
    "CandidateSet",
    "EveryE4M3Scale",
    "model_optimizer_bits",
    "power_of_two_tensor_scale",
]


@dataclass(frozen=True)
class AmaxFractionTarget:
    """`d = block_amax / divisor`: the block's largest |value| lands on E2M1 `divisor` (6: Model Optimizer's
    amax rule; 4: Four Over Six). Tried at the rounded E4M3 value plus the bit offsets `lowest..highest`."""

    divisor: float
    lowest: int
    highest: int

    @property
    def count(self) -> int:
        return self.highest - self.lowest + 1


@dataclass(frozen=True)
class AlignedTarget:
    """`d = multiple * s_group` (the INT4 group scale): under `d = 2s` the codes 0, +-1..4, +-6, -8 are exact
    (E2M1 * 2s = {0, 1, 2, 3, 4, 6, 8, 12} s). Blocks whose largest |code| is below `wide_from_code` take
    `multiple = 1` (the grid of s holds every point of the grid of 2s up to 6s, so 2s is dominated there),
    the others `wide_multiple`. Tried at the rounded value plus the bit offsets `lowest..highest`."""

    wide_from_code: int
    wide_multiple: float
    lowest: int
    highest: int

    @property
    def count(self) -> int:
        return self.highest - self.lowest + 1


@dataclass(frozen=True)
class CandidateRule:
    """A few candidates per block, functions of its largest |code| and its group scale only.

    Candidates are listed target by target (fractions first, in order, then the aligned target), offsets
    ascending; duplicates are kept (the shape stays fixed, and the selection's tie rule makes the order
    irrelevant). The first fraction target with divisor 6 and offset 0 IS Model Optimizer's block scale
    (computed with its fp32 operations), which makes the search never worse than `amax` per block.
    """

    fractions: tuple[AmaxFractionTarget, ...]
    aligned: AlignedTarget

    @property
    def count(self) -> int:
        return sum(t.count for t in self.fractions) + self.aligned.count

    @property
    def tensor_scale_headroom(self) -> float:
        """`weight_scale_2 >= amax / (448 * headroom)` lets the largest block use `d = wide_multiple * s_group`:
        its block_amax is at most `wide_from_code * s` (7s for |code| 7; 8s also fits), so
        `wide_multiple * s <= amax / (wide_from_code / wide_multiple)` must stay <= 448 * weight_scale_2."""
        return self.aligned.wide_from_code / self.aligned.wide_multiple

    def bits(self, max_code: torch.Tensor, group_scale: torch.Tensor, weight_scale_2: torch.Tensor) -> torch.Tensor:
        """uint8 `[count, B]` from each block's largest |code| `[B]` (integer) and group scale `[B]` (fp32)."""
        scale = group_scale.abs()
        block_amax = max_code.to(torch.float32) * scale
        columns = []
        for target in self.fractions:
            centre = _rounded_bits(block_amax / (target.divisor * weight_scale_2))
            columns.extend(centre + offset for offset in range(target.lowest, target.highest + 1))
        aligned = self.aligned
        multiple = torch.where(max_code >= aligned.wide_from_code, aligned.wide_multiple, 1.0)
        centre = _rounded_bits((multiple * scale) / weight_scale_2)
        columns.extend(centre + offset for offset in range(aligned.lowest, aligned.highest + 1))
        return torch.stack(columns, dim=0).clamp(E4M3_MIN_POSITIVE_BITS, E4M3_MAX_BITS).to(torch.uint8)


@dataclass(frozen=True)
class EveryE4M3Scale:
    """All 126 positive E4M3 values for every block (the exhaustive sweep)."""

    count: int = E4M3_NUM_POSITIVE

    def bits(self, max_code: torch.Tensor, group_scale: torch.Tensor, weight_scale_2: torch.Tensor) -> torch.Tensor:
        """uint8 `[126, B]` (an expanded view; the inputs only give B and the device)."""
        bits = torch.arange(E4M3_MIN_POSITIVE_BITS, E4M3_MAX_BITS + 1, dtype=torch.uint8, device=group_scale.device)
        return bits.unsqueeze(-1).expand(self.count, group_scale.shape[0])


CandidateSet = CandidateRule | EveryE4M3Scale


def _rounded_bits(target_scale: torch.Tensor) -> torch.Tensor:
    return e4m3_bits(round_block_scale_to_e4m3(target_scale)).to(torch.int16)


def model_optimizer_bits(max_code: torch.Tensor, scale: torch.Tensor, weight_scale_2: torch.Tensor) -> torch.Tensor:
    """Model Optimizer's block scale bits (amax/6 rule) from each block's largest |code| and group scale.

    Same fp32 operations as `NVFP4QTensor.get_weights_scaling_factor`: block_amax / (6 * weight_scale_2), zero ->
    1.0, with block_amax = fl(max|q| * |s|), which is max over the block of fl(|q| * |s|) (rounding is monotone).
    """
    block_amax = max_code.to(torch.float32) * scale.abs()
    block_scale = block_amax / (E2M1_MAX * weight_scale_2)
    block_scale = torch.where(block_scale == 0, torch.full_like(block_scale, ZERO_BLOCK_SCALE), block_scale)
    return e4m3_bits(round_block_scale_to_e4m3(block_scale))


def power_of_two_tensor_scale(amax: torch.Tensor, headroom: float) -> torch.Tensor:
    """The smallest power of two at or above `amax / (448 * headroom)` (float32, same shape as `amax`), computed
    on `amax`'s device without reading it back; `amax <= 0` gets Model Optimizer's `amax / 2688` rule.

    A power of two makes `e4m3 * weight_scale_2` exact, so `2 * s_group` is itself a block scale whenever
    `s_group` has at most 3 mantissa bits. `frexp` gives x = m * 2**e with m in [0.5, 1), so ceil(log2(x)) is e,
    or e - 1 when m is exactly 0.5 (x a power of two): exact integer arithmetic, where a float log2 can round an
    x just above a power of two down onto it. The float64 quotient is correctly rounded on every device.
    """
    ratio = divide_exactly(amax.to(torch.float64), E4M3_MAX * headroom)
    mantissa, exponent = torch.frexp(ratio)
    exponent = exponent - (mantissa == 0.5).to(exponent.dtype)
    scale = torch.ldexp(torch.ones_like(ratio), exponent).to(torch.float32)
    return torch.where(amax > 0, scale, tensor_scales_from_amax(amax))
