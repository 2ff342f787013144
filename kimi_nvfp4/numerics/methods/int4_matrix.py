"""The input of scale selection: an INT4 matrix as the source checkpoint stores it."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch

from ..constants import (
    INT4_GROUP_SIZE,
    INT4_MAX,
    INT4_MIN,
    INT4_OFFSET,
    INT4_PER_INT32,
    NVFP4_BLOCK_SIZE,
)
from ..int4 import unpack_int4

__all__ = ["Int4Matrix", "unpack_int4_bytes"]


_NIBBLE_MASK = 0xF
_NIBBLE_BITS = 4


def _word_bytes_are_nibble_pairs(weight_packed: torch.Tensor, in_features: int) -> bool:
    """The words' bytes are the `[out, in/2]` nibble pairs: full-width 2-d int32 on a little-endian host."""
    full_width = weight_packed.ndim == 2 and weight_packed.shape[1] * INT4_PER_INT32 == in_features
    return weight_packed.dtype == torch.int32 and full_width and sys.byteorder == "little"


def unpack_int4_bytes(weight_packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """Same codes as `unpack_int4`, through the packed words' bytes (the conversion's hot path).

    In a little-endian int32, byte m of word j holds columns 8j+2m (low nibble) and 8j+2m+1 (high
    nibble), so two byte-wide passes replace eight int32 shifts: a quarter of the memory traffic.
    Falls back to `unpack_int4` (which validates) for anything but a full-width 2-d int32 tensor.
    """
    if not _word_bytes_are_nibble_pairs(weight_packed, in_features):
        return unpack_int4(weight_packed, in_features)
    packed_bytes = weight_packed.contiguous().view(torch.uint8)
    nibbles = torch.stack((packed_bytes & _NIBBLE_MASK, packed_bytes >> _NIBBLE_BITS), dim=-1)
    return nibbles.view(torch.int8).reshape(weight_packed.shape[0], in_features) - INT4_OFFSET


@dataclass
class Int4Matrix:
    """One INT4 linear: `W = codes * group_scale[:, col // 32]`, exact in float32."""

    codes: torch.Tensor  # int8 [out, in], values in [-8, 7]
    group_scale: torch.Tensor  # float32 [out, in/32] (bf16 values widened)
    # uint8 [out, in/2], `q + 8` per nibble, even column low: the source words' bytes when read on the CPU
    # (`from_packed`), else packed on first use by the CPU's byte-lookup paths (`search/cpu_tables.py`).
    packed_bytes: torch.Tensor | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.codes.dtype != torch.int8 or self.codes.ndim != 2:
            raise ValueError(f"Int4Matrix codes must be 2-d int8, got {self.codes.dtype} {tuple(self.codes.shape)}")
        out_features, in_features = self.codes.shape
        if in_features % INT4_GROUP_SIZE or in_features % NVFP4_BLOCK_SIZE:
            raise ValueError(f"input dimension {in_features} is not a multiple of the INT4 group {INT4_GROUP_SIZE}")
        expected = (out_features, in_features // INT4_GROUP_SIZE)
        if tuple(self.group_scale.shape) != expected:
            raise ValueError(f"group_scale shape {tuple(self.group_scale.shape)}, expected {expected}")
        if self.group_scale.dtype != torch.float32:
            self.group_scale = self.group_scale.to(torch.float32)

    @classmethod
    def from_packed(cls, weight_packed: torch.Tensor, weight_scale: torch.Tensor, in_features: int) -> Int4Matrix:
        """From compressed-tensors `weight_packed` int32 `[out, in/8]` and `weight_scale` bf16 `[out, in/32]`."""
        m = cls(unpack_int4_bytes(weight_packed, in_features), weight_scale.to(torch.float32))
        if weight_packed.device.type == "cpu" and _word_bytes_are_nibble_pairs(weight_packed, in_features):
            m.packed_bytes = weight_packed.contiguous().view(torch.uint8)
        return m

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def to(self, device: torch.device | str) -> Int4Matrix:
        on_cpu = torch.device(device).type == "cpu"  # only the CPU uses the bytes
        packed = self.packed_bytes.to(device) if self.packed_bytes is not None and on_cpu else None
        return Int4Matrix(self.codes.to(device), self.group_scale.to(device), packed)

    def rows(self, start: int, stop: int) -> Int4Matrix:
        packed = None if self.packed_bytes is None else self.packed_bytes[start:stop]
        return Int4Matrix(self.codes[start:stop], self.group_scale[start:stop], packed)

    def values(self) -> torch.Tensor:
        """float32 `[out, in]`; exact (4-bit code times bf16 scale)."""
        rows, in_features = self.codes.shape
        # Broadcast each group's scale over its 32 codes instead of materialising [out, in] scales.
        groups = self.codes.reshape(rows, in_features // INT4_GROUP_SIZE, INT4_GROUP_SIZE).to(torch.float32)
        return (groups * self.group_scale.unsqueeze(-1)).reshape(rows, in_features)

    def amax(self) -> torch.Tensor:
        """max |W| as float32 0-d, from the group scales and the largest |code| per group."""
        if self.codes.numel() == 0:
            return torch.zeros((), dtype=torch.float32, device=self.device)
        groups = self.codes.reshape(self.codes.shape[0], -1, INT4_GROUP_SIZE)
        group_max = groups.to(torch.int16).abs().amax(dim=-1).to(torch.float32)
        return (group_max * self.group_scale.abs()).amax()

    def validate_codes(self) -> None:
        if self.codes.numel() and (int(self.codes.min()) < INT4_MIN or int(self.codes.max()) > INT4_MAX):
            raise ValueError("int4 codes must lie in [-8, 7]")
