"""Byte lookups over the packed INT4 source: the CPU's facts per block (histograms, largest |code|, keys) and encode.

compressed-tensors packs `q + 8` per nibble, and a little-endian int32 word's byte m holds columns 8j+2m (low
nibble) and 8j+2m+1 (high nibble): the same pairing as an NVFP4 byte (even column low). A 16-block is 8 such
bytes inside one INT4 group, so every value in it is `q * s` with one group scale `s`, and with one block scale
`b` the E2M1 code of each element is a function of (q, s, b) only. Hence:

* **Encode** is one gather per byte from a 256-entry table per distinct (group scale, block bits) pair that
  the matrix uses; each entry is computed with exactly the fp32 operations of `encode_with_block_scales`
  (`v = float(q) * s`; `x = v / (float(b) * weight_scale_2)`; `encode_e2m1(x)`), so bytes are identical for
  any block scales, NaN and negative ones included.
* **Histograms** of |q| = 1..8 per block are sums of four 16-bit lookups (four codes each) of packed byte
  fields (a count is at most 16, so fields never carry); the largest |q| is the highest non-zero field.

Everything here runs on the CPU (`cpu_tables_apply`); other devices keep the elementwise paths (they gain
nothing from gathers). The searches over these keys are in `cpu_search.py`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from ...constants import INT4_GROUP_SIZE, INT4_MIN, INT4_OFFSET, NVFP4_BLOCK_SIZE
from ...e2m1 import encode_e2m1
from ...e4m3 import e4m3_bits_to_fp32
from ..int4_matrix import Int4Matrix

__all__ = [
    "KEY_CLASSES",
    "BlockKeys",
    "code_bytes",
    "cpu_tables_apply",
    "encode_blocks",
    "group_code_squares",
    "scale_ids",
]

_BYTES_PER_BLOCK = NVFP4_BLOCK_SIZE // 2  # 8: one int64 per block
_BLOCKS_PER_GROUP = INT4_GROUP_SIZE // NVFP4_BLOCK_SIZE
_NIBBLES = 16
_BYTE_VALUES = 256
_MAGNITUDES = -INT4_MIN  # |q| = 1..8, one byte field each
KEY_CLASSES = _MAGNITUDES + 1  # largest |q| of a block: 0..8
_KEY_STEP_BLOCKS = 1 << 16
# Elements (bytes of output) per encode step: the int32 index and the gathered bytes stay in L2.
_ENCODE_STEP_BYTES = 1 << 18


def cpu_tables_apply(m: Int4Matrix) -> bool:
    """The byte-lookup paths apply: a CPU matrix on a little-endian host, codes in [-8, 7], finite scales.

    Anything else keeps the reference path (non-finite scales propagate per element there, e.g. `0 * inf`).
    """
    if m.device.type != "cpu" or sys.byteorder != "little" or not bool(torch.isfinite(m.group_scale).all()):
        return False
    return code_bytes(m) is not None


def code_bytes(m: Int4Matrix) -> torch.Tensor | None:
    """uint8 `[out, in/2]`: `q + 8` per nibble, even column low (compressed-tensors' word bytes), or None
    when a code lies outside [-8, 7] (no nibble holds it).

    `Int4Matrix.from_packed` keeps the source words' bytes; otherwise they are packed from the codes once.
    """
    if m.packed_bytes is None:
        nibbles = m.codes.view(torch.uint8) + INT4_OFFSET  # q in [-8, 7] -> q + 8 in [0, 15] (mod 256)
        if nibbles.numel() and int(nibbles.max()) >= _NIBBLES:
            return None
        pairs = nibbles.view(m.shape[0], m.shape[1] // 2, 2)
        m.packed_bytes = pairs[..., 0] | (pairs[..., 1] << 4)
    return m.packed_bytes


_histogram_tables: dict[torch.device, torch.Tensor] = {}


def _histogram_table(device: torch.device) -> torch.Tensor:
    """int64 `[65536]`: for 4 codes (a 16-bit pattern, low nibble first), byte field k-1 counts |q| = k."""
    if device not in _histogram_tables:
        pattern = torch.arange(1 << 16, dtype=torch.int64)
        magnitude = torch.stack([((pattern >> (4 * i)) & 0xF) - INT4_OFFSET for i in range(4)]).abs()
        # |q| = 0 contributes 0; |q| = k adds 1 << 8(k-1).
        fields = torch.where(magnitude > 0, torch.ones_like(magnitude) << (8 * (magnitude - 1).clamp(min=0)), 0)
        _histogram_tables[device] = fields.sum(dim=0).to(device)
    return _histogram_tables[device]


_square_tables: dict[torch.device, torch.Tensor] = {}


def _quads(source: torch.Tensor) -> torch.Tensor:
    """int32 `[bytes/2]`: each 16-bit pattern (4 codes, low nibble first) of the code bytes, as an index."""
    return source.reshape(-1).view(torch.uint16).to(torch.int32)


def group_code_squares(source: torch.Tensor) -> torch.Tensor:
    """int32 `[rows, in/32]`: sum of q**2 over each INT4 group, from code bytes `[rows, in/2]` (exact integers,
    so equal to summing the squared codes in any order)."""
    if source.device not in _square_tables:
        pattern = torch.arange(1 << 16, dtype=torch.int32)
        codes = torch.stack([((pattern >> (4 * i)) & 0xF) - INT4_OFFSET for i in range(4)])
        _square_tables[source.device] = codes.square().sum(dim=0, dtype=torch.int32).to(source.device)
    squares = torch.index_select(_square_tables[source.device], 0, _quads(source))
    return squares.view(source.shape[0], -1, INT4_GROUP_SIZE // 4).sum(dim=-1, dtype=torch.int32)


def scale_ids(group_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(distinct values fp32 `[U]`, int32 id per group) keyed on the exact bit pattern (sign included).

    Widened bf16 scales (the source format) have 2**16 possible patterns: a bincount, a cumulative sum and a
    gather replace a sort. Any other float32 goes through `torch.unique` of the bit patterns.
    """
    flat = group_scale.reshape(-1)
    halves = flat.view(torch.int16).view(-1, 2)  # little-endian: [:, 1] is the bf16 pattern
    if flat.numel() and not bool(halves[:, 0].any()):
        patterns = halves[:, 1].to(torch.int32) + (1 << 15)
        present = torch.bincount(patterns, minlength=1 << 16) > 0
        rank = torch.cumsum(present, dim=0, dtype=torch.int32) - 1
        distinct = (torch.nonzero(present).reshape(-1) - (1 << 15)).to(torch.int16)
        values = distinct.view(torch.bfloat16).to(torch.float32)
        ids = torch.index_select(rank, 0, patterns)
    else:
        distinct, ids = torch.unique(flat.view(torch.int32), return_inverse=True)
        values = distinct.view(torch.float32)
    return values, ids.to(torch.int32).reshape(group_scale.shape)


def _block_scale_ids(m: Int4Matrix) -> tuple[torch.Tensor, torch.Tensor]:
    """(distinct group scales `[U]`, int32 `[out, in/16]` index of each block's group scale)."""
    values, ids = scale_ids(m.group_scale)
    return values, ids.repeat_interleave(_BLOCKS_PER_GROUP, dim=1)


@dataclass
class BlockKeys:
    """Per 16-block facts of one matrix, from its bytes: what every CPU step below looks up by.

    `values`: distinct group scales `[U]`; `block_id`: int32 `[out, in/16]` index into `values`;
    `histogram`: int64 `[B]` with byte field k-1 = count of |q| = k; `max_code`: int32 `[B]` largest |q|;
    `key`: int32 `[B]` = `block_id * 9 + max_code`, the row of a per-(scale, largest |q|) table.
    """

    values: torch.Tensor
    block_id: torch.Tensor
    histogram: torch.Tensor
    max_code: torch.Tensor
    key: torch.Tensor

    @classmethod
    def of(cls, m: Int4Matrix) -> BlockKeys:
        values, block_id = _block_scale_ids(m)
        source, table = code_bytes(m).view(-1, _BYTES_PER_BLOCK), _histogram_table(m.device)
        histogram = torch.empty(source.shape[0], dtype=torch.int64)
        max_code = torch.empty(source.shape[0], dtype=torch.int32)
        for start in range(0, source.shape[0], _KEY_STEP_BLOCKS):  # temporaries of ~1 MiB, not 4x the matrix
            step = slice(start, start + _KEY_STEP_BLOCKS)
            part = torch.index_select(table, 0, _quads(source[step]))
            torch.sum(part.view(-1, 4), dim=1, out=histogram[step])
            # The largest |q| is 1 + the highest non-zero byte field = ceil((floor(log2 h) + 1) / 8), from
            # frexp's exponent (floor(log2 h) + 1; 0 for h = 0). Widening to float64 keeps floor(log2 h): rounding
            # could only carry into the next power of two if 53 leading bits were all ones, but a field (<= 16)
            # never sets its top 3 bits.
            exponent = torch.frexp(histogram[step].to(torch.float64)).exponent
            torch.bitwise_right_shift(exponent.add_(7), 3, out=max_code[step])
        return cls(values, block_id, histogram, max_code, block_id.reshape(-1) * KEY_CLASSES + max_code)

    def amax(self) -> torch.Tensor:
        """max |W| (float32 0-d), as `Int4Matrix.amax`: for finite `s`, max over a group of fl(|q| * |s|) is
        fl(max|q| * |s|) (rounding is monotone), so each present (scale, block max) pair is one candidate."""
        present = torch.bincount(self.key, minlength=self.values.numel() * KEY_CLASSES) > 0
        codes = torch.arange(KEY_CLASSES, dtype=torch.float32).repeat(self.values.numel())
        scales = self.values.abs().repeat_interleave(KEY_CLASSES)
        products = codes * scales
        return products[present].amax() if products.numel() else torch.zeros((), dtype=torch.float32)


def _pair_table(values: torch.Tensor, bits: torch.Tensor, weight_scale_2: torch.Tensor) -> torch.Tensor:
    """uint8 `[P, 256]`: the NVFP4 byte of each source byte under (group scale, block bits) pairs `[P]`."""
    q = torch.arange(_NIBBLES, dtype=torch.float32) - INT4_OFFSET
    v = q.unsqueeze(0) * values.unsqueeze(-1)  # float(q) * s: Int4Matrix.values()
    divisor = e4m3_bits_to_fp32(bits) * weight_scale_2  # encode_with_block_scales: product first
    codes = encode_e2m1(v / divisor.unsqueeze(-1))  # [P, 16], by nibble q + 8
    return (codes.unsqueeze(2) << 4 | codes.unsqueeze(1)).reshape(-1, _BYTE_VALUES)  # [P, hi, lo]


def encode_blocks(
    source: torch.Tensor, values: torch.Tensor, block_id: torch.Tensor, bits: torch.Tensor, weight_scale_2: torch.Tensor
) -> torch.Tensor:
    """NVFP4 bytes `[out, in/2]` of `encode_with_block_scales(values(), e4m3(bits), weight_scale_2)`, by lookup.

    `source`: code bytes `[out, in/2]`; `block_id`: int32 `[out, in/16]` into `values`; `bits`: uint8 block
    scales `[out, in/16]`. Only the (scale, bits) pairs present get a table row (bincount + cumulative rank).
    """
    pair = block_id.reshape(-1) * _BYTE_VALUES + bits.reshape(-1).to(torch.int32)
    present = torch.bincount(pair, minlength=values.numel() * _BYTE_VALUES) > 0
    rank = torch.cumsum(present, dim=0, dtype=torch.int32) - 1
    used = torch.nonzero(present).reshape(-1)
    table = _pair_table(values[used // _BYTE_VALUES], (used % _BYTE_VALUES).to(torch.uint8), weight_scale_2)
    row = torch.index_select(rank, 0, pair) * _BYTE_VALUES  # [B]
    table = table.reshape(-1)
    out = torch.empty(source.shape, dtype=torch.uint8)
    flat_source, flat_out = source.reshape(-1, _BYTES_PER_BLOCK), out.view(-1, _BYTES_PER_BLOCK)
    step = max(1, _ENCODE_STEP_BYTES // _BYTES_PER_BLOCK)
    for start in range(0, flat_source.shape[0], step):
        stop = start + step
        index = flat_source[start:stop].to(torch.int32).add_(row[start:stop].unsqueeze(1))
        torch.index_select(table, 0, index.view(-1), out=flat_out[start:stop].view(-1))
    return out
