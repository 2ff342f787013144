"""FP8 E4M3 (float8_e4m3fn) as used for NVFP4 block scales (docs/formats.md §2).

Positive finite e4m3fn values are ordered like their bit patterns 0x01..0x7E (0x7F is NaN), so the
"neighbouring E4M3 value" of a scale is its bit pattern plus or minus one. Scale methods work on these
bit patterns (`uint8`) and turn them into fp32 only to do arithmetic.
"""

from __future__ import annotations

import torch

from .constants import E4M3_MAX, E4M3_MIN_BLOCK_SCALE

__all__ = [
    "E4M3_MAX_BITS",
    "E4M3_MIN_POSITIVE_BITS",
    "E4M3_NUM_POSITIVE",
    "e4m3_bits",
    "e4m3_bits_to_fp32",
    "e4m3_from_bits",
    "e4m3_positive_values",
    "round_block_scale_to_e4m3",
]

E4M3_MIN_POSITIVE_BITS = 0x01  # 2**-9, the smallest subnormal (== E4M3_MIN_BLOCK_SCALE)
E4M3_MAX_BITS = 0x7E  # 448
E4M3_NUM_POSITIVE = E4M3_MAX_BITS - E4M3_MIN_POSITIVE_BITS + 1  # 126


def e4m3_bits_to_fp32(bits: torch.Tensor) -> torch.Tensor:
    """uint8 bit patterns -> their fp32 values (exact)."""
    return bits.view(torch.float8_e4m3fn).to(torch.float32)


def e4m3_positive_values(device: torch.device | str = "cpu") -> torch.Tensor:
    """All 126 positive finite e4m3fn values, ascending, as fp32."""
    bits = torch.arange(E4M3_MIN_POSITIVE_BITS, E4M3_MAX_BITS + 1, dtype=torch.uint8, device=device)
    return e4m3_bits_to_fp32(bits)


def round_block_scale_to_e4m3(scale_fp32: torch.Tensor) -> torch.Tensor:
    """fp32 block scales -> float8_e4m3fn, clamped to [2**-9, 448] first, then rounded to nearest even.

    Same as Model Optimizer's `_cast_per_block_scale_to_fp8` (clamp avoids underflow to 0 and
    overflow to NaN; torch's cast is RNE on CPU and CUDA).
    """
    return scale_fp32.clamp(min=E4M3_MIN_BLOCK_SCALE, max=E4M3_MAX).to(torch.float8_e4m3fn)


def e4m3_bits(scale: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn tensor -> its uint8 bit patterns (a view)."""
    if scale.dtype != torch.float8_e4m3fn:
        raise ValueError(f"expected float8_e4m3fn, got {scale.dtype}")
    return scale.view(torch.uint8)


def e4m3_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """uint8 bit patterns -> float8_e4m3fn tensor (a view)."""
    if bits.dtype != torch.uint8:
        raise ValueError(f"expected uint8 bit patterns, got {bits.dtype}")
    return bits.view(torch.float8_e4m3fn)
