"""compressed-tensors `pack-quantized` INT4 (what Kimi K2.x ships for routed experts).

Layout (docs/formats.md §1): `weight_packed` int32 `[out, in/8]`; column `8j+k` is bits `4k..4k+3` of word
`j`; each nibble holds `q + 8`. `W[r, c] = q[r, c] * weight_scale[r, c // group]`.
Matches compressed_tensors.compressors.pack_quantized.helpers.{pack_to_int32, unpack_from_int32}.
"""

from __future__ import annotations

import sys

import torch

from .constants import (
    INT4_BITS,
    INT4_GROUP_SIZE,
    INT4_MAX,
    INT4_MIN,
    INT4_OFFSET,
    INT4_PER_INT32,
)

_NIBBLE_MASK = 0xF
_PAD_NIBBLE = 0


def _shifts(device: torch.device) -> torch.Tensor:
    return torch.arange(INT4_PER_INT32, device=device, dtype=torch.int32) * INT4_BITS


def unpack_int4(weight_packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """int32 `[out, ceil(in/8)]` -> int8 codes `[out, in]` in [-8, 7]."""
    if weight_packed.dtype != torch.int32 or weight_packed.ndim != 2:
        raise ValueError(f"expected a 2-d int32 packed tensor, got {weight_packed.dtype} {tuple(weight_packed.shape)}")
    out_features, words = weight_packed.shape
    if words * INT4_PER_INT32 < in_features or (words - 1) * INT4_PER_INT32 >= in_features:
        raise ValueError(f"packed width {words} int32 words does not hold {in_features} int4 columns")
    # Arithmetic right shift of int32 sign-extends the top nibble; the mask removes it.
    nibbles = (weight_packed.unsqueeze(-1) >> _shifts(weight_packed.device)) & _NIBBLE_MASK
    codes = nibbles.reshape(out_features, words * INT4_PER_INT32)[:, :in_features]
    return (codes - INT4_OFFSET).to(torch.int8)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """int codes `[out, in]` in [-8, 7] -> int32 `[out, ceil(in/8)]` (inverse of unpack_int4).

    Byte-wise: nibble pairs `(q[2i] + 8) | (q[2i+1] + 8) << 4` make bytes, and four consecutive bytes
    read as a little-endian int32 are exactly the word whose bits `4k..4k+3` hold column `8j+k`
    (compressed-tensors' `pack_to_int32`, bit for bit). Works on any device; the result stays there.
    """
    if codes.ndim != 2:
        raise ValueError(f"expected 2-d codes, got shape {tuple(codes.shape)}")
    if codes.numel():
        low, high = torch.aminmax(codes)
        if int(low) < INT4_MIN or int(high) > INT4_MAX:
            raise ValueError("int4 codes must lie in [-8, 7]")
    out_features, in_features = codes.shape
    words = -(-in_features // INT4_PER_INT32)
    if words == 0:
        return torch.empty((out_features, 0), dtype=torch.int32, device=codes.device)
    if sys.byteorder != "little":
        return _pack_int4_words(codes)
    pad = words * INT4_PER_INT32 - in_features
    # q + 8 as uint8: int8 storage reinterpreted as uint8 wraps, and adding 8 wraps back into [0, 15].
    nibbles = codes.view(torch.uint8) if codes.dtype == torch.int8 else codes.to(torch.int16).to(torch.uint8)
    nibbles = (nibbles + INT4_OFFSET).contiguous()
    if pad:
        # compressed-tensors' pack_to_int32 pads with nibble 0 (after the offset); do the same so that
        # packed words are byte-identical for widths that are not a multiple of 8.
        nibbles = torch.nn.functional.pad(nibbles, (0, pad), value=_PAD_NIBBLE)
    pairs = nibbles.view(out_features, words * INT4_PER_INT32 // 2, 2)
    packed = pairs[..., 1] << INT4_BITS
    packed |= pairs[..., 0]
    return packed.view(torch.int32)


def _pack_int4_words(codes: torch.Tensor) -> torch.Tensor:
    """Arithmetic packing (any byte order, any shape): sum of shifted nibbles per int32 word."""
    out_features, in_features = codes.shape
    pad = (-in_features) % INT4_PER_INT32
    nibbles = codes.to(torch.int64) + INT4_OFFSET
    if pad:
        nibbles = torch.nn.functional.pad(nibbles, (0, pad), value=_PAD_NIBBLE)
    nibbles = nibbles.reshape(out_features, -1, INT4_PER_INT32) << _shifts(codes.device).to(torch.int64)
    words = nibbles.sum(dim=-1)  # disjoint bit fields: sum == bitwise or
    # Reinterpret the low 32 bits as signed int32 (bit 31 set when the top nibble >= 8).
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32)


def group_scales_fp32(weight_scale: torch.Tensor, in_features: int, group_size: int = INT4_GROUP_SIZE) -> torch.Tensor:
    """Per-element scales `[out, in]` in float32 from per-group scales `[out, in/group]`."""
    return weight_scale.to(torch.float32).repeat_interleave(group_size, dim=1)[:, :in_features]


def dequantize_int4(
    weight_packed: torch.Tensor, weight_scale: torch.Tensor, in_features: int, group_size: int = INT4_GROUP_SIZE
) -> torch.Tensor:
    """Exact float32 values `q * s` (a 4-bit code times a bf16 scale needs at most 11 mantissa bits)."""
    codes = unpack_int4(weight_packed, in_features)
    return codes.to(torch.float32) * group_scales_fp32(weight_scale, in_features, group_size)
