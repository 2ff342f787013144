"""FP4 E2M1: the 4-bit element format of NVFP4 (docs/formats.md §2).

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
    "E2M1_ROUNDING_BOUNDS",
    "E2M1_SIGN_BIT",
    "E2M1_VALUES",
    "decode_e2m1",
    "decode_e2m1_packed",
    "encode_e2m1",
    "pack_e2m1",
    "round_e2m1_magnitude",
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
        source = {
            "values": E2M1_VALUES,
            "bounds": _decision_bounds(),
            "max": torch.tensor(E2M1_MAX, dtype=torch.float32),
        }[name]
        _table_cache[key] = source.to(device)
    return _table_cache[key]


# The same bounds as Python floats (exact fp32 values), for scalar comparisons.
_DECISION_BOUNDS = tuple(_decision_bounds().tolist())
_LARGEST_MAGNITUDE_INDEX = len(E2M1_MAGNITUDES) - 1


def _magnitude_index(magnitude: torch.Tensor) -> torch.Tensor:
    """uint8 index of the E2M1 magnitude; the same as `searchsorted(bounds, magnitude)`.

    searchsorted(left) counts the bounds strictly below x; we count the bounds at or above x and
    subtract from 7, which also sends NaN (no comparison holds) to 7 as searchsorted does. Seven
    comparisons and byte additions stream through memory ~5x faster than searchsorted on CPU, and
    are plain elementwise kernels on CUDA.
    """
    not_below = torch.le(magnitude, _DECISION_BOUNDS[0]).view(torch.uint8)  # fresh tensor: safe to add into
    for bound in _DECISION_BOUNDS[1:]:
        not_below.add_(torch.le(magnitude, bound).view(torch.uint8))
    return torch.rsub(not_below, _LARGEST_MAGNITUDE_INDEX)


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """fp32 values (already divided by their scale) -> uint8 E2M1 codes, one per element."""
    if x.dtype != torch.float32:
        raise ValueError(f"encode_e2m1 expects float32 input, got {x.dtype}")
    codes = _magnitude_index(x.abs())
    return codes.bitwise_or_(torch.lt(x, 0).view(torch.uint8) << 3)


# fp32 bit layout: 23 mantissa bits under the biased exponent.
_FP32_MANTISSA_BITS = 23
# Biased fp32 exponent of 0.5, the E2M1 step below 2 (subnormal 0.5 and 1.0 -> 1.5 both step 0.5).
_E2M1_MIN_STEP_BIASED_EXPONENT = 126


def round_e2m1_magnitude(x: torch.Tensor) -> torch.Tensor:
    """Non-negative fp32 -> the E2M1 magnitude it rounds to (fp32), identical to `decode(encode(x))`.

    Arithmetic form of the same rounding, for the scale searches' inner loop (searchsorted and table
    lookups are slow on CPU): E2M1 has one mantissa bit, so a value with binary exponent e >= 1 is
    rounded to a multiple of 2**(e-1), one below 2 to a multiple of 0.5. `x / step` is exact (step is
    a power of two), `torch.round` is round-half-to-even on CPU and CUDA, which is ties-to-even
    mantissa here (an even multiple of the step has mantissa bit 0), and `minimum` saturates at 6
    (5 -> 4 by the tie rule; anything above 5 -> 6). NaN/inf never reach this (tested against encode).
    """
    biased_exponent = x.view(torch.int32) >> _FP32_MANTISSA_BITS
    step_bits = (biased_exponent - 1).clamp(min=_E2M1_MIN_STEP_BIASED_EXPONENT) << _FP32_MANTISSA_BITS
    step = step_bits.view(torch.float32)
    return torch.minimum(torch.round(x / step) * step, _table("max", x.device))


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """uint8 E2M1 codes -> fp32 values."""
    if codes.dtype != torch.uint8:
        raise ValueError(f"decode_e2m1 expects uint8 codes, got {codes.dtype}")
    # index_select takes an int32 index as is (plain indexing would widen it to int64 first).
    index = (codes & _NIBBLE_MASK).to(torch.int32)
    return torch.index_select(_table("values", codes.device), 0, index.reshape(-1)).view(codes.shape)


_pair_tables: dict[torch.device, torch.Tensor] = {}


def decode_e2m1_packed(packed: torch.Tensor) -> torch.Tensor:
    """uint8 `[..., n/2]` packed codes -> fp32 `[..., n]`: `decode_e2m1(unpack_e2m1(packed))`, the same values.

    One lookup per byte in a 256-entry table of (low, high) fp32 pairs, each pair read as one int64: on the
    CPU ~4x faster than unpacking to one byte per code and looking each up (a gather of 8-byte words costs
    about what a gather of 4-byte ones does). Needs a little-endian host (the pair's low float first).
    """
    if packed.dtype != torch.uint8:
        raise ValueError(f"decode_e2m1_packed expects uint8, got {packed.dtype}")
    if packed.device not in _pair_tables:
        byte = torch.arange(1 << 8)
        values = _table("values", torch.device("cpu"))
        pairs = torch.stack((values[byte & _NIBBLE_MASK], values[byte >> _NIBBLE_BITS]), dim=-1)
        _pair_tables[packed.device] = pairs.view(torch.int64).reshape(-1).to(packed.device)
    words = torch.index_select(_pair_tables[packed.device], 0, packed.reshape(-1).to(torch.int32))
    return words.view(torch.float32).view(*packed.shape[:-1], packed.shape[-1] * 2)


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
