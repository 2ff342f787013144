"""Routed-expert weights -> compressed-tensors `pack-quantized` INT4, symmetric, group 32.

Bit-for-bit what compressed-tensors produces for `{num_bits 4, type int, symmetric, strategy group,
group_size 32}` with its default min-max observer on a bf16 weight:
- scale = max(|min|, |max|) / ((q_max - q_min) / 2) = absmax / 7.5 per group of 32 inputs, in the
  weight's dtype (compressed_tensors/quantization/utils/helpers.py `calculate_qparams`), a zero
  scale replaced by the dtype's eps;
- q = clamp(round_half_even(w / scale), -8, 7) (quantization/lifecycle/forward_helpers.py `_quantize`);
- stored as `weight_packed` int32 [out, in/8] (nibble = q + 8), `weight_scale` bf16 [out, in/32],
  `weight_shape` int32 [2] (SPEC §1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..numerics.constants import INT4_GROUP_SIZE, INT4_MAX, INT4_MIN
from ..numerics.int4 import dequantize_int4, pack_int4

SCALE_DTYPE = torch.bfloat16
# compressed-tensors symmetric range: (q_max - q_min) / 2 = 15 / 2.
SYMMETRIC_INT4_HALF_RANGE = (INT4_MAX - INT4_MIN) / 2


@dataclass(frozen=True)
class PackedInt4:
    weight_packed: torch.Tensor  # int32 [out, in/8]
    weight_scale: torch.Tensor  # bf16 [out, in/32]
    weight_shape: torch.Tensor  # int32 [2]

    def tensors(self, module: str) -> dict[str, torch.Tensor]:
        return {f"{module}.weight_packed": self.weight_packed, f"{module}.weight_scale": self.weight_scale,
                f"{module}.weight_shape": self.weight_shape}

    def dequantize(self) -> torch.Tensor:
        return dequantize_int4(self.weight_packed, self.weight_scale, int(self.weight_shape[1]))


def quantize_int4_codes(weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes int8 [out, in], scales bf16 [out, in/group]) of a 2-d weight, rounded to bf16 first."""
    if weight.ndim != 2 or weight.shape[1] % group_size:
        raise ValueError(f"expected a 2-d weight with in_features divisible by {group_size}, got {tuple(weight.shape)}")
    w = weight.detach().to(SCALE_DTYPE)
    out_features, in_features = w.shape
    groups = w.reshape(out_features, in_features // group_size, group_size)
    absmax = torch.maximum(groups.amin(dim=-1).neg().clamp(min=0), groups.amax(dim=-1).clamp(min=0))
    scale = absmax / SYMMETRIC_INT4_HALF_RANGE  # bf16 arithmetic, as compressed-tensors on a bf16 weight
    scale = torch.where(scale == 0, torch.tensor(torch.finfo(SCALE_DTYPE).eps, dtype=SCALE_DTYPE), scale)
    q = torch.round(groups / scale.unsqueeze(-1)).clamp(INT4_MIN, INT4_MAX)
    return q.reshape(out_features, in_features).to(torch.int8), scale


def quantize_int4_packed(weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE) -> PackedInt4:
    codes, scale = quantize_int4_codes(weight, group_size)
    shape = torch.tensor(list(weight.shape), dtype=torch.int32)
    return PackedInt4(pack_int4(codes), scale.contiguous(), shape)


def fake_quantize_int4(weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE) -> torch.Tensor:
    """float32 values the INT4 checkpoint represents for `weight` (codes times bf16 scales)."""
    codes, scale = quantize_int4_codes(weight, group_size)
    return codes.to(torch.float32) * scale.to(torch.float32).repeat_interleave(group_size, dim=1)
