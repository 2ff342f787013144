"""Weights -> Kimi's INT4 routed-expert tensors: compressed-tensors `pack-quantized`, symmetric, group 32.

The rule compressed-tensors applies for `{num_bits 4, type int, symmetric, strategy group, group_size 32}` with its
default min-max observer (docs/formats.md §1):
- scale = max(|min|, |max|) / ((q_max - q_min) / 2) = absmax / 7.5 per group of 32 inputs
  (compressed_tensors/quantization/utils/helpers.py `calculate_qparams`), stored as bf16; an all-zero group
  gets the smallest positive step instead of 0 (the dtype's eps, as there);
- q = clamp(round_half_even(w / scale), -8, 7) (quantization/lifecycle/forward_helpers.py `_quantize`);
- stored as `weight_packed` int32 [out, in/8] (nibble = q + 8), `weight_scale` bf16 [out, in/32],
  `weight_shape` int32 [2].
Arithmetic happens in the weight's own dtype, dividing by the stored (bf16) scale: a bf16 weight (the demo
model's, Moonshot's) is quantized in bf16 as compressed-tensors does on a bf16 model; a float32 weight (synth,
tests) in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..numerics.constants import INT4_GROUP_SIZE, INT4_MAX, INT4_MIN
from ..numerics.int4 import dequantize_int4, pack_int4

SCALE_DTYPE = torch.bfloat16
# compressed-tensors' symmetric range: (q_max - q_min) / 2 = 15 / 2.
SYMMETRIC_INT4_HALF_RANGE = (INT4_MAX - INT4_MIN) / 2


def quantize_int4(weight: torch.Tensor, *, in_place: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and group scales of a 2-d weight, by compressed-tensors' symmetric min-max rule (module docstring).

    :param weight: [out, in] float32 or bfloat16, `in` a multiple of 32.
    :param in_place: use `weight` as scratch (its values are destroyed); spares a weight-sized temporary.
    :returns: (codes int8 [out, in] in [-8, 7], scales bf16 [out, in/32]), on the weight's device.
    """
    if weight.ndim != 2 or weight.shape[1] % INT4_GROUP_SIZE:
        raise ValueError(f"expected a 2-d weight with in_features divisible by {INT4_GROUP_SIZE}, "
                         f"got {tuple(weight.shape)}")
    out_features, in_features = weight.shape
    shape = (out_features, in_features // INT4_GROUP_SIZE, INT4_GROUP_SIZE)
    groups = weight.view(shape) if in_place else weight.reshape(shape)
    # max |w| per group in one pass, without an |w| temporary: max(max w, -min w) is exactly amax(|w|).
    low, high = torch.aminmax(groups, dim=-1)
    scale = (torch.maximum(high, low.neg_()) / SYMMETRIC_INT4_HALF_RANGE).to(SCALE_DTYPE)
    scale = torch.where(scale == 0, torch.tensor(torch.finfo(SCALE_DTYPE).eps, dtype=SCALE_DTYPE,
                                                 device=scale.device), scale)
    divisor = scale.to(weight.dtype).unsqueeze(-1)
    q = groups.div_(divisor) if in_place else groups / divisor
    codes = q.round_().clamp_(INT4_MIN, INT4_MAX).to(torch.int8)
    return codes.view(out_features, in_features), scale


@dataclass(frozen=True)
class PackedInt4:
    """One INT4 matrix as the checkpoint stores it."""

    weight_packed: torch.Tensor  # int32 [out, in/8]
    weight_scale: torch.Tensor  # bf16 [out, in/32]
    weight_shape: torch.Tensor  # int32 [2]

    def tensors(self, module: str) -> dict[str, torch.Tensor]:
        return {f"{module}.weight_packed": self.weight_packed, f"{module}.weight_scale": self.weight_scale,
                f"{module}.weight_shape": self.weight_shape}

    def dequantize(self) -> torch.Tensor:
        return dequantize_int4(self.weight_packed, self.weight_scale, int(self.weight_shape[1]))


def quantize_int4_packed(weight: torch.Tensor) -> PackedInt4:
    """The three checkpoint tensors of `weight` (detached, rounded to bf16 first as a bf16 model stores it)."""
    codes, scale = quantize_int4(weight.detach().to(SCALE_DTYPE))
    shape = torch.tensor(list(weight.shape), dtype=torch.int32)
    return PackedInt4(pack_int4(codes), scale.contiguous(), shape)


def fake_quantize_int4(weight: torch.Tensor) -> torch.Tensor:
    """float32 values the INT4 checkpoint holds for `weight` (bf16-rounded, quantized, dequantized)."""
    codes, scale = quantize_int4(weight.detach().to(SCALE_DTYPE))
    return codes.to(torch.float32) * scale.to(torch.float32).repeat_interleave(INT4_GROUP_SIZE, dim=1)
