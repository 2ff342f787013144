"""The three tensors one NVFP4 linear becomes in Model Optimizer's HF export, and their bytes on disk.

Used by the plan for routed experts and for shared experts quantized from BF16 (`--shared-experts nvfp4`): both
write the same triple, so its names, dtypes and shapes are stated once.
"""

from __future__ import annotations

import torch

from ..numerics.constants import NVFP4_BLOCK_SIZE

FP32_BYTES = 4
NIBBLES_PER_BYTE = 2  # two E2M1 codes per uint8 (low nibble first)
E4M3_BYTES = 1


def nvfp4_output_specs(module: str, out_features: int, in_features: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """`{name: (dtype, shape)}` of `module`'s `weight` (packed E2M1), `weight_scale` (E4M3 per 16 inputs) and
    `weight_scale_2` (FP32, 0-d)."""
    o, i = out_features, in_features
    return {
        f"{module}.weight": (torch.uint8, (o, i // NIBBLES_PER_BYTE)),
        f"{module}.weight_scale": (torch.float8_e4m3fn, (o, i // NVFP4_BLOCK_SIZE)),
        f"{module}.weight_scale_2": (torch.float32, ()),
    }


def nvfp4_output_bytes(out_features: int, in_features: int) -> int:
    """Bytes of those three tensors."""
    o, i = out_features, in_features
    return o * i // NIBBLES_PER_BYTE + o * i // NVFP4_BLOCK_SIZE * E4M3_BYTES + FP32_BYTES


class Nvfp4Outputs:
    """For a planned matrix with `module`, `out_features` and `in_features` (routed or shared expert): the output
    tensors it becomes and their bytes."""

    module: str
    out_features: int
    in_features: int

    def output_specs(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        return nvfp4_output_specs(self.module, self.out_features, self.in_features)

    @property
    def output_bytes(self) -> int:
        return nvfp4_output_bytes(self.out_features, self.in_features)
