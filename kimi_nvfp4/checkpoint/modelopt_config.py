"""The NVIDIA Model Optimizer (ModelOpt) quantization config of the converted checkpoint.

Two places carry it (docs/formats.md §2):
- `hf_quant_config.json`: `{"producer", "quantization": {quant_algo, kv_cache_quant_algo, group_size,
  exclude_modules}}` (what SGLang's `ModelOptFp4Config.get_config_filenames` reads);
- `config.json` `quantization_config` at the top level AND inside `text_config`, in the flat form
  ModelOpt's `convert_hf_quant_config_format` writes (quant_method "modelopt", config_groups,
  ignore, kv_cache_scheme). The stale compressed-tensors block must go from both places: NVIDIA's
  first K2.6 upload kept it in text_config and engines detected the wrong format.

Activation scheme. A checkpoint declares W4A4 (`quant_algo` "NVFP4", `input_activations` NVFP4) only
once every NVFP4 linear has its calibrated `input_scale`; until then it declares weight-only
(`quant_algo` "W4A16_NVFP4", no `input_activations`, exactly ModelOpt's own W4A16 export). Engines
do not refuse a W4A4 checkpoint without input scales: SGLang 0.5.23 creates the expert input scales
with fill value 1.0 (modelopt_quant.py `_make_per_tensor_scale_parameter`) and serves them as they
are; vLLM 0.33 routes a checkpoint to W4A16 only when every `input_activations` is null
(modelopt.py `ModelOptNvFp4Config._from_config`). convert writes W4A16; calibrate switches to W4A4
with `set_activation_scheme` after it has installed the scales.

Exclude list, matched by each engine against the module prefixes it builds:
- SGLang 0.5.23 (`ModelOptQuantConfig.is_layer_excluded`, srt/layers/quantization/modelopt_quant.py):
  each entry becomes a regex (`.` literal, `*` -> `.*`) that must fullmatch the whole prefix, or the
  prefix without `language_model.`, or one dot-separated part of either; an entry whose last part is
  q_a_proj/q_b_proj/kv_a_proj_with_mqa/kv_b_proj also matches a last prefix part containing it
  (the fused `fused_qkv_a_proj_with_mqa`). Before that, `is_layer_skipped` tries exact names.
  The list is first remapped by the model's `hf_to_sglang_mapper` and every `language_model.` entry
  is added again without that prefix (`apply_weight_name_mapper`).
- vLLM 0.33 (`ModelOptQuantConfigBase.is_layer_excluded`, model_executor/layers/quantization/
  modelopt.py): exact name (`is_layer_skipped`, fused shards must agree), then plain substring (also
  without `language_model.`), then `fnmatch`; `apply_vllm_mapper` first splits `path*` into `path`
  and `path.*` and remaps them with the model's `hf_to_vllm_mapper`.
So we summarise the BF16 linears into dot-boundary prefix wildcards (`...layers.3.self_attn*`,
`...layers.0*`, `vision_tower*`), as ModelOpt's own export does, choosing for each linear the
shortest wildcard that matches no NVFP4 module under either rule; single linears that need an exact
entry (`lm_head`, the router `mlp.gate`) are listed by name. `kimi-nvfp4 check-engine` runs both
engines' own matching over every module they build.
"""

from __future__ import annotations

import copy
import json
import re
from bisect import bisect_left
from collections.abc import Iterable, Mapping
from enum import Enum
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

import torch

from .. import __version__
from ..numerics.constants import NVFP4_BLOCK_SIZE
from ..errors import CheckpointError
from .layout import CheckpointLayout, parse_expert_name
from .reader import CheckpointReader, TensorInfo
from .scheme_journal import SchemeSwitch, write_scheme_switch

HF_QUANT_CONFIG_NAME = "hf_quant_config.json"
PRODUCER_NAME = "kimi-nvfp4"
QUANT_ALGO_NVFP4 = "NVFP4"  # W4A4: NVFP4 weights and activations (static input_scale)
QUANT_ALGO_W4A16_NVFP4 = "W4A16_NVFP4"  # NVFP4 weights, BF16 activations (ModelOpt's weight-only algo)
NVFP4_QUANT_ALGOS = (QUANT_ALGO_NVFP4, QUANT_ALGO_W4A16_NVFP4)
INPUT_SCALE_SUFFIX = ".input_scale"
TENSOR_SCALE_SUFFIX = ".weight_scale_2"
KV_CACHE_QUANT_ALGOS = ("FP8", None)
FP4_BITS = 4
FP8_BITS = 8
LINEAR_WEIGHT_SUFFIX = ".weight"


class ActivationScheme(str, Enum):
    """What a converted checkpoint declares for the activations of its NVFP4 linears."""

    W4A16 = "w4a16"  # weight-only: no input_scale yet (convert's output)
    W4A4 = "w4a4"  # static NVFP4 activations: every NVFP4 linear has its input_scale (after calibrate)

    @property
    def quant_algo(self) -> str:
        return QUANT_ALGO_NVFP4 if self is ActivationScheme.W4A4 else QUANT_ALGO_W4A16_NVFP4

    @classmethod
    def from_quant_algo(cls, quant_algo: str | None) -> "ActivationScheme":
        if quant_algo == QUANT_ALGO_NVFP4:
            return cls.W4A4
        if quant_algo == QUANT_ALGO_W4A16_NVFP4:
            return cls.W4A16
        raise ValueError(f"quant_algo {quant_algo!r} is not one of {NVFP4_QUANT_ALGOS}")


def bf16_linear_modules(reader: CheckpointReader) -> list[str]:
    """Module names of every linear that stays BF16 (see `bf16_linear_modules_in`), from `reader`'s headers."""
    return bf16_linear_modules_in(reader.layout, reader.tensors)


def bf16_linear_modules_in(layout: CheckpointLayout, tensors: Mapping[str, TensorInfo]) -> list[str]:
    """Module names of every linear that stays BF16: 2-d `.weight` tensors other than the embedding.

    Decided from shard headers alone. Routed experts (INT4 in the source) are excluded by name;
    norms are 1-d, MoonViT's patch conv is 4-d and its position embedding 3-d, so none is a linear.
    """
    embed_module = layout.embed_name[: -len(LINEAR_WEIGHT_SUFFIX)]
    modules = []
    for name, info in tensors.items():
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
        # the names starting with `prefix` sort right after it: one binary search, not a scan of 70k experts
        i = bisect_left(quantized, prefix)
        return i < len(quantized) and quantized[i].startswith(prefix)

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


# The K2.5/K2.6 wrapper stores the text model under `language_model.model.*`; the engines build:
# - SGLang 0.5.23: `language_model.model.layers.N...` with a ModelOpt config (models/kimi_k25.py builds
#   DeepseekV3ForCausalLM with prefix "" under the `language_model` attribute); its exclude list is remapped
#   by `hf_to_sglang_mapper` (`language_model.layers.` -> `language_model.model.layers.`) and every entry is
#   added again without `language_model.` (modelopt_quant.py `apply_weight_name_mapper`);
# - vLLM 0.33: `language_model.model.layers.N...` and `language_model.lm_head` (models/kimi_k25.py,
#   prefix "language_model"), remapping `language_model.layers.` the same way (`hf_to_vllm_mapper`).
# Both therefore match the `language_model.model.*` entries themselves. The other spellings are what
# NVIDIA's K2.5 NVFP4 export writes (`language_model.layers.N`) and what releases without the prefix
# stripping match (`model.layers.N`); they select the same modules and never an expert.
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


# SGLang 0.5.23 `ModelOptQuantConfig.is_layer_excluded`: an entry ending in one of these also matches a
# module whose last part contains it (the fused `fused_qkv_a_proj_with_mqa`).
_SGLANG_FUSED_TAILS = frozenset({"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"})
_WRAPPER_PREFIX = "language_model."


def _sglang_pattern(pattern: str) -> re.Pattern[str]:
    # modelopt_quant.py `_compile_exclusion_pattern`: "." literal, "*" -> ".*"
    return re.compile(pattern.replace(".", r"\.").replace("*", ".*"))


def is_excluded(module: str, patterns: Iterable[str]) -> bool:
    """SGLang 0.5.23's rule (modelopt_quant.py `is_layer_excluded`, restated in the module docstring)."""
    prefixes = [module]
    if module.startswith(_WRAPPER_PREFIX):
        prefixes.append(module.removeprefix(_WRAPPER_PREFIX))
    for p in patterns:
        regex = _sglang_pattern(p)
        for prefix in prefixes:
            if regex.fullmatch(prefix) or any(regex.fullmatch(part) for part in prefix.split(".")):
                return True
        tail = p.rsplit(".", maxsplit=1)[-1]
        if tail in _SGLANG_FUSED_TAILS and any(tail in prefix.rsplit(".", maxsplit=1)[-1] for prefix in prefixes):
            return True
    return False


def build_modelopt_quant_config(
    layout: CheckpointLayout,
    exclude_modules: list[str],
    kv_cache_quant_algo: str | None,
    scheme: ActivationScheme = ActivationScheme.W4A16,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(hf_quant_config.json contents, config.json `quantization_config`) for NVFP4 experts.

    `scheme` W4A16 (convert's output, no input scales yet) or W4A4 (after calibrate), see the module docstring.
    """
    if kv_cache_quant_algo not in KV_CACHE_QUANT_ALGOS:
        raise ValueError(f"kv_cache_quant_algo must be one of {KV_CACHE_QUANT_ALGOS}, got {kv_cache_quant_algo!r}")
    del layout  # the config is the same for both layouts; names in exclude_modules carry the prefix
    hf_quant_config = {
        "producer": {"name": PRODUCER_NAME, "version": __version__},
        "quantization": {
            "quant_algo": ActivationScheme(scheme).quant_algo,
            "kv_cache_quant_algo": kv_cache_quant_algo,
            "group_size": NVFP4_BLOCK_SIZE,
            "exclude_modules": list(exclude_modules),
        },
    }
    return hf_quant_config, flat_quantization_config(hf_quant_config)


def flat_quantization_config(hf_quant_config: dict[str, Any]) -> dict[str, Any]:
    """config.json's `quantization_config` for `hf_quant_config`: same keys, order and values as
    modelopt.torch.export.convert_hf_config.convert_hf_quant_config_format (NVFP4 and W4A16_NVFP4 only)."""
    q = hf_quant_config["quantization"]
    scheme = ActivationScheme.from_quant_algo(q["quant_algo"])
    fp4 = {"dynamic": False, "num_bits": FP4_BITS, "type": "float", "group_size": q["group_size"]}
    group: dict[str, Any] = {"weights": dict(fp4), "targets": ["Linear"]}
    if scheme is ActivationScheme.W4A4:
        group = {"input_activations": dict(fp4), **group}
    quantization_config: dict[str, Any] = {
        "config_groups": {"group_0": group},
        "ignore": list(q["exclude_modules"]),
        "quant_algo": q["quant_algo"],
    }
    if q["kv_cache_quant_algo"] == "FP8":
        quantization_config["kv_cache_scheme"] = {"dynamic": False, "num_bits": FP8_BITS, "type": "float"}
    quantization_config["producer"] = dict(hf_quant_config["producer"])
    quantization_config["quant_method"] = "modelopt"
    return quantization_config


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



def declared_scheme(root: str | Path) -> ActivationScheme:
    """The activation scheme `root`'s hf_quant_config.json declares."""
    path = Path(root) / HF_QUANT_CONFIG_NAME
    try:
        return ActivationScheme.from_quant_algo(load_hf_quant_config(root)["quantization"]["quant_algo"])
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"cannot read the declared quant_algo ({e})", file=path) from None


def nvfp4_modules_without_input_scale(reader: CheckpointReader) -> list[str]:
    """NVFP4 linears (those with a `weight_scale_2`) whose `input_scale` is not in the checkpoint."""
    modules = (n[: -len(TENSOR_SCALE_SUFFIX)] for n in reader.tensors if n.endswith(TENSOR_SCALE_SUFFIX))
    return sorted(m for m in modules if m + INPUT_SCALE_SUFFIX not in reader)


def set_activation_scheme(root: str | Path, scheme: ActivationScheme, *, durable: bool = True) -> bool:
    """Declare `scheme` in `root`'s hf_quant_config.json and config.json (both levels); True if anything changed.

    W4A4 is refused (CheckpointError, nothing written) while an NVFP4 linear lacks its `input_scale` in
    the index. The two files are switched through a journal (scheme_journal.py): a kill at any point leaves
    the old pair, the new pair, or a journal every reader of ours completes before reading. The order of the
    two writes still matters to an engine started on a half-switched folder by hand: hf_quant_config.json
    first, because SGLang and vLLM read config.json's block first, so they keep the old scheme until the end.
    """
    root = Path(root)
    scheme = ActivationScheme(scheme)
    reader = CheckpointReader(root)  # finishes an interrupted switch first
    if scheme is ActivationScheme.W4A4:
        missing = nvfp4_modules_without_input_scale(reader)
        if missing:
            raise CheckpointError(
                f"{len(missing)} NVFP4 linears have no input_scale; W4A4 needs every one (run `kimi-nvfp4 calibrate`)",
                file=root,
                tensor=missing[0] + INPUT_SCALE_SUFFIX,
            )
    hf_quant_config = load_hf_quant_config(root)
    config = reader.config
    hf_quant_config["quantization"]["quant_algo"] = scheme.quant_algo
    new_config = rewrite_config_for_nvfp4(config, flat_quantization_config(hf_quant_config))
    if new_config == config and declared_scheme(root) is scheme:
        return False
    write_scheme_switch(root, SchemeSwitch(quant_algo=scheme.quant_algo, hf_quant_config=hf_quant_config,
                                           config=new_config), durable=durable)
    return True
