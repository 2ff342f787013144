"""FP4 E2M1: the 4-bit element format of NVFP4.

A code is `sign << 3 | m`; `m` indexes the magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}. Rounding follows
Model Optimizer's `NVFP4QTensor._cast_fp4` exactly (modelopt/torch/quantization/qtensor/nvfp4_tensor.py):
`searchsorted` over the midpoints between neighbouring magnitudes, plus one at the midpoints whose upper
neighbour has an even mantissa (0.75, 1.75, 3.5), which is round-to-nearest, ties to even mantissa;
magnitudes above 5 saturate to 6. We fold the tie fix into the bounds (see `_decision_bounds`). The sign bit is `x < 0`, so -0.0 encodes as +0 while a tiny negative
value encodes as -0 (code 8) -- again as Model Optimizer does.
"""

from __future__ import annotations

import torch

from .constants import E2M1_MAX

__all__ = [
    "E2M1_MAGNITUDES",
    "E2M1_VALUES",
    "E2M1_ROUNDING_BOUNDS",
    "E2M1_SIGN_BIT",
    "encode_e2m1",
    "decode_e2m1",
    "round_e2m1_magnitude",
    "pack_e2m1",
    "unpack_e2m1",
]

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, E2M1_MAX)
# fp32 [16]; index = code (sign << 3 | magnitude index). Code 8 is -0.0.
E2M1_VALUES = torch.tensor(E2M1_MAGNITUDES + tuple(-m for m in E2M1_MAGNITUDES), dtype=torch.float32)
# Midpoints between neighbouring magnitudes: the decision boundaries of round-to-nearest.
E2M1_ROUNDING_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
# Midpoints whose tie goes UP (the upper neighbour 1, 2, 4 has an even mantissa).
_TIES_ROUND_UP = (0.75, 1.75, 3.5)
E2M1_SIGN_BIT = 0x8
_NIBBLE_MASK = 0xF
_NIBBLE_BITS = 4


def _decision_bounds() -> torch.Tensor:
    """Bounds for ONE `searchsorted(right=False)` that rounds exactly like ModelOpt's bounds + tie fix.

    searchsorted(left) counts the bounds strictly below x, so a tie at a bound rounds DOWN. For the
    midpoints whose tie must go UP we use the largest fp32 below them: `x > nextafter(b, 0)` is
    `x >= b` for every fp32 x. Same codes as `_cast_fp4` for every fp32 input, without three extra
    equality passes (this is the inner loop of the scale searches).
    """
    bounds = torch.tensor(E2M1_ROUNDING_BOUNDS, dtype=torch.float32)
    tie_up = torch.tensor([b in _TIES_ROUND_UP for b in E2M1_ROUNDING_BOUNDS])
    return torch.where(tie_up, torch.nextafter(bounds, torch.zeros_like(bounds)), bounds)


_table_cache: dict[tuple[str, torch.device], torch.Tensor] = {}


def _table(name: str, device: torch.device) -> torch.Tensor:
    key = (name, device)
    if key not in _table_cache:
        source = {"values": E2M1_VALUES, "bounds": _decision_bounds()}[name]
        _table_cache[key] = source.to(device)
    return _table_cache[key]


def _magnitude_index(magnitude: torch.Tensor) -> torch.Tensor:
    return torch.searchsorted(_table("bounds", magnitude.device), magnitude.contiguous(), out_int32=True)


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """fp32 values (already divided by their scale) -> uint8 E2M1 codes, one per element."""
    if x.dtype != torch.float32:
        raise ValueError(f"encode_e2m1 expects float32 input, got {x.dtype}")
    sign = (x < 0).to(torch.uint8)
    return (sign << 3) | _magnitude_index(x.abs()).to(torch.uint8)


def round_e2m1_magnitude(x: torch.Tensor) -> torch.Tensor:
    """Non-negative fp32 -> the E2M1 magnitude it encodes to (fp32), same rounding as `encode_e2m1`.

    `decode_e2m1(encode_e2m1(x))` without the sign work, for the scale searches' inner loop.
    """
    return _table("values", x.device)[_magnitude_index(x)]


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """uint8 E2M1 codes -> fp32 values."""
    if codes.dtype != torch.uint8:
        raise ValueError(f"decode_e2m1 expects uint8 codes, got {codes.dtype}")
    return _table("values", codes.device)[codes.long() & _NIBBLE_MASK]


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes `[..., n]` -> uint8 `[..., n/2]`, even column in the LOW nibble.

    Model Optimizer packs `(q[..., 1::2] << 4) | q[..., 0::2]`; SGLang/flashinfer read the same order.
    """
    if codes.dtype != torch.uint8:
        raise ValueError(f"pack_e2m1 expects uint8 codes, got {codes.dtype}")
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_e2m1 needs an even last dimension, got {tuple(codes.shape)}")
    return (codes[..., 1::2] << _NIBBLE_BITS) | codes[..., 0::2]


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 `[..., n/2]` -> uint8 codes `[..., n]` (inverse of pack_e2m1)."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"unpack_e2m1 expects uint8, got {packed.dtype}")
    low = packed & _NIBBLE_MASK
    high = packed >> _NIBBLE_BITS
    return torch.stack((low, high), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
