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
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from enum import Enum

import torch
import torch.nn.functional as F

from ..numerics.int4 import dequantize_int4
from ..numerics.nvfp4 import (
    NVFP4Tensor,
    dequantize_nvfp4,
    fake_quantize_activation_nvfp4,
)


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
        """Keep the dequantized weight (whole-model generation on small models; costs 32 bits/weight)."""
        self._cached = self._dequantize()

    def quantize_input(self, x: torch.Tensor) -> torch.Tensor:
        """What the serving kernel does to the activation before the matmul (identity unless W4A4)."""
        return x

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.quantize_input(x), self.weight())

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


class Int4Linear(Linear):
    """compressed-tensors pack-quantized INT4 (group 32), dequantized exactly: `q * bf16 scale`."""

    def __init__(
        self, module: str, weight_packed: torch.Tensor, weight_scale: torch.Tensor, in_features: int, dtype: torch.dtype
    ):
        super().__init__(module, weight_packed.shape[0], in_features, dtype)
        self.weight_packed = weight_packed
        self.weight_scale = weight_scale

    def _dequantize(self) -> torch.Tensor:
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
        if mode is ActivationMode.W4A4 and input_scale is None:
            raise ValueError(f"{module}: W4A4 emulation needs an input_scale")
        self.tensor = tensor
        self.input_scale = input_scale
        self.mode = ActivationMode(mode)

    def _dequantize(self) -> torch.Tensor:
        return dequantize_nvfp4(self.tensor, dtype=torch.float32).to(self.dtype)

    def quantize_input(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode is ActivationMode.W4A16 or x.shape[0] == 0:
            return x
        return fake_quantize_activation_nvfp4(x, self.input_scale).to(x.dtype)
