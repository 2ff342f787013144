"""NVFP4 bytes of an INT4 matrix under chosen block scales: the reference row encode and the CPU's byte lookup.

Both are `encode_with_block_scales(m.values(), e4m3(bits), weight_scale_2)` packed (even column low): the CPU path
looks each source byte up in a 256-entry table per (group scale, block bits) pair computed with those very fp32
operations (`cpu_tables.encode_blocks`), so the bytes are identical for any block scales, NaN ones included.
"""

from __future__ import annotations

import torch

from ...e2m1 import pack_e2m1
from ...e4m3 import e4m3_from_bits
from ...nvfp4 import encode_with_block_scales
from ..int4_matrix import Int4Matrix
from .cpu_tables import BlockKeys, code_bytes, encode_blocks

__all__ = ["encode_by_lookup", "encode_rows"]

# Elements per step of the row encode (a few fp32 temporaries of rows x in): 2048 rows of K2.6's 7168-wide
# gate/up on CPU; 8x that on CUDA, where each step is a handful of kernel launches and a [4096, 7168] gate+up
# stack then runs in one step. Rows are independent: the bytes do not depend on it.
_ENCODE_STEP_ELEMENTS = {"cpu": 2048 * 7168, "cuda": 8 * 2048 * 7168}


def encode_rows(m: Int4Matrix, bits: torch.Tensor, weight_scale_2: torch.Tensor) -> torch.Tensor:
    """Packed E2M1 uint8 `[out, in/2]` of `m` under block-scale bits (uint8 `[out, in/16]`), elementwise in row steps."""
    packed = torch.empty((m.shape[0], m.shape[1] // 2), dtype=torch.uint8, device=m.device)
    block_scale = e4m3_from_bits(bits)
    budget = _ENCODE_STEP_ELEMENTS.get(m.device.type, _ENCODE_STEP_ELEMENTS["cpu"])
    step = max(1, budget // max(1, m.shape[1]))
    for start in range(0, m.shape[0], step):
        stop = min(m.shape[0], start + step)
        values = m.rows(start, stop).values()
        packed[start:stop] = pack_e2m1(encode_with_block_scales(values, block_scale[start:stop], weight_scale_2))
    return packed


def encode_by_lookup(m: Int4Matrix, keys: BlockKeys, bits: torch.Tensor, weight_scale_2: torch.Tensor) -> torch.Tensor:
    """`encode_rows` on the CPU by byte lookup (`cpu_tables.encode_blocks`; the same bytes)."""
    return encode_blocks(code_bytes(m), keys.values, keys.block_id, bits, weight_scale_2)
