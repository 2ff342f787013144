"""Dequantizing a stored matrix (NVFP4 or compressed-tensors INT4) into the compute dtype in one Triton kernel.

The model stages dequantize every expert matrix of a layer once per stream (`Linear.materialize`, and validate's
per-expert check and baseline): 1,152 matrices per K2.6 MoE layer. The reference (`nvfp4.dequantize_nvfp4`,
`int4.dequantize_int4`, then the cast to the compute dtype) runs ~8 kernels per matrix over fp32 temporaries; here
one program reads 128 16-element blocks from the stored bytes and writes the result in the compute dtype.

Bit-exact with the reference followed by `.to(dtype)`: the same fp32 products (`e2m1 * (e4m3 * weight_scale_2)`,
the scale product first; `code * scale` for INT4), the code's sign applied as a sign-bit flip (so -0.0 stays -0.0
and a negative, i.e. corrupted, block scale flips the sign as the reference's product does), and the bf16 cast as
round-to-nearest-even on the bit pattern (activation_kernel.py says why it is spelled out). Tests:
tests/numerics/test_dequant_kernels.py (Triton's CPU interpreter here; the compiled kernels on CUDA).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .activation_kernel import _bf16_bits_rn
from .constants import INT4_GROUP_SIZE, INT4_PER_INT32, NVFP4_BLOCK_SIZE
from .methods.search.triton_kernels import _e2m1_value, _e4m3_value
from .nvfp4 import NVFP4Tensor

__all__ = ["DEQUANT_DTYPES", "dequantize_int4_fused", "dequantize_nvfp4_fused", "int4_whole_groups"]

_BLOCKS_PER_PROGRAM = 128
_COMPILE = {"enable_fp_fusion": False, "num_warps": 4}
DEQUANT_DTYPES = (torch.bfloat16, torch.float32)
_INT4_OFFSET = tl.constexpr(8)
_E4M3_NAN_BITS = tl.constexpr(0x7F)


def int4_whole_groups(weight_packed: torch.Tensor, in_features: int) -> bool:
    """Whether the kernels read this INT4 matrix: rows of whole 32-groups, so whole int32 words and no padding."""
    return in_features % INT4_GROUP_SIZE == 0 and weight_packed.shape[-1] * INT4_PER_INT32 == in_features


@triton.jit
def _store(out_ptr, offsets, value, live, BF16: tl.constexpr):
    if BF16:
        tl.store(out_ptr + offsets, _bf16_bits_rn(value), mask=live[:, None])
    else:
        tl.store(out_ptr + offsets, value, mask=live[:, None])


@triton.jit
def nvfp4_block_values(weight_ptr, block_scale_ptr, scale_2_ptr, block, live):
    """fp32 `[BLOCKS, 16]`: the NVFP4 values of 16-element blocks `block` (row-major over the matrix)."""
    j = tl.arange(0, 16)
    byte = tl.load(weight_ptr + block[:, None] * 8 + (j // 2)[None, :], mask=live[:, None], other=0).to(tl.int32)
    code = (byte >> ((j % 2) * 4)[None, :]) & 0xF  # even element in the low nibble
    bits = tl.load(block_scale_ptr + block, mask=live, other=0).to(tl.int32)
    magnitude_bits = bits & 0x7F
    block_scale = _e4m3_value(magnitude_bits)
    block_scale = tl.where(magnitude_bits == _E4M3_NAN_BITS, float("nan"), block_scale)
    block_scale = tl.where((bits & 0x80) != 0, -block_scale, block_scale)
    d = block_scale * tl.load(scale_2_ptr)
    product = _e2m1_value(code & 7) * d[:, None]
    return (product.to(tl.int32, bitcast=True) ^ ((code >> 3) << 31)).to(tl.float32, bitcast=True)


@triton.jit
def int4_block_values(packed_ptr, group_scale_ptr, block, live):
    """fp32 `[BLOCKS, 16]`: the INT4 values of 16-element blocks `block` (element 16b + j is nibble j % 8 of word
    2b + j // 8, and its group scale is b // 2: rows of whole 32-groups)."""
    j = tl.arange(0, 16)
    words = tl.load(packed_ptr + block[:, None] * 2 + (j // 8)[None, :], mask=live[:, None], other=0)
    code = ((words >> ((j % 8) * 4)[None, :]) & 0xF) - _INT4_OFFSET
    group_scale = tl.load(group_scale_ptr + block // 2, mask=live, other=0.0).to(tl.float32)
    return code.to(tl.float32) * group_scale[:, None]


@triton.jit
def _nvfp4_kernel(weight_ptr, block_scale_ptr, scale_2_ptr, out_ptr, num_blocks, BLOCKS: tl.constexpr,
                  BF16: tl.constexpr):
    block = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    live = block < num_blocks
    value = nvfp4_block_values(weight_ptr, block_scale_ptr, scale_2_ptr, block, live)
    _store(out_ptr, block[:, None] * 16 + tl.arange(0, 16)[None, :], value, live, BF16)


@triton.jit
def _int4_kernel(packed_ptr, group_scale_ptr, out_ptr, num_blocks, BLOCKS: tl.constexpr, BF16: tl.constexpr):
    block = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    live = block < num_blocks
    value = int4_block_values(packed_ptr, group_scale_ptr, block, live)
    _store(out_ptr, block[:, None] * 16 + tl.arange(0, 16)[None, :], value, live, BF16)


def _launch(kernel, out: torch.Tensor, *inputs: torch.Tensor) -> None:
    """Run `kernel(*inputs, out, num_blocks)` over `out`'s 16-element blocks (bf16 written as its bit patterns)."""
    num_blocks = out.numel() // NVFP4_BLOCK_SIZE
    if num_blocks:
        bf16 = out.dtype == torch.bfloat16
        target = out.view(torch.int16) if bf16 else out
        grid = (triton.cdiv(num_blocks, _BLOCKS_PER_PROGRAM),)
        kernel[grid](*inputs, target, num_blocks, BLOCKS=_BLOCKS_PER_PROGRAM, BF16=bf16, **_COMPILE)


def dequantize_nvfp4_fused(t: NVFP4Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`dequantize_nvfp4(t).to(dtype)` in one kernel (`dtype` in DEQUANT_DTYPES; CUDA, or the interpreter)."""
    if dtype not in DEQUANT_DTYPES:
        raise ValueError(f"the fused dequantization writes {DEQUANT_DTYPES}, not {dtype}")
    rows, half = t.weight.shape
    if tuple(t.weight_scale.shape) != (rows, 2 * half // NVFP4_BLOCK_SIZE):
        raise ValueError(f"block scales {tuple(t.weight_scale.shape)} do not fit weight {tuple(t.weight.shape)}")
    out = torch.empty(rows, 2 * half, dtype=dtype, device=t.weight.device)
    scale_2 = t.weight_scale_2.to(device=t.weight.device, dtype=torch.float32).reshape(1)
    _launch(_nvfp4_kernel, out, t.weight.contiguous(), t.weight_scale.contiguous().view(torch.uint8), scale_2)
    return out


def dequantize_int4_fused(weight_packed: torch.Tensor, weight_scale: torch.Tensor, in_features: int,
                          dtype: torch.dtype) -> torch.Tensor:
    """`dequantize_int4(...).to(dtype)` in one kernel, for rows of whole 32-groups (`in_features % 32 == 0`)."""
    rows = weight_packed.shape[0]
    if dtype not in DEQUANT_DTYPES or not int4_whole_groups(weight_packed, in_features):
        raise ValueError(f"the fused INT4 dequantization takes whole 32-groups in {DEQUANT_DTYPES}")
    out = torch.empty(rows, in_features, dtype=dtype, device=weight_packed.device)
    _launch(_int4_kernel, out, weight_packed.contiguous(), weight_scale.contiguous())
    return out
