"""W4A4 activation fake-quantization as one fused Triton kernel (the model stages' hot elementwise path on CUDA).

`nvfp4.fake_quantize_activation_nvfp4` (the reference, and the CPU path) runs about twenty elementwise kernels over
fp32 temporaries of the whole activation; calibrate's W4A4 pass and validate's W4A4 stream and per-expert check
run it over every MoE chunk (the hidden state for gate/up, the SwiGLU output for down). Here one program reads 128
blocks of 16 activations in their own dtype and writes the dequantized result in that dtype: two passes over
memory instead of ~20 in fp32.

Bit-exact with `fake_quantize_activation_nvfp4(x, s).to(x.dtype)`: the same IEEE fp32 operations in the same
order -- `1 / input_scale` and the other divisions correctly rounded (`tl.div_rn`; Triton's `/` is approximate),
`amax * fp32(1/6)` then the product with the global scale, the E4M3 cast as round-to-nearest-even on the fp32 bit
pattern after the clamp to 448 (no lower clamp: an activation's block scale may round to a subnormal or to zero,
as the serving kernel's `__nv_fp8_e4m3` conversion does), E2M1 encoding by the same decision bounds as
`e2m1.encode_e2m1` (NaN -> magnitude 0, +-inf -> 6), the decoded value times `e4m3 * input_scale`, and the final
round to bf16 half-even as torch's cast. Compiled with `enable_fp_fusion=False` so no product is fused into an
add. A block holding a NaN is all NaN, as in the reference. Tests: `tests/numerics/test_activation_kernel.py`
(Triton's CPU interpreter here; the compiled kernel on CUDA).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .constants import E2M1_MAX, E4M3_MAX, NVFP4_BLOCK_SIZE
from .e2m1 import _DECISION_BOUNDS
from .methods.search.triton_kernels import _e2m1_value, _e4m3_value, e4m3_bits_rn

__all__ = ["fake_quantize_activation_fused", "FUSED_DTYPES"]

# 16-blocks per program (one per thread with 4 warps), as the conversion's kernels.
_BLOCKS_PER_PROGRAM = 128
_COMPILE = {"enable_fp_fusion": False, "num_warps": 4}
# Activation dtypes the kernel reads and writes (the compute dtypes of the model stages).
FUSED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

_ONE_SIXTH = tl.constexpr(1.0 / E2M1_MAX)  # fp32(1/6), as torch multiplies an fp32 tensor by the Python float
_SCALE_MAX = tl.constexpr(E4M3_MAX)
_B0, _B1, _B2, _B3, _B4, _B5, _B6 = (tl.constexpr(b) for b in _DECISION_BOUNDS)


@triton.jit
def _bf16_bits_rn(x):
    """fp32 -> bf16 bit pattern (int16), round to nearest even: torch's cast, spelled out because Triton's CPU
    interpreter truncates in `.to(tl.bfloat16)` (the compiled cast rounds to nearest even and gives the same)."""
    xb = x.to(tl.int32, bitcast=True)
    rounded = ((xb + 0x7FFF + ((xb >> 16) & 1)) >> 16).to(tl.int16)
    # NaN as torch casts it (0x7FC0): the compiled kernels' NaN is 0x7FFFFFFF, which the rounding add carries
    # into the sign bit (-0.0)
    return tl.where(x != x, 0x7FC0, rounded).to(tl.int16)


@triton.jit
def _fake_quantize_kernel(x_ptr, out_ptr, input_scale_ptr, num_blocks, BLOCKS: tl.constexpr, BF16: tl.constexpr):
    pid = tl.program_id(0)
    # int64 offsets: a chunk's SwiGLU output (65,536 tokens x 8 slots x 2048) is 2**30 values
    block = pid.to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    live = block < num_blocks
    offsets = block[:, None] * 16 + tl.arange(0, 16)[None, :]
    x = tl.load(x_ptr + offsets, mask=live[:, None], other=0.0).to(tl.float32)
    input_scale = tl.load(input_scale_ptr)
    global_scale = tl.div_rn(1.0, input_scale)
    amax = tl.max(tl.abs(x), axis=1)
    sf_value = global_scale * (amax * _ONE_SIXTH)
    sf = _e4m3_value(e4m3_bits_rn(tl.minimum(sf_value, _SCALE_MAX)))
    output_scale = tl.div_rn(1.0, sf * tl.div_rn(1.0, global_scale))
    output_scale = tl.where(amax != 0.0, output_scale, 0.0)
    v = x * output_scale[:, None]
    a = tl.abs(v)
    index = ((a > _B0).to(tl.int32) + (a > _B1).to(tl.int32) + (a > _B2).to(tl.int32) + (a > _B3).to(tl.int32)
             + (a > _B4).to(tl.int32) + (a > _B5).to(tl.int32) + (a > _B6).to(tl.int32))
    # |code value| * (e4m3 * input_scale), then the code's sign as a bit: a compiled `-x` is `0 - x`, which
    # turns the reference's -0.0 (a negative value rounded to zero keeps its sign bit) into +0.0.
    magnitude = _e2m1_value(index) * (sf * input_scale)[:, None]
    sign = (v < 0.0).to(tl.int32) << 31
    out = (magnitude.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    has_nan = tl.max((x != x).to(tl.int32), axis=1) > 0
    out = tl.where(has_nan[:, None], float("nan"), out)
    if BF16:
        tl.store(out_ptr + offsets, _bf16_bits_rn(out), mask=live[:, None])
    else:
        tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=live[:, None])


def fake_quantize_activation_fused(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """`fake_quantize_activation_nvfp4(x, input_scale).to(x.dtype)` in one kernel (x: CUDA, or any device under
    `TRITON_INTERPRET=1`; last dimension a multiple of 16; `input_scale` a one-element fp32 tensor on x's device).
    No host synchronisation."""
    if x.shape[-1] % NVFP4_BLOCK_SIZE:
        raise ValueError(f"activation width {x.shape[-1]} is not a multiple of {NVFP4_BLOCK_SIZE}")
    if x.dtype not in FUSED_DTYPES:
        raise ValueError(f"the fused activation kernel takes {FUSED_DTYPES}, got {x.dtype}")
    x = x.contiguous()
    scale = torch.as_tensor(input_scale, dtype=torch.float32, device=x.device).reshape(1)
    out = torch.empty_like(x)
    num_blocks = x.numel() // NVFP4_BLOCK_SIZE
    if num_blocks:
        grid = (triton.cdiv(num_blocks, _BLOCKS_PER_PROGRAM),)
        bf16 = x.dtype == torch.bfloat16
        target = out.view(torch.int16) if bf16 else out
        _fake_quantize_kernel[grid](x, target, scale, num_blocks, BLOCKS=_BLOCKS_PER_PROGRAM, BF16=bf16, **_COMPILE)
    return out
