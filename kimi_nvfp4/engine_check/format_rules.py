"""Engine-agnostic rules every engine check applies to the checkpoint itself, before any engine code runs.

- The activation scheme is declared in three places (config.json's `quantization_config`, the copy in its
  `text_config`, hf_quant_config.json) and engines read the first they find: SGLang 0.5.23 takes config.json's
  block (configs/model_config.py `_parse_quant_hf_config`) and reads hf_quant_config.json only when there is
  none; vLLM 0.33 does the same (`get_quant_config`). All three must agree, and what an engine serves is decided
  by `engine_parsed_scheme`, never by hf_quant_config.json alone.
- Every tensor's dtype and shape against NVIDIA Model Optimizer's NVFP4 format (SPEC §2): per NVFP4 linear
  `weight` uint8 [out, in/2], `weight_scale` float8_e4m3fn [out, in/16], `weight_scale_2` and `input_scale`
  float32 0-d; FP8 KV scales float32 0-d. A wrong dtype is a fault even when the value would survive the cast:
  the engines allocate these dtypes (SGLang modelopt_quant.py `ModelOptFp4LinearMethod.create_weights`) and
  copy with a silent cast, so a bf16 `weight_scale_2` serves a rounded global scale.
"""

from __future__ import annotations

from typing import Any

import torch

from ..calibrate.kv_cache import is_kv_cache_scale
from ..checkpoint.modelopt_config import INPUT_SCALE_SUFFIX, ActivationScheme
from .checkpoint_view import CheckpointView
from .report import ValueCheck

NVFP4_GROUP = 16  # E2M1 values per float8_e4m3fn block scale
E2M1_PER_BYTE = 2
KV_SCALE_DTYPE = torch.float32
_SHOWN = 5


def _quant_algo(block: Any) -> str | None:
    return block.get("quant_algo") if isinstance(block, dict) else None


def scheme_declarations(view: CheckpointView) -> dict[str, str | None]:
    """quant_algo per place that declares it: config.json, config.json text_config, hf_quant_config.json."""
    out: dict[str, str | None] = {"config.json quantization_config": _quant_algo(view.config.get("quantization_config"))}
    text = view.config.get("text_config")
    if isinstance(text, dict) and "quantization_config" in text:
        out["config.json text_config.quantization_config"] = _quant_algo(text["quantization_config"])
    out["hf_quant_config.json quantization"] = view.quantization.get("quant_algo")
    return out


def engine_parsed_scheme(view: CheckpointView) -> ActivationScheme:
    """The scheme an engine serves: config.json's block when it has one (what SGLang and vLLM read first), else
    hf_quant_config.json's. The engine's own parse is reported too (SGLang `is_w4a16`)."""
    top = _quant_algo(view.config.get("quantization_config"))
    if top is not None:
        try:
            return ActivationScheme.from_quant_algo(top)
        except ValueError:
            pass  # not a ModelOpt NVFP4 algo: the declarations check reports it
    return view.declared_scheme


def check_scheme_declarations(view: CheckpointView) -> ValueCheck:
    places = scheme_declarations(view)
    values = set(places.values())
    return ValueCheck(
        name="config.json (top level, text_config) and hf_quant_config.json declare the same scheme",
        passed=len(values) == 1 and None not in values, checked=len(places),
        detail="; ".join(f"{k}: {v}" for k, v in places.items())
        + ("" if len(values) == 1 else " (the engine reads config.json's block first)"),
    )


def _expected_nvfp4(view: CheckpointView, module: str) -> dict[str, tuple[torch.dtype, tuple[int, ...] | None]]:
    weight = view.tensors.get(f"{module}.weight")
    packed = tuple(weight.shape) if weight is not None and len(weight.shape) == 2 else None
    out: dict[str, tuple[torch.dtype, tuple[int, ...] | None]] = {
        "weight": (torch.uint8, packed),
        "weight_scale": (torch.float8_e4m3fn,
                         (packed[0], packed[1] * E2M1_PER_BYTE // NVFP4_GROUP) if packed is not None else None),
        "weight_scale_2": (torch.float32, ()),
    }
    if f"{module}{INPUT_SCALE_SUFFIX}" in view.tensors:
        out["input_scale"] = (torch.float32, ())
    return out


def check_tensor_formats(view: CheckpointView) -> ValueCheck:
    """dtype and shape of every NVFP4 linear's tensors and every FP8 KV scale against the ModelOpt format."""
    bad: list[str] = []
    checked = 0
    for module in view.nvfp4_modules:
        for leaf, (dtype, shape) in _expected_nvfp4(view, module).items():
            name = f"{module}.{leaf}"
            info = view.tensors.get(name)
            checked += 1
            if info is None:
                bad.append(f"{name}: absent")
            elif info.dtype != dtype or (shape is not None and tuple(info.shape) != shape):
                want = f"{str(dtype).removeprefix('torch.')} {list(shape) if shape is not None else '2-D'}"
                bad.append(f"{name}: {str(info.dtype).removeprefix('torch.')} {list(info.shape)}, expected {want}")
            elif leaf == "weight" and shape is None:
                bad.append(f"{name}: {list(info.shape)}, expected 2-D [out, in/2]")
    for name, info in view.tensors.items():
        if is_kv_cache_scale(name):
            checked += 1
            if info.dtype != KV_SCALE_DTYPE or tuple(info.shape) != ():
                bad.append(f"{name}: {str(info.dtype).removeprefix('torch.')} {list(info.shape)}, expected float32 []")
    return ValueCheck(
        name="every NVFP4 and KV-scale tensor has ModelOpt's dtype and shape (uint8 [out,in/2], float8_e4m3fn "
             "[out,in/16], float32 0-d scales)",
        passed=not bad, checked=checked,
        detail=f"{checked} tensors" if not bad else f"{len(bad)} differ: " + "; ".join(bad[:_SHOWN]),
    )


def format_checks(view: CheckpointView) -> list[ValueCheck]:
    return [check_scheme_declarations(view), check_tensor_formats(view)]
