"""NVFP4 tensors: Model Optimizer's weight format and the activation rounding of Blackwell W4A4 kernels.

Weight dequantization (docs/formats.md §2):
`W[o, i] = e2m1(code[o, i]) * float(weight_scale[o, i // 16]) * weight_scale_2`.
`quantize_nvfp4` reproduces `NVFP4QTensor.quantize` (modelopt/torch/quantization/qtensor/nvfp4_tensor.py)
bit for bit, operation by operation, because every fp32 rounding step can flip a code:

    weight_scale_2 = amax(|W|) / (6 * 448)                    get_weights_scaling_factor_2
    block          = block_amax / (6 * weight_scale_2)        get_weights_scaling_factor (product first)
    block[block == 0] = 1.0; clamp [2**-9, 448]; cast e4m3 RNE  _cast_per_block_scale_to_fp8
    codes          = e2m1(W / (float(block) * weight_scale_2))  quantize: product first, one division
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from .constants import (
    E2M1_MAX,
    E4M3_MAX,
    NVFP4_BLOCK_SIZE,
    NVFP4_TENSOR_SCALE_DENOMINATOR,
)
from .e2m1 import decode_e2m1, decode_e2m1_packed, encode_e2m1, pack_e2m1, unpack_e2m1
from .e4m3 import round_block_scale_to_e4m3

__all__ = [
    "NVFP4Tensor",
    "amax_block_scales",
    "dequantize_nvfp4",
    "encode_with_block_scales",
    "fake_quantize_activation_nvfp4",
    "quantize_nvfp4",
    "tensor_scale_from_amax",
    "tensor_scales_from_amax",
]

# Model Optimizer gives an all-zero block the scale 1.0 (`per_block_scale[per_block_scale == 0] = 1.0`).
ZERO_BLOCK_SCALE = 1.0


@dataclass
class NVFP4Tensor:
    """One NVFP4 linear weight as Model Optimizer exports it (and SGLang `modelopt_fp4` loads it)."""

    weight: torch.Tensor  # uint8 [out, in/2], even input column in the low nibble
    weight_scale: torch.Tensor  # float8_e4m3fn [out, in/16], row-major (not swizzled)
    weight_scale_2: torch.Tensor  # float32 0-d

    def __post_init__(self) -> None:
        if self.weight.dtype != torch.uint8 or self.weight.ndim != 2:
            raise ValueError(f"NVFP4 weight must be 2-d uint8, got {self.weight.dtype} {tuple(self.weight.shape)}")
        if self.weight_scale.dtype != torch.float8_e4m3fn:
            raise ValueError(f"NVFP4 weight_scale must be float8_e4m3fn, got {self.weight_scale.dtype}")
        out_features, half_in = self.weight.shape
        expected = (out_features, half_in * 2 // NVFP4_BLOCK_SIZE)
        if tuple(self.weight_scale.shape) != expected:
            raise ValueError(f"NVFP4 weight_scale shape {tuple(self.weight_scale.shape)}, expected {expected}")
        if self.weight_scale_2.dtype != torch.float32 or self.weight_scale_2.ndim != 0:
            raise ValueError("NVFP4 weight_scale_2 must be a float32 0-d tensor")

    @property
    def shape(self) -> tuple[int, int]:
        """Logical `[out, in]` of the dequantized weight."""
        return self.weight.shape[0], self.weight.shape[1] * 2

    def to(self, device: torch.device | str) -> NVFP4Tensor:
        return NVFP4Tensor(self.weight.to(device), self.weight_scale.to(device), self.weight_scale_2.to(device))


def tensor_scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """weight_scale_2 (or input_scale) = amax / (6 * 448), float32 0-d.

    An all-zero tensor (amax 0) would give 0 and then 0/0 block scales (NaN in Model Optimizer); we use
    the scale of amax 1 instead so that every block gets the zero-block scale 1.0 and codes 0.
    """
    return tensor_scales_from_amax(torch.as_tensor(amax).reshape(()))


def tensor_scales_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """`tensor_scale_from_amax` elementwise (float32, same shape), for many scale groups at once."""
    amax = amax.to(torch.float32)
    amax = torch.where(amax > 0, amax, torch.ones_like(amax))
    return divide_exactly(amax, NVFP4_TENSOR_SCALE_DENOMINATOR)


def divide_exactly(numerator: torch.Tensor, denominator: float) -> torch.Tensor:
    """`numerator / denominator` correctly rounded on every device.

    On CUDA, PyTorch turns division by a CPU scalar into multiplication by its reciprocal
    (aten/src/ATen/native/cuda/BinaryDivTrueKernel.cu, `div_true_kernel_cuda`: "if the second argument is
    a CPU scalar, compute a * reciprocal(b)"), which can differ from the CPU's true division in the last
    bit. A device tensor as divisor keeps the IEEE division, so CPU and CUDA write the same scale bytes.
    """
    return numerator / torch.full_like(numerator, denominator)


def _check_weight(w: torch.Tensor) -> None:
    if w.dtype != torch.float32 or w.ndim != 2:
        raise ValueError(f"expected a 2-d float32 weight, got {w.dtype} {tuple(w.shape)}")
    if w.shape[1] % NVFP4_BLOCK_SIZE:
        raise ValueError(f"input dimension {w.shape[1]} is not a multiple of the NVFP4 block {NVFP4_BLOCK_SIZE}")


def _blocks(w: torch.Tensor) -> torch.Tensor:
    return w.reshape(w.shape[0], w.shape[1] // NVFP4_BLOCK_SIZE, NVFP4_BLOCK_SIZE)


def amax_block_scales(w: torch.Tensor, weight_scale_2: torch.Tensor) -> torch.Tensor:
    """Model Optimizer's default block scales: e4m3(clamp(block_amax / (6 * weight_scale_2))), zero -> 1.0."""
    _check_weight(w)
    block_amax = _blocks(w).abs().amax(dim=-1)
    scale = block_amax / (E2M1_MAX * weight_scale_2.to(w.device))
    scale = torch.where(scale == 0, torch.full_like(scale, ZERO_BLOCK_SCALE), scale)
    return round_block_scale_to_e4m3(scale)


def encode_with_block_scales(w: torch.Tensor, block_scale: torch.Tensor, weight_scale_2: torch.Tensor) -> torch.Tensor:
    """E2M1 codes uint8 `[out, in]` of `w / (float(block_scale) * weight_scale_2)` (product first, as ModelOpt)."""
    divisor = block_scale.to(torch.float32) * weight_scale_2.to(w.device)
    return encode_e2m1((_blocks(w) / divisor.unsqueeze(-1)).reshape(w.shape))


def quantize_nvfp4(
    w_fp32: torch.Tensor,
    weight_scale_2: torch.Tensor | None = None,
    block_scale: torch.Tensor | None = None,
) -> NVFP4Tensor:
    """Quantize a float32 `[out, in]` weight; bit-identical to `NVFP4QTensor.quantize(w, 16, ...)`.

    `weight_scale_2` defaults to amax/(6*448) of `w` (pass a shared one for gate/up); `block_scale`
    (float8_e4m3fn `[out, in/16]`) defaults to Model Optimizer's amax rule.
    """
    _check_weight(w_fp32)
    if weight_scale_2 is None:
        weight_scale_2 = tensor_scale_from_amax(w_fp32.abs().amax() if w_fp32.numel() else torch.tensor(0.0))
    weight_scale_2 = weight_scale_2.to(device=w_fp32.device, dtype=torch.float32).reshape(())
    if block_scale is None:
        block_scale = amax_block_scales(w_fp32, weight_scale_2)
    elif block_scale.dtype != torch.float8_e4m3fn:
        raise ValueError(f"block_scale must be float8_e4m3fn, got {block_scale.dtype}")
    codes = encode_with_block_scales(w_fp32, block_scale, weight_scale_2)
    return NVFP4Tensor(pack_e2m1(codes), block_scale, weight_scale_2)


_E4M3_BY_BITS: dict[torch.device, torch.Tensor] = {}


def _e4m3_to_fp32_by_lookup(scale: torch.Tensor) -> torch.Tensor:
    """`scale.to(torch.float32)` for float8_e4m3fn via a 256-entry table of that very cast (exact, NaN
    included): the CPU converts float8 element by element, ~3x slower than the lookup."""
    if scale.device not in _E4M3_BY_BITS:
        bits = torch.arange(1 << 8, dtype=torch.int32).to(torch.uint8)
        _E4M3_BY_BITS[scale.device] = bits.view(torch.float8_e4m3fn).to(torch.float32).to(scale.device)
    index = scale.view(torch.uint8).reshape(-1).to(torch.int32)
    return torch.index_select(_E4M3_BY_BITS[scale.device], 0, index).view(scale.shape)


def dequantize_nvfp4(t: NVFP4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`e2m1 * (float(weight_scale) * weight_scale_2)`, as `NVFP4QTensor.dequantize` (scale product first).

    The CPU decodes byte pairs by lookup (`decode_e2m1_packed`: the same fp32 values, ~4x faster there).
    """
    if t.weight.device.type == "cpu" and sys.byteorder == "little":
        values = decode_e2m1_packed(t.weight)
        block_scale = _e4m3_to_fp32_by_lookup(t.weight_scale)
    else:
        values = decode_e2m1(unpack_e2m1(t.weight))
        block_scale = t.weight_scale.to(torch.float32)
    scale = block_scale * t.weight_scale_2.to(t.weight.device)
    return (_blocks(values) * scale.unsqueeze(-1)).reshape(values.shape).to(dtype)


def fake_quantize_activation_nvfp4(x: torch.Tensor, input_scale: torch.Tensor | float) -> torch.Tensor:
    """What a Blackwell W4A4 GEMM sees of activations `x [..., k]` (k % 16 == 0), dequantized to fp32.

    Emulates TensorRT-LLM's `cvt_warp_fp16_to_fp4` (flashinfer csrc/nv_internal/tensorrt_llm/kernels/
    quantization_utils.cuh, non-UE8M0 branch), which SGLang's modelopt_fp4 path calls with
    `SFScale = 1 / input_scale`:
        SFValue     = SFScaleVal * (vecMax * rcp(6))        -> __nv_fp8_e4m3 (RN, saturating)
        outputScale = rcp(float(SFValue_e4m3) * rcp(SFScaleVal))   (0 for an all-zero block)
        code        = cvt.rn.satfinite.e2m1x2.f32(x * outputScale)
    and the GEMM multiplies back by the block scale and `input_scale` (its alpha). The kernel's
    `rcp.approx.ftz` is approximated here by IEEE division (exact on both devices); `x` should already
    be in the serving dtype (bf16 values) for a faithful emulation.
    """
    if x.shape[-1] % NVFP4_BLOCK_SIZE:
        raise ValueError(f"activation width {x.shape[-1]} is not a multiple of {NVFP4_BLOCK_SIZE}")
    x32 = x.to(torch.float32)
    blocks = x32.reshape(*x32.shape[:-1], x32.shape[-1] // NVFP4_BLOCK_SIZE, NVFP4_BLOCK_SIZE)
    input_scale = torch.as_tensor(input_scale, dtype=torch.float32, device=x.device).reshape(())
    global_scale = 1.0 / input_scale  # SFScaleVal
    block_amax = blocks.abs().amax(dim=-1)
    sf_value = global_scale * (block_amax * (1.0 / E2M1_MAX))
    # __nv_fp8_e4m3(float) saturates to 448 (satfinite); clamping first gives the same byte.
    sf_e4m3 = sf_value.clamp(max=E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)
    output_scale = 1.0 / (sf_e4m3 * (1.0 / global_scale))
    output_scale = torch.where(block_amax != 0, output_scale, torch.zeros_like(output_scale))
    codes = encode_e2m1(blocks * output_scale.unsqueeze(-1))
    dequantized = decode_e2m1(codes) * (sf_e4m3 * input_scale).unsqueeze(-1)
    return dequantized.reshape(x32.shape)
