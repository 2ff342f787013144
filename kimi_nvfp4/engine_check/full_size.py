"""What `kimi-nvfp4 convert` (and calibrate) would write for the full Kimi K2.6, without writing 595 GB.

The meta-device engine check needs the converted checkpoint's config files and the name, dtype and
shape of every tensor, not their bytes. This module derives both from the same code the real path
uses: the INT4 tensor list of `synth`'s K2.6 preset (`plan_synthetic_checkpoint`), each routed expert
mapped to its NVFP4 tensors by convert's `ExpertMatrix.output_specs` (plus `input_scale` when W4A4),
the exclude list by `summarize_exclude_modules` over `bf16_linear_modules_in`, and the configs by
`build_modelopt_quant_config` / `rewrite_config_for_nvfp4`. The folder it writes holds config.json,
hf_quant_config.json and `tensor_listing.json`; no shard.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..checkpoint.layout import CheckpointLayout, parse_expert_name
from ..checkpoint.modelopt_config import (
    HF_QUANT_CONFIG_NAME,
    INPUT_SCALE_SUFFIX,
    ActivationScheme,
    bf16_linear_modules_in,
    build_modelopt_quant_config,
    rewrite_config_for_nvfp4,
    summarize_exclude_modules,
)
from ..checkpoint.reader import CONFIG_NAME, SAFETENSORS_DTYPES, TensorInfo
from ..checkpoint.writer import write_json_atomic
from ..convert.plan import ExpertMatrix
from ..synth.checkpoint import plan_synthetic_checkpoint
from ..synth.tensors import TensorSpec, vision_tensor_specs

LISTING_NAME = "tensor_listing.json"
K26_LAYERS = 61
K26_EXPERTS = 384
K26_VISION_LAYERS = 27  # MoonViT blocks in K2.6 (the synth preset keeps one, to stay small)
NO_FILE = ""  # a listed tensor lives in no shard
_DTYPE_NAMES = {v: k for k, v in SAFETENSORS_DTYPES.items()}
_INT4_SUFFIXES = ("weight_packed", "weight_scale", "weight_shape")


def _info(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> TensorInfo:
    numel = 1
    for n in shape:
        numel *= n
    return TensorInfo(name, NO_FILE, dtype, tuple(shape), numel * torch.empty((), dtype=dtype).element_size())


def nvfp4_listing(specs: list[TensorSpec], scheme: ActivationScheme) -> dict[str, TensorInfo]:
    """The converted checkpoint's tensors for the INT4 source tensors `specs`."""
    out: dict[str, TensorInfo] = {}
    experts: dict[str, dict[str, TensorSpec]] = {}
    for spec in specs:
        parsed = parse_expert_name(spec.name)
        if parsed is not None and parsed.suffix in _INT4_SUFFIXES:
            experts.setdefault(parsed.module, {})[parsed.suffix] = spec
        else:
            out[spec.name] = _info(spec.name, spec.dtype, spec.shape)
    for module, parts in experts.items():
        out_f, in_f = parts["weight_packed"].matrix_shape
        packed, scale = (_info(parts[s].name, parts[s].dtype, parts[s].shape) for s in ("weight_packed", "weight_scale"))
        for name, (dtype, shape) in ExpertMatrix(module, out_f, in_f, packed, scale).output_specs().items():
            out[name] = _info(name, dtype, shape)
        if scheme is ActivationScheme.W4A4:
            out[module + INPUT_SCALE_SUFFIX] = _info(module + INPUT_SCALE_SUFFIX, torch.float32, ())
    return out


def write_converted_configs(
    folder: str | Path,
    config: dict,
    listing: dict[str, TensorInfo],
    *,
    scheme: ActivationScheme,
    kv_cache_quant_algo: str | None,
) -> tuple[dict, dict]:
    """hf_quant_config.json and config.json as convert (W4A16) or calibrate (W4A4) leave them for `listing`."""
    layout = CheckpointLayout.from_config(config)
    quantized = sorted({p.module for n in listing if (p := parse_expert_name(n)) is not None})
    exclude = summarize_exclude_modules(bf16_linear_modules_in(layout, listing), quantized)
    hf_quant_config, quantization_config = build_modelopt_quant_config(layout, exclude, kv_cache_quant_algo, scheme)
    new_config = rewrite_config_for_nvfp4(config, quantization_config)
    write_json_atomic(Path(folder) / HF_QUANT_CONFIG_NAME, hf_quant_config)
    write_json_atomic(Path(folder) / CONFIG_NAME, new_config)
    return hf_quant_config, new_config


def write_full_size_checkpoint(
    folder: str | Path,
    *,
    layers: int = K26_LAYERS,
    experts: int = K26_EXPERTS,
    vision_layers: int = K26_VISION_LAYERS,
    scheme: ActivationScheme = ActivationScheme.W4A4,
    kv_cache_quant_algo: str | None = "FP8",
) -> Path:
    """Write config.json, hf_quant_config.json and the tensor listing of a converted K2.6; return the listing path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    plan = plan_synthetic_checkpoint(preset="k2.6", layers=layers, experts=experts)
    config = dict(plan.config)
    specs = list(plan.specs)
    if "vision_config" in config:
        vision = {**config["vision_config"], "vt_num_hidden_layers": vision_layers}
        config["vision_config"] = vision
        specs = [s for s in specs if not s.name.startswith(("vision_tower.", "mm_projector."))] + vision_tensor_specs(vision)
    listing = nvfp4_listing(specs, scheme)
    write_converted_configs(folder, config, listing, scheme=scheme, kv_cache_quant_algo=kv_cache_quant_algo)
    path = folder / LISTING_NAME
    write_json_atomic(path, {n: {"dtype": _DTYPE_NAMES[i.dtype], "shape": list(i.shape)} for n, i in listing.items()})
    return path


def read_listing(path: str | Path) -> dict[str, TensorInfo]:
    data = json.loads(Path(path).read_text())
    return {n: _info(n, SAFETENSORS_DTYPES[d["dtype"]], tuple(d["shape"])) for n, d in data.items()}
