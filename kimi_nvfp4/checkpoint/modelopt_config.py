"""The NVIDIA Model Optimizer (ModelOpt) quantization config of the converted checkpoint.

Two places carry it (docs/formats.md §2):
- `hf_quant_config.json`: `{"producer", "quantization": {quant_algo, kv_cache_quant_algo, group_size,
  exclude_modules}}` (what SGLang's `ModelOptFp4Config.get_config_filenames` reads);
- `config.json` `quantization_config` at the top level AND inside `text_config`, in the flat form
  ModelOpt's `convert_hf_quant_config_format` writes (quant_method "modelopt", config_groups,
  ignore, kv_cache_scheme). The stale compressed-tensors block must go from both places: NVIDIA's
  first K2.6 upload kept it in text_config and engines detected the wrong format.

Exclude list. SGLang's `ModelOptQuantConfigBase.is_layer_excluded` (srt/layers/quantization/
modelopt_quant.py) treats each entry as an fnmatch wildcard, also as a plain substring, and also
after stripping a `language_model.` prefix; older releases use `re.fullmatch` with `*` -> `.*` and
assert on 5-part names when an entry ends in `q_a_proj`/`kv_a_proj_with_mqa` (SGLang fuses those
into `fused_qkv_a_proj_with_mqa`). So we summarise the BF16 linears into dot-boundary prefix
wildcards (`...layers.3.self_attn*`, `...layers.0*`, `vision_tower*`), as ModelOpt's own export
does, choosing for each linear the shortest wildcard that matches no NVFP4 module; single linears
that need an exact entry (`lm_head`, the router `mlp.gate`) are listed by name.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

import torch

from .. import __version__
from ..numerics.constants import NVFP4_BLOCK_SIZE
from .layout import CheckpointLayout, parse_expert_name
from .reader import CheckpointReader

HF_QUANT_CONFIG_NAME = "hf_quant_config.json"
PRODUCER_NAME = "kimi-nvfp4"
QUANT_ALGO_NVFP4 = "NVFP4"
KV_CACHE_QUANT_ALGOS = ("FP8", None)
FP4_BITS = 4
FP8_BITS = 8
LINEAR_WEIGHT_SUFFIX = ".weight"


def bf16_linear_modules(reader: CheckpointReader) -> list[str]:
    """Module names of every linear that stays BF16: 2-d `.weight` tensors other than the embedding.

    Decided from shard headers alone. Routed experts (INT4 in the source) are excluded by name;
    norms are 1-d, MoonViT's patch conv is 4-d and its position embedding 3-d, so none is a linear.
    """
    layout = reader.layout
    embed_module = layout.embed_name[: -len(LINEAR_WEIGHT_SUFFIX)]
    modules = []
    for name, info in reader.tensors.items():
        if not name.endswith(LINEAR_WEIGHT_SUFFIX) or parse_expert_name(name) is not None:
            continue
        module = name[: -len(LINEAR_WEIGHT_SUFFIX)]
        if module == embed_module or len(info.shape) != 2 or not info.dtype.is_floating_point:
            continue
        if info.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            continue
        modules.append(module)
    return sorted(modules)


def summarize_exclude_modules(excluded: Iterable[str], quantized: Iterable[str]) -> list[str]:
    """Prefix wildcards that match every `excluded` module and no `quantized` module."""
    quantized = sorted(set(quantized))

    def clashes(prefix: str) -> bool:
        return any(q.startswith(prefix) for q in quantized)

    patterns: list[str] = []
    for module in sorted(set(excluded)):
        if any(fnmatchcase(module, p) for p in patterns):
            continue
        dots = [i for i, ch in enumerate(module) if ch == "."]
        chosen = module
        for i in dots:
            if not clashes(module[:i]):
                chosen = module[:i] + "*"
                break
        if chosen == module and module in quantized:
            raise ValueError(f"module {module} is both BF16 and quantized")
        patterns.append(chosen)
    return sorted({alias for p in patterns for alias in engine_spellings(p)})


# The K2.5/K2.6 wrapper stores the text model under `language_model.model.*`, but engines name the
# modules they build differently, and each matches exclude entries against its own names:
# - vLLM's KimiK25 wrapper builds `language_model.layers.N...` and `language_model.lm_head` and does not
#   remap exclude_modules (vllm/model_executor/layers/quantization/modelopt.py `is_layer_excluded`);
# - SGLang builds `model.layers.N...` inside the wrapper; current releases also try each entry without
#   `language_model.` (srt/layers/quantization/modelopt_quant.py `apply_weight_name_mapper`), older ones do not.
# So every wrapper entry is also written in those spellings (NVIDIA's K2.5 NVFP4 export does the same).
_WRAPPED_TEXT = "language_model.model."
_WRAPPED_HEAD = "language_model.lm_head"


def engine_spellings(pattern: str) -> list[str]:
    """`pattern` plus the names vLLM and SGLang give the same K2.5-wrapper module (itself otherwise)."""
    if pattern.startswith(_WRAPPED_TEXT):
        rest = pattern[len(_WRAPPED_TEXT) :]
        return [pattern, f"language_model.{rest}", f"model.{rest}"]
    if pattern.startswith(_WRAPPED_HEAD):
        return [pattern, "lm_head" + pattern[len(_WRAPPED_HEAD) :]]
    return [pattern]


def is_excluded(module: str, patterns: Iterable[str]) -> bool:
    """SGLang's rule (modelopt_quant.py `is_layer_excluded`): wildcard, or substring, also without `language_model.`."""
    for p in patterns:
        if fnmatchcase(module, p):
            return True
        if p != module and (p in module or (module.startswith("language_model.") and p in module.removeprefix("language_model."))):
            return True
    return False


def build_modelopt_quant_config(
    layout: CheckpointLayout, exclude_modules: list[str], kv_cache_quant_algo: str | None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(hf_quant_config.json contents, config.json `quantization_config`) for NVFP4 experts."""
    if kv_cache_quant_algo not in KV_CACHE_QUANT_ALGOS:
        raise ValueError(f"kv_cache_quant_algo must be one of {KV_CACHE_QUANT_ALGOS}, got {kv_cache_quant_algo!r}")
    del layout  # the config is the same for both layouts; names in exclude_modules carry the prefix
    producer = {"name": PRODUCER_NAME, "version": __version__}
    hf_quant_config = {
        "producer": producer,
        "quantization": {
            "quant_algo": QUANT_ALGO_NVFP4,
            "kv_cache_quant_algo": kv_cache_quant_algo,
            "group_size": NVFP4_BLOCK_SIZE,
            "exclude_modules": list(exclude_modules),
        },
    }
    # Same keys, order and values as modelopt.torch.export.convert_hf_config.convert_hf_quant_config_format.
    fp4 = {"dynamic": False, "num_bits": FP4_BITS, "type": "float", "group_size": NVFP4_BLOCK_SIZE}
    quantization_config: dict[str, Any] = {
        "config_groups": {"group_0": {"input_activations": dict(fp4), "weights": dict(fp4), "targets": ["Linear"]}},
        "ignore": list(exclude_modules),
        "quant_algo": QUANT_ALGO_NVFP4,
    }
    if kv_cache_quant_algo == "FP8":
        quantization_config["kv_cache_scheme"] = {"dynamic": False, "num_bits": FP8_BITS, "type": "float"}
    quantization_config["producer"] = producer
    quantization_config["quant_method"] = "modelopt"
    return hf_quant_config, quantization_config


def rewrite_config_for_nvfp4(config: dict[str, Any], quantization_config: dict[str, Any]) -> dict[str, Any]:
    """A copy of config.json with the compressed-tensors block replaced at the top level and in text_config."""
    out = copy.deepcopy(config)
    out["quantization_config"] = copy.deepcopy(quantization_config)
    if isinstance(out.get("text_config"), dict):
        out["text_config"]["quantization_config"] = copy.deepcopy(quantization_config)
    return out


def load_hf_quant_config(root: str | Path) -> dict[str, Any]:
    return json.loads((Path(root) / HF_QUANT_CONFIG_NAME).read_text())


def quantization_configs_in(config: dict[str, Any]) -> list[dict[str, Any]]:
    """Every quantization_config block a loader might read (top level, text_config)."""
    blocks = [config.get("quantization_config")]
    if isinstance(config.get("text_config"), dict):
        blocks.append(config["text_config"].get("quantization_config"))
    return [b for b in blocks if b is not None]

