"""The linears of the reference model: BF16, INT4 (source) and NVFP4 (emulating the serving kernels).

Every linear keeps its weight in the form the checkpoint stores it (bf16 -> compute dtype, INT4
packed codes + group scales, NVFP4 codes + E4M3 block scales + fp32 tensor scale) and dequantizes
on use, so one K2.6 MoE layer costs ~4.5 bits per expert weight in memory, not 32.

NVFP4 emulation (what SGLang's `modelopt_fp4` kernels compute for a W4A4 linear on Blackwell):
- weights: `W = e2m1(code) * e4m3(weight_scale[o, i//16]) * weight_scale_2` (ModelOpt HF format);
- activations (W4A4 only): per row, per 16 consecutive input elements, a dynamic E4M3 block scale
  `e4m3(amax16 / 6 / input_scale)`, elements rounded to E2M1 (round-to-nearest-even, saturating),
  i.e. flashinfer/TRT-LLM `cvt_warp_fp16_to_fp4` (quantization.cuh: `SFValue = SFScaleVal *
  vecMax * reciprocal(6)`, `cvt.rn.satfinite.e2m1x2.f32`), with `SFScaleVal = 1 / input_scale`
  (sglang modelopt_quant.py `ModelOptFp4LinearMethod.process_weights_after_loading`:
  `input_scale_inv = 1 / input_scale`); then the matmul of the two dequantized operands, which equals
  the kernel's `alpha = input_scale * weight_scale_2` epilogue up to fp32 summation order.
- W4A16 (Hopper/Ampere Marlin path): weights as above, activations untouched.

`linear(x) == linear.matmul(linear.quantize_input(x))`: callers that feed many linears with the same
input quantization (`input_quantizer()`) quantize once and call `matmul` on each (the fake quantization
is row-local, so gathering rows of a quantized chunk is bit-identical to quantizing the rows).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from enum import Enum
from typing import Any

import torch

from ..numerics.int4 import dequantize_int4
from ..numerics.nvfp4 import (
    NVFP4Tensor,
    dequantize_nvfp4,
    fake_quantize_activation_nvfp4,
)
from ..numerics.triton_support import triton_module
from .batch_invariant import linear_rows


# On CUDA, W4A4 activations go through the fused Triton kernel (numerics/activation_kernel.py: the same bits in
# one pass instead of ~20); False keeps the reference path everywhere (benchmarks compare the two).
USE_FUSED_ACTIVATIONS = True


# On CUDA, stored matrices are dequantized by one fused Triton kernel each (numerics/dequant_kernels.py: the same
# bits); False keeps the reference path.
USE_FUSED_DEQUANTIZATION = True


def _fused_dequant(device: torch.device, dtype: torch.dtype):
    """The fused kernels' module when they serve a matrix on `device` in `dtype`, else None."""
    if device.type != "cuda" or not USE_FUSED_DEQUANTIZATION:
        return None
    kernels = triton_module("dequant_kernels")
    return kernels if kernels is not None and dtype in kernels.DEQUANT_DTYPES else None


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class ActivationMode(str, Enum):
    """How an NVFP4 linear treats its input: Blackwell W4A4, or Marlin W4A16 (weights only)."""

    W4A4 = "w4a4"
    W4A16 = "w4a16"


class Linear(ABC):
    """`y = x @ W.T` for one checkpoint linear (no bias: K2 has none)."""

    def __init__(self, module: str, out_features: int, in_features: int, dtype: torch.dtype):
        self.module = module  # checkpoint module name without the text prefix, e.g. "self_attn.o_proj"
        self.out_features = out_features
        self.in_features = in_features
        self.dtype = dtype
        self._cached: torch.Tensor | None = None

    @abstractmethod
    def _dequantize(self) -> torch.Tensor:
        """The weight `[out, in]` in `self.dtype`, on the weight's device."""

    def weight(self) -> torch.Tensor:
        return self._cached if self._cached is not None else self._dequantize()

    def materialize(self) -> None:
        """Keep the dequantized weight (costs `dequantized_bytes()`); a second call is free."""
        if self._cached is None:
            self._cached = self._dequantize()

    @property
    def materialized(self) -> bool:
        return self._cached is not None

    def drop_materialized(self) -> None:
        """Forget the dequantized copy (the stored form stays; the next use dequantizes again)."""
        self._cached = None

    def dequantized_bytes(self) -> int:
        """Memory `materialize()` adds: the weight in the compute dtype (0 when already dense/cached)."""
        if self._cached is not None:
            return 0
        return self.out_features * self.in_features * self.dtype.itemsize

    @abstractmethod
    def stored_bytes(self) -> int:
        """Bytes of the weight as loaded (before any `materialize`)."""

    def input_quantizer(self) -> torch.Tensor | None:
        """The static scale `quantize_input` uses, or None when it is the identity.

        Two linears with the same quantizer (the same tensor) quantize any input to the same bits.
        """
        return None

    def quantize_input(self, x: torch.Tensor) -> torch.Tensor:
        """What the serving kernel does to the activation before the matmul (identity unless W4A4)."""
        return x

    def matmul(self, xq: torch.Tensor) -> torch.Tensor:
        """The product with an input that already went through `quantize_input` (batch-invariant: each row as
        if alone, see batch_invariant.py)."""
        if xq.dim() != 2:
            return linear_rows(xq.reshape(-1, xq.shape[-1]), self.weight()).reshape(*xq.shape[:-1], -1)
        return linear_rows(xq, self.weight())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(self.quantize_input(x))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.module}, out={self.out_features}, in={self.in_features})"


class DenseLinear(Linear):
    """A BF16 (or fp32) checkpoint weight, held in the compute dtype."""

    def __init__(self, module: str, weight: torch.Tensor, dtype: torch.dtype):
        super().__init__(module, weight.shape[0], weight.shape[1], dtype)
        self._weight = weight.to(dtype)

    def _dequantize(self) -> torch.Tensor:
        return self._weight

    def materialize(self) -> None:  # already dense
        pass

    def dequantized_bytes(self) -> int:
        return 0

    def stored_bytes(self) -> int:
        return _nbytes(self._weight)


class Int4Linear(Linear):
    """compressed-tensors pack-quantized INT4 (group 32), dequantized exactly: `q * bf16 scale`."""

    def __init__(
        self, module: str, weight_packed: torch.Tensor, weight_scale: torch.Tensor, in_features: int, dtype: torch.dtype
    ):
        super().__init__(module, weight_packed.shape[0], in_features, dtype)
        self.weight_packed = weight_packed
        self.weight_scale = weight_scale

    def stored_bytes(self) -> int:
        return _nbytes(self.weight_packed) + _nbytes(self.weight_scale)

    def _dequantize(self) -> torch.Tensor:
        kernels = _fused_dequant(self.weight_packed.device, self.dtype)
        if kernels is not None and kernels.int4_whole_groups(self.weight_packed, self.in_features):
            return kernels.dequantize_int4_fused(self.weight_packed, self.weight_scale, self.in_features, self.dtype)
        return dequantize_int4(self.weight_packed, self.weight_scale, self.in_features).to(self.dtype)


class NVFP4Linear(Linear):
    """ModelOpt NVFP4 weight; in W4A4 mode the input is fake-quantized with the static `input_scale`."""

    def __init__(
        self,
        module: str,
        tensor: NVFP4Tensor,
        dtype: torch.dtype,
        input_scale: torch.Tensor | None = None,
        mode: ActivationMode = ActivationMode.W4A4,
    ):
        super().__init__(module, tensor.weight.shape[0], tensor.weight.shape[1] * 2, dtype)
        self.tensor = tensor
        # the Nvfp4Group the engine's loading rules were applied over (nvfp4_linears.py), if built there
        self.group: Any = None
        self.set_activations(mode, input_scale)

    def set_activations(self, mode: ActivationMode | str, input_scale: torch.Tensor | None) -> None:
        """Switch between W4A16 and W4A4 (or change the input scale) keeping the weight, and its
        dequantized copy if materialized: the weight does not depend on the activation mode."""
        mode = ActivationMode(mode)
        if mode is ActivationMode.W4A4 and input_scale is None:
            raise ValueError(f"{self.module}: W4A4 emulation needs an input_scale")
        self.mode = mode
        self.input_scale = input_scale

    def _dequantize(self) -> torch.Tensor:
        kernels = _fused_dequant(self.tensor.weight.device, self.dtype)
        if kernels is not None:
            return kernels.dequantize_nvfp4_fused(self.tensor, self.dtype)
        return dequantize_nvfp4(self.tensor, dtype=torch.float32).to(self.dtype)

    def stored_bytes(self) -> int:
        return _nbytes(self.tensor.weight) + _nbytes(self.tensor.weight_scale)

    def input_quantizer(self) -> torch.Tensor | None:
        return self.input_scale if self.mode is ActivationMode.W4A4 else None

    def quantize_input(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode is ActivationMode.W4A16 or x.shape[0] == 0:
            return x
        if x.is_cuda and USE_FUSED_ACTIVATIONS and (kernel := triton_module("activation_kernel")) is not None:
            if x.dtype in kernel.FUSED_DTYPES:
                return kernel.fake_quantize_activation_fused(x, self.input_scale)
        # fp32 rounding steps, then back to the compute dtype (bf16 when emulating the bf16 server:
        # the dequantized activation e2m1 * e4m3 * input_scale rounds once more, at most 2^-8 relative)
        return fake_quantize_activation_nvfp4(x, self.input_scale).to(x.dtype)
