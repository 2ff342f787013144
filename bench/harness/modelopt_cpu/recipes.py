"""Model Optimizer 0.47's NVFP4 recipes on the routed experts of the HF model, exported into our checkpoint.

Per recipe: the config's quant_cfg is restricted to the routed experts (its weight and input quantizer entries
re-targeted to `*mlp.experts.*`; everything else stays disabled, as in our checkpoints: attention, dense MLP,
shared experts, router, lm_head unquantized), `mtq.quantize` runs with a forward loop over the calibration
sequences our calibrate uses, under `modelopt_on_cpu()`. Then Model Optimizer's own exporter for fused experts
(`_export_fused_experts`) writes each expert's NVFP4 `weight`, `weight_scale`, `weight_scale_2` and `input_scale`,
and those replace the routed-expert tensors of a copy of a converted, calibrated checkpoint (every other tensor
is the same INT4-derived one). validate then measures it exactly as it measures our methods: W4A16 (weights
only) and W4A4 with SGLang's flashinfer input scales (one per layer for gate/up and one for down, the max over
the experts; Model Optimizer's fused-experts plugin already shares one input quantizer per layer for each).
"""

from __future__ import annotations

import copy
import json
import shutil
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import torch

from kimi_nvfp4.checkpoint.reader import CheckpointReader

from .patch import modelopt_on_cpu

RECIPES = (
    "NVFP4_DEFAULT_CFG",
    "NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG",
    "NVFP4_W4A4_WEIGHT_LOCAL_HESSIAN_CFG",
    "NVFP4_FOUR_OVER_SIX_CFG",
    "NVFP4_AWQ_LITE_CFG",
)
ROUTED_EXPERTS = "*mlp.experts.*"  # transformers' fused experts module; not mlp.shared_experts
ENABLING_PATTERNS = {"*weight_quantizer": "weight_quantizer", "*input_quantizer": "input_quantizer"}
EXPORTED = ("weight", "weight_scale", "weight_scale_2", "input_scale")
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
INDEX_FILE = "model.safetensors.index.json"


def experts_only_config(recipe: str) -> dict:
    """The recipe's config with its enabling quantizer entries re-targeted to the routed experts."""
    import modelopt.torch.quantization as mtq

    cfg = copy.deepcopy(getattr(mtq, recipe))
    entries = cfg["quant_cfg"]
    found = set()
    for entry in entries:
        suffix = ENABLING_PATTERNS.get(entry.get("quantizer_name"))
        if suffix is not None:
            entry["quantizer_name"] = ROUTED_EXPERTS + suffix
            found.add(suffix)
    if found != set(ENABLING_PATTERNS.values()):
        raise ValueError(f"{recipe}: expected weight and input quantizer entries, found {sorted(found)}")
    return cfg


@torch.no_grad()
def quantize_experts(model: torch.nn.Module, recipe: str, sequences: Sequence[torch.Tensor]) -> torch.nn.Module:
    """`mtq.quantize` of the routed experts with `recipe`, calibrated on `sequences` (one forward each)."""
    import modelopt.torch.quantization as mtq

    def forward_loop(m: torch.nn.Module) -> None:
        for seq in sequences:
            m(seq[None])

    with modelopt_on_cpu():
        return mtq.quantize(model, experts_only_config(recipe), forward_loop=forward_loop)


def quantized_expert_modules(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    from modelopt.torch.quantization.plugins.huggingface import _is_quant_fused_experts_module

    out = {}
    for i, layer in enumerate(model.model.layers):
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None:
            if not _is_quant_fused_experts_module(experts):
                raise TypeError(f"layer {i}: Model Optimizer did not wrap {type(experts).__name__} as fused experts")
            out[i] = experts
    return out


@torch.no_grad()
def export_experts(model: torch.nn.Module) -> dict[tuple[int, int, str], dict[str, torch.Tensor]]:
    """Model Optimizer's NVFP4 export of every routed expert: {(layer, expert, projection): tensors}, plus the
    largest difference between the export's dequantized weight and the quantizer's fake-quant output."""
    from modelopt.torch.export.moe_utils import _export_fused_experts

    out = {}
    for layer, module in quantized_expert_modules(model).items():
        _export_fused_experts(module, torch.float32)
        for e in range(module.num_experts):
            for proj in PROJECTIONS:
                sub = getattr(getattr(module, str(e)), proj)
                out[(layer, e, proj)] = {k: getattr(sub, k).detach().cpu() for k in EXPORTED if hasattr(sub, k)}
    return out


def write_checkpoint(base: Path, out: Path, exported: dict, expert_name: str) -> dict:
    """Copy `base` (converted + calibrated) to `out`, replacing each routed expert's NVFP4 tensors by
    `exported`; `expert_name` formats `(layer, expert, projection)` into the checkpoint's module name.
    Returns what was replaced (counts; dtype/shape mismatches raise)."""
    from safetensors.torch import load_file, save_file

    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(base, out)
    reader = CheckpointReader(out)
    wanted: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    for key, tensors in exported.items():
        for suffix, value in tensors.items():
            name = f"{expert_name.format(*key)}.{suffix}"
            wanted[reader.tensors[name].file][name] = value
    replaced = 0
    for file, updates in wanted.items():
        tensors = load_file(str(out / file))
        for name, value in updates.items():
            old = tensors[name]
            value = value.reshape(old.shape) if value.numel() == old.numel() else value
            if value.dtype != old.dtype or value.shape != old.shape:
                raise ValueError(f"{name}: export gives {value.dtype}{tuple(value.shape)}, checkpoint holds "
                                 f"{old.dtype}{tuple(old.shape)}")
            tensors[name] = value.contiguous()
            replaced += 1
        tmp = out / f"{file}.tmp"
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        tmp.replace(out / file)
    reader.close()
    return {"tensors_replaced": replaced, "files": len(wanted)}
