"""Pure-torch NVFP4 fake quantization, bit-exact with Model Optimizer 0.47's Triton kernels.

Model Optimizer runs NVFP4 fake quantization only through Triton kernels that it loads when CUDA is present
(`modelopt/torch/kernels/quantization/gemm/__init__.py`), so on CPU every NVFP4 recipe stops at its first
quantizer call. These are the same computations in torch, step for step in fp32:

- `static_blockwise_fp4_fake_quant` (fp4_kernel.py; the static per-block amax quantizer of the MSE /
  local-Hessian / four-over-six recipes): the block scales come from Model Optimizer's own pure-torch
  `compute_fp4_scales`; each block then goes through `nvfp4_scalar_quant` (common/nvfp4_quant.py).
- `fp4_fake_quant_block` (fp4_kernel_hopper.py; the dynamic quantizer of the max / AWQ-lite recipes and
  every input quantizer): per 16-element block, `fp8_quantize_scale(amax16, global_amax / (6 * 448))`,
  1.0 where that is below 1e-5, then the same E2M1 rounding.

Checks (tests/bench/test_modelopt_cpu_fake_quant.py): the static kernel bit-exact against Model Optimizer's
Triton kernel run by Triton's CPU interpreter (numpy, IEEE fp32: the kernel's logic; the compiled CUDA arithmetic
is not checked here). The dynamic kernel addresses memory with `tl.make_block_ptr`, which Triton 3.9's interpreter
no longer implements (that check skips, saying so); it is checked bit-exact against Model Optimizer's pure-torch
`NVFP4QTensor` quantize -> dequantize instead. (Calling its `fp8_quantize_scale` jit function alone under the
interpreter is no oracle either: the interpreter's fp32 -> E4M3 cast rounds wrongly, e.g. 1.98 -> 1.0, where the
GPU's `cvt.rn.satfinite` and torch round to nearest even.)
"""

from __future__ import annotations

import torch

E2M1_MAX = 6.0
E4M3_MAX = 448.0
# fp4_kernel_hopper.fp4_fake_quant_kernel: a non-positive global scale is replaced by this
GLOBAL_SCALE_FLOOR = 1e-12
# fp4_kernel_hopper.fp4_fake_quant_kernel: quantized block scales below this become 1.0
BLOCK_SCALE_FLOOR = 1e-5
DEFAULT_BLOCK_SIZE = 16

# nvfp4_quant.fp4_round_magnitude: (upper bound, inclusive?, value) of each E2M1 magnitude's interval; the
# midpoints between neighbours round to the even code (<= at even-code upper bounds, < at odd ones).
_E2M1_INTERVALS = ((0.25, True, 0.0), (0.75, False, 0.5), (1.25, True, 1.0), (1.75, False, 1.5),
                   (2.5, True, 2.0), (3.5, False, 3.0), (5.0, True, 4.0))
_E2M1_TOP = 6.0


def fp4_round_magnitude(abs_scaled: torch.Tensor) -> torch.Tensor:
    """`|x| / scale` rounded to the nearest E2M1 magnitude, as the kernel's nested `tl.where` does (NaN -> 6)."""
    out = torch.full_like(abs_scaled, _E2M1_TOP)
    for bound, inclusive, value in reversed(_E2M1_INTERVALS):
        below = abs_scaled <= bound if inclusive else abs_scaled < bound
        out = torch.where(below, torch.tensor(value, dtype=out.dtype), out)
    return out


def nvfp4_scalar_quant(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """nvfp4_quant.nvfp4_scalar_quant on fp32 `x` with a broadcastable fp32 `scale` (zero scale -> +0)."""
    zero_scale = scale == 0.0
    bad = zero_scale | torch.isnan(scale) | (scale.abs() == float("inf"))
    scale_safe = torch.where(bad, torch.ones_like(scale), scale)
    rescaled = fp4_round_magnitude(x.abs() / scale_safe) * scale_safe
    signed = torch.where(x >= 0, rescaled, -rescaled)
    return torch.where(zero_scale, torch.zeros_like(signed), signed)


def static_blockwise_fp4_fake_quant(
    x: torch.Tensor,
    amax: torch.Tensor,
    global_amax: torch.Tensor | None = None,
    quantize_block_scales: bool = True,
    fp8_max_for_normalization: float = E4M3_MAX,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """fp4_kernel.static_blockwise_fp4_fake_quant: one block per entry of `amax` (any shape), blocks are the
    consecutive elements of `x` flattened."""
    from modelopt.torch.kernels.quantization.gemm.fp4_kernel import compute_fp4_scales

    blocks = amax.numel()
    if x.numel() % blocks != 0:
        raise ValueError(f"x.numel() ({x.numel()}) is not divisible by amax.numel() ({blocks})")
    scale = compute_fp4_scales(amax, global_amax, quantize_block_scales, fp8_max_for_normalization)
    flat = x.contiguous().reshape(blocks, -1).to(torch.float32)
    y = nvfp4_scalar_quant(flat, scale.contiguous().reshape(blocks, 1).to(torch.float32))
    return y.to(out_dtype or x.dtype).reshape(x.shape)


def fp8_quantize_scale(block_amax: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """nvfp4_quant.fp8_quantize_scale: `e4m3(min(amax / (6 * global_scale), 448)) * global_scale`."""
    in_range = block_amax / (E2M1_MAX * global_scale)
    saturated = torch.minimum(in_range, torch.tensor(E4M3_MAX, dtype=torch.float32))
    return saturated.to(torch.float8_e4m3fn).to(torch.float32) * global_scale


def fp4_fake_quant_block(x: torch.Tensor, global_amax: torch.Tensor, block_size: int = DEFAULT_BLOCK_SIZE,
                         **_launch: object) -> torch.Tensor:
    """fp4_kernel_hopper.fp4_fake_quant_block: dynamic per-block scales along the last dim (a ragged last
    block is zero-padded, as the kernel's boundary-checked load pads it)."""
    shape, dtype = x.shape, x.dtype
    rows = x.reshape(-1, shape[-1]).to(torch.float32)
    pad = (-rows.shape[1]) % block_size
    if pad:
        rows = torch.nn.functional.pad(rows, (0, pad))
    blocks = rows.reshape(rows.shape[0], -1, block_size)
    global_scale = global_amax.to(torch.float32) / (E2M1_MAX * E4M3_MAX)
    global_scale = torch.where(global_scale > 0.0, global_scale, torch.tensor(GLOBAL_SCALE_FLOOR))
    block_max = blocks.abs().amax(dim=-1, keepdim=True)
    scale = fp8_quantize_scale(block_max, global_scale)
    scale = torch.where(scale >= BLOCK_SCALE_FLOOR, scale, torch.ones_like(scale))
    rescaled = fp4_round_magnitude(blocks.abs() / scale) * scale
    y = torch.where(blocks >= 0, rescaled, -rescaled).reshape(rows.shape)[:, : shape[-1]]
    return y.to(dtype).reshape(shape)
