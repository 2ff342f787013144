"""`convert --shared-experts nvfp4`: the BF16 shared experts of each MoE layer become NVFP4 linears.

NVIDIA's K2.6 NVFP4 keeps the shared experts BF16 (the default, `bf16`: they are copied byte for byte and
listed in the exclude list). Modal's B200 recipe quantizes them too; with `nvfp4` each shared-expert linear
is quantized from its BF16 weight (numerics/bf16_source.py) into Model Optimizer's tensors
(`weight` uint8, `weight_scale` e4m3, `weight_scale_2` f32), gate_proj and up_proj sharing one
`weight_scale_2` (SGLang fuses them into one w13 linear with one per-tensor scale), and they leave the
exclude list. calibrate then writes their `input_scale`s like any NVFP4 linear's.

Planning mirrors the routed experts: a group is quantized by every shard that holds one of its weights
(partners are read from other shards), and each output goes to the shard of its source weight.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from ..checkpoint.layout import PROJS, CheckpointLayout
from ..checkpoint.reader import TensorInfo
from ..checkpoint.tensor_io import ShardFiles
from ..errors import CheckpointError, UnsupportedCheckpointError
from ..numerics.bf16_source import Bf16ScaleRule, quantize_bf16_group
from ..numerics.constants import NVFP4_BLOCK_SIZE
from .nvfp4_outputs import FP32_BYTES, Nvfp4Outputs
from ..numerics.nvfp4 import NVFP4Tensor

SHARED_EXPERTS_MODULE = "mlp.shared_experts"
# gate_proj and up_proj share one weight_scale_2: SGLang fuses them into one w13 linear (routed experts: one
# `w13_weight_scale_2` per expert; the shared expert's dense merged linear keeps one scale).
SHARED_SCALE_PROJS = ("gate_proj", "up_proj")
_SOURCE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class SharedExperts(str, Enum):
    """What convert writes for the shared experts."""

    BF16 = "bf16"  # copied from the source (NVIDIA's K2.6 NVFP4 recipe)
    NVFP4 = "nvfp4"  # quantized from BF16 (Modal's B200 recipe)


@dataclass(frozen=True)
class DenseMatrix(Nvfp4Outputs):
    """One BF16 shared-expert linear of the source, quantized to NVFP4 by convert."""

    module: str  # e.g. language_model.model.layers.3.mlp.shared_experts.up_proj
    out_features: int
    in_features: int
    weight: TensorInfo


@dataclass(frozen=True)
class DenseScaleGroup:
    """Shared-expert matrices with one weight_scale_2: (gate_proj, up_proj) of a layer, or (down_proj,)."""

    matrices: tuple[DenseMatrix, ...]


def plan_shared_experts(layout: CheckpointLayout, tensors: dict[str, TensorInfo]) -> list[DenseScaleGroup]:
    """Every MoE layer's shared-expert linears, checked against the config, in scale groups.

    Raises CheckpointError for a missing tensor or a wrong dtype/shape, UnsupportedCheckpointError when an
    input dimension is not a multiple of the NVFP4 block.
    """
    c = layout.text
    if not c.n_shared_experts:
        return []
    width = c.moe_intermediate_size * c.n_shared_experts
    shapes = {"gate_proj": (width, c.hidden_size), "up_proj": (width, c.hidden_size), "down_proj": (c.hidden_size, width)}
    groups = []
    for layer in c.moe_layers:
        by_proj = {}
        for proj in PROJS:
            module = f"{layout.layer_prefix(layer)}{SHARED_EXPERTS_MODULE}.{proj}"
            name = f"{module}.weight"
            info = tensors.get(name)
            if info is None:
                raise CheckpointError(
                    f"missing from the checkpoint index (config promises {c.n_shared_experts} shared expert(s) in "
                    f"layer {layer})",
                    file="model.safetensors.index.json", tensor=name,
                )
            if info.dtype not in _SOURCE_DTYPES or tuple(info.shape) != shapes[proj]:
                raise CheckpointError(
                    f"is {info.dtype} {list(info.shape)}, expected a BF16 weight {list(shapes[proj])} (shared expert)",
                    file=info.file, tensor=name,
                )
            out_f, in_f = shapes[proj]
            if in_f % NVFP4_BLOCK_SIZE:
                raise UnsupportedCheckpointError(
                    f"input dimension {in_f} is not a multiple of the NVFP4 block {NVFP4_BLOCK_SIZE}; "
                    "use --shared-experts bf16", file=info.file, tensor=name,
                )
            by_proj[proj] = DenseMatrix(module, out_f, in_f, info)
        groups.append(DenseScaleGroup(tuple(by_proj[p] for p in SHARED_SCALE_PROJS)))
        groups.append(DenseScaleGroup((by_proj["down_proj"],)))
    return groups


def quantize_dense_group(
    group: DenseScaleGroup, files: ShardFiles, device: torch.device, rule: Bf16ScaleRule
) -> tuple[list[NVFP4Tensor], int]:
    """Read a group's BF16 weights and quantize them on `device`; (CPU results in order, bytes held)."""
    weights = [files.read(m.weight.file, m.weight.name).to(device) for m in group.matrices]
    quantized = quantize_bf16_group(weights, rule)
    # the source weights, their float32 copies (numerics temporaries aside) and the outputs
    elements = sum(m.out_features * m.in_features for m in group.matrices)
    held = sum(m.weight.nbytes + m.output_bytes for m in group.matrices) + elements * FP32_BYTES
    return [q.to("cpu") for q in quantized], held
