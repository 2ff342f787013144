"""Serving-engine loader rules, restated independently of our converter, plus converted checkpoints to test.

The converter has its own reader and its own idea of the exclude list; a checkpoint that our reader
accepts can still be misloaded by SGLang (or vLLM). So these rules are re-derived from the engines'
source, not imported from `kimi_nvfp4`, and each carries a link to the code it restates. Read on
2026-11-29 (SGLang main; vLLM `kimi_k25.py` @ 009dff45); see docs/conformance.md for the list.

Fixtures: `demo_calibrated` (the bundled K2.6-layout demo model, converted and calibrated),
`synthetic_deepseek_v3` (no `language_model.` prefix) and `synthetic_kimi_12_layers` (where a
`layers.1*`-style wildcard would also swallow layers 10-11); `rules` hands the restated rules to tests.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import pytest

SGLANG = "https://github.com/sgl-project/sglang/blob/main/python/sglang/srt"
VLLM = "https://github.com/vllm-project/vllm/blob/main/vllm/model_executor"

# ---------------------------------------------------------------- checkpoint headers (no torch, no kimi_nvfp4)


@dataclass(frozen=True)
class Header:
    """One tensor as a safetensors header describes it (dtype is the safetensors code: U8, F8_E4M3, F32, BF16)."""

    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


def read_headers(root: Path) -> dict[str, Header]:
    """Every tensor of every `*.safetensors` file directly in `root` (what SGLang globs), from the headers."""
    out: dict[str, Header] = {}
    for path in sorted(root.glob("*.safetensors")):
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            start, end = meta["data_offsets"]
            out[name] = Header(name, path.name, meta["dtype"], tuple(meta["shape"]), end - start)
    return out


# ---------------------------------------------------------------- module names each engine creates

# SGLang DeepseekV2 fuses these checkpoint linears into one module (packed_modules_mapping passed to the
# quant config: srt/model_loader/loader.py `_initialize_model`; fusion done in
# srt/models/deepseek_common/deepseek_weight_loader.py `load_weights`: stacked_params_mapping for
# gate_up_proj, `cached_a_proj` for fused_qkv_a_proj_with_mqa).
SGLANG_PACKED = {
    "gate_up_proj": ["gate_proj", "up_proj"],
    "fused_qkv_a_proj_with_mqa": ["q_a_proj", "kv_a_proj_with_mqa"],
}
# vLLM DeepseekV2: `fused_qkv_a_proj` (models/deepseek_v2.py packed_modules_mapping; kimi_k25.py stacked_params_mapping).
VLLM_PACKED = {"gate_up_proj": ["gate_proj", "up_proj"], "fused_qkv_a_proj": ["q_a_proj", "kv_a_proj_with_mqa"]}

_EXPERT = re.compile(r"^(?P<layer>.*\.layers\.\d+\.mlp)\.experts\.\d+\.(gate|up|down)_proj\.")
_VISION = ("vision_tower", "mm_projector")


@dataclass(frozen=True)
class EngineModules:
    """Module prefixes an engine builds for the text model: the linears that must stay BF16, and the MoE layers."""

    bf16_linears: tuple[str, ...]
    moe_layers: tuple[str, ...]


def engine_modules(headers: dict[str, Header], *, text_prefix: str, engine: str) -> EngineModules:
    """Map checkpoint tensor names to the prefixes `get_quant_method(layer, prefix)` is called with.

    SGLang KimiK25ForConditionalGeneration builds DeepseekV3ForCausalLM with prefix "" for a ModelOpt config
    (SGLang models/kimi_k25.py `__init__`), so `language_model.` disappears; vLLM builds DeepseekV2Model
    with prefix "language_model" (vLLM models/kimi_k25.py `__init__`), so `language_model.model.` becomes
    `language_model.`. Without the wrapper (DeepSeek-V3 layout) both see `model.layers.N...`.
    The router `mlp.gate` (SGLang MoEGate is a bare Parameter; vLLM builds it with quant_config=None) and the
    vision tower (both engines build it without the quant config) never ask the quant config.
    """
    fused_qkv = "fused_qkv_a_proj_with_mqa" if engine == "sglang" else "fused_qkv_a_proj"
    linears: set[str] = set()
    moe: set[str] = set()
    for name, h in headers.items():
        if name.startswith(_VISION) or not name.endswith(".weight"):
            continue
        if engine == "sglang" or not text_prefix:
            text_name = name.removeprefix(text_prefix) if text_prefix else name
        elif name.startswith(f"{text_prefix}model."):
            text_name = text_prefix + name[len(f"{text_prefix}model.") :]
        else:
            continue  # vLLM KimiK25 builds its own lm_head ParallelLMHead without quant_config
        expert = _EXPERT.match(text_name)
        if expert:
            moe.add(f"{expert['layer']}.experts")
            continue
        if len(h.shape) != 2 or text_name.endswith(("embed_tokens.weight", "mlp.gate.weight")):
            continue
        module = text_name[: -len(".weight")]
        module = re.sub(r"\.(gate_proj|up_proj)$", ".gate_up_proj", module)
        module = re.sub(r"\.(q_a_proj|kv_a_proj_with_mqa)$", f".{fused_qkv}", module)
        linears.add(module)
    return EngineModules(tuple(sorted(linears)), tuple(sorted(moe)))


# ---------------------------------------------------------------- SGLang's matching, restated


def is_layer_skipped(prefix: str, ignored: list[str], fused: dict[str, list[str]]) -> bool:
    """Exact-name check with fused shards (SGLang layers/quantization/utils.py `is_layer_skipped`; vLLM's is the same).

    Raises if some but not all shards of a fused module are listed: the engine refuses to load then.
    """
    proj = prefix.split(".")[-1]
    if proj not in fused:
        return prefix in ignored
    skipped = {prefix.replace(proj, shard) in ignored for shard in fused[proj]}
    if len(skipped) > 1:
        raise ValueError(f"some but not all shards of {prefix} are excluded")
    return skipped.pop()


class SGLangExclusion:
    """SGLang ModelOptQuantConfig exclusion (layers/quantization/modelopt_quant.py under SGLANG)."""

    # `is_layer_excluded`: an entry whose last segment is one of these also matches any module whose
    # last segment contains it (q_a_proj -> fused_qkv_a_proj_with_mqa).
    FUSED_TAILS: ClassVar[frozenset[str]] = frozenset({"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"})
    # KimiK25ForConditionalGeneration.hf_to_sglang_mapper (models/kimi_k25.py).
    KIMI_K25_PREFIX_MAP: ClassVar[dict[str, str]] = {"language_model.layers.": "language_model.model.layers."}

    def __init__(self, exclude_modules: list[str], *, kimi_k25_wrapper: bool):
        patterns = list(exclude_modules)
        if kimi_k25_wrapper:
            # `apply_weight_name_mapper`, called by model_loader/loader.py for a model class with
            # hf_to_sglang_mapper: map each entry, then also add it without `language_model.`.
            mapped = []
            for p in patterns:
                for old, new in self.KIMI_K25_PREFIX_MAP.items():
                    if p.startswith(old):
                        p = new + p[len(old) :]
                mapped += [p, p.removeprefix("language_model.")] if p.startswith("language_model.") else [p]
            patterns = list(dict.fromkeys(mapped))
        self.patterns = patterns

    def is_layer_excluded(self, prefix: str) -> bool:
        variants = [prefix] + ([prefix.removeprefix("language_model.")] if prefix.startswith("language_model.") else [])
        for pattern in self.patterns:
            regex = pattern.replace(".", r"\.").replace("*", ".*")  # glob -> regex, then re.fullmatch
            for pfx in variants:
                if re.fullmatch(regex, pfx) or any(re.fullmatch(regex, part) for part in pfx.split(".")):
                    return True
            tail = pattern.rsplit(".", 1)[-1]
            if tail in self.FUSED_TAILS and any(tail in pfx.rsplit(".", 1)[-1] for pfx in variants):
                return True
        return False

    def linear_unquantized(self, prefix: str) -> bool:
        """`_get_quant_method` for a LinearBase: exact/fused check first, then the wildcard rules."""
        return is_layer_skipped(prefix, self.patterns, SGLANG_PACKED) or self.is_layer_excluded(prefix)

    def moe_unquantized(self, prefix: str) -> bool:
        """`_get_quant_method` for a FusedMoE: excluded -> falls back to the BF16 MoE."""
        return self.is_layer_excluded(prefix)


class VLLMExclusion:
    """vLLM ModelOptQuantConfigBase.is_layer_excluded (layers/quantization/modelopt.py under VLLM)."""

    def __init__(self, exclude_modules: list[str]):
        self.patterns = list(exclude_modules)

    def unquantized(self, prefix: str) -> bool:
        if is_layer_skipped(prefix, self.patterns, VLLM_PACKED):
            return True
        stripped = prefix.removeprefix("language_model.") if prefix.startswith("language_model.") else None
        for p in self.patterns:  # substring rule kept for pre-0.39 ModelOpt exports
            if p != prefix and (p in prefix or (stripped is not None and p in stripped)):
                return True
        return any(fnmatch(prefix, p) for p in self.patterns)


# ---------------------------------------------------------------- config parsing, restated


@dataclass(frozen=True)
class ParsedNvfp4Config:
    quant_algo: str
    kv_cache_quant_algo: str | None
    group_size: int | None
    exclude_modules: list[str]


def sglang_parse_fp4_config(config: dict) -> ParsedNvfp4Config:
    """SGLang ModelOptFp4Config.from_config: flat form (config.json) if `quant_algo` is top-level, else nested.

    Flat: kv cache FP8 iff kv_cache_scheme is {type: float, num_bits: 8}; group_size top-level or
    config_groups' first group's weights; exclude = `ignore`. Nested (hf_quant_config.json): fields under
    `quantization`, group_size from `common_group_size` (all group_size values found must agree).
    """
    if config.get("quant_algo") is not None:
        scheme = config.get("kv_cache_scheme")
        kv = (
            "FP8"
            if isinstance(scheme, dict) and scheme.get("type") == "float" and scheme.get("num_bits") == 8
            else "auto"
        )
        group_size = config.get("group_size")
        if group_size is None and config.get("config_groups"):
            group_size = next(iter(config["config_groups"].values())).get("weights", {}).get("group_size")
        return ParsedNvfp4Config(config["quant_algo"], kv, group_size, config.get("ignore", []))
    q = config["quantization"]
    sizes = {v for v in (config.get("group_size"), q.get("group_size")) if isinstance(v, int)}
    if len(sizes) != 1:
        raise ValueError(f"group_size missing or inconsistent: {sizes}")
    return ParsedNvfp4Config(
        q["quant_algo"], q.get("kv_cache_quant_algo") or "auto", sizes.pop(), q.get("exclude_modules", [])
    )


# ---------------------------------------------------------------- FP8 KV-cache scale names, restated


def sglang_kv_scale_param(name: str) -> str | None:
    """Where SGLang 0.5.23 loads a checkpoint `k_scale` / `v_scale` of a K2.5/K2.6 or DeepSeek checkpoint.

    KimiK25ForConditionalGeneration.load_weights (models/kimi_k25.py) first strips the wrapper:
        yield name.replace("language_model.", ""), loaded_weight
    then DeepseekV2 load_weights (models/deepseek_common/deepseek_weight_loader.py), for a name the model does
    not have:
        if ("k_scale" in name or "v_scale" in name) and name not in params_dict:
            # modelopt attn kv scale is named differently
            for scale in ["k_scale", "v_scale"]:
                if scale in name:
                    name = name.replace(f"{scale[0]}_proj", "attn_mqa")
                    break
    The parameters exist on every RadixAttention whose quant method is ModelOptFp8KVCacheMethod
    (layers/quantization/modelopt_quant.py `_get_quant_method`: `kv_cache_quant_algo and isinstance(layer,
    RadixAttention)`), i.e. `self_attn.attn_mqa` and `self_attn.attn_mha` of every decoder layer.
    Returns the parameter name, or None for a name that is not a KV scale.
    """
    name = name.replace("language_model.", "")
    for scale in ("k_scale", "v_scale"):
        if scale in name:
            return name.replace(f"{scale[0]}_proj", "attn_mqa")
    return None


def sglang_kv_scale_params(num_layers: int) -> set[str]:
    """The k/v scale parameters SGLang's DeepseekV2 builds for the MLA decode path (`self_attn.attn_mqa`, a
    RadixAttention; models/deepseek_v2.py `self.attn_mqa = RadixAttention(..., prefix=add_prefix("attn_mqa",
    prefix))`)."""
    return {f"model.layers.{i}.self_attn.attn_mqa.{s}" for i in range(num_layers) for s in ("k_scale", "v_scale")}


def vllm_kv_scale_param(name: str) -> str | None:
    r"""vLLM 0.33 `maybe_remap_kv_scale_name` (model_loader/weight_utils.py), ModelOpt pattern first:
        (r"\.self_attn\.([kv])_proj\.([kv])_scale$", rf".self_attn.{attn_str}.\2_scale")
    with attn_str "mla_attn.mla_attn" when the model has `mla_attn` (DeepseekV2MLAAttention)."""
    if not re.search(r"\.self_attn\.([kv])_proj\.([kv])_scale$", name):
        return None
    return re.sub(r"\.self_attn\.([kv])_proj\.([kv])_scale$", r".self_attn.mla_attn.mla_attn.\2_scale", name)


# BaseKVCacheMethod.process_weights_after_loading (layers/quantization/kv_cache.py): "Only support per-tensor
# scaling factor for fp8 KV cache"; Model Optimizer clamps FP8 KV scales to >= 1 (quant_utils.py
# postprocess_state_dict `value.clamp_(min=1.0)`), which SGLang's MLA kernels need: the cache is written as a
# plain FP8 cast (`quant_scale_kv=1.0`) while decode multiplies the scores by k_scale.
MODELOPT_MIN_FP8_KV_SCALE = 1.0


# ---------------------------------------------------------------- converted checkpoints


def _converted(root: Path, source: Path) -> Path:
    from kimi_nvfp4.convert.api import convert_checkpoint

    out = root / "nvfp4"
    convert_checkpoint(source, out, device="cpu", progress=False, record_stats=False)
    return out


@pytest.fixture(scope="session")
def demo_calibrated(tmp_path_factory) -> tuple[Path, Path]:
    """(INT4 source, its NVFP4 conversion with input scales): the bundled K2.6-layout demo model."""
    from kimi_nvfp4.calibrate.api import calibrate_checkpoint
    from kimi_nvfp4.demo_model import DEMO_CHECKPOINT

    source = Path(DEMO_CHECKPOINT)
    out = _converted(tmp_path_factory.mktemp("demo"), source)
    calibrate_checkpoint(
        out, source, "sample", samples=8, seq_len=64, device="cpu", progress=False, save_activation_stats=False
    )
    return source, out


def _synthetic(tmp_path_factory, name: str, **case) -> Path:
    from kimi_nvfp4.synth import create_synthetic_checkpoint

    root = tmp_path_factory.mktemp(name)
    return _converted(root, create_synthetic_checkpoint(root / "int4", preset="tiny", **case))


@pytest.fixture(scope="session")
def synthetic_deepseek_v3(tmp_path_factory) -> Path:
    """NVFP4 conversion of a synthetic Kimi-K2-Thinking-style checkpoint: no wrapper, no `language_model.`."""
    return _synthetic(tmp_path_factory, "dsv3", layout="deepseek_v3")


@pytest.fixture(scope="session")
def synthetic_kimi_12_layers(tmp_path_factory) -> Path:
    """NVFP4 conversion of a 12-layer K2.6-layout checkpoint: `layers.1*` would also match layers 10 and 11."""
    return _synthetic(tmp_path_factory, "k25_12", layout="kimi_k25", layers=12, experts=4)


@pytest.fixture(scope="session")
def rules() -> SimpleNamespace:
    """The restated engine rules above (a conftest cannot be imported under --import-mode=importlib)."""
    return SimpleNamespace(
        read_headers=read_headers,
        engine_modules=engine_modules,
        SGLangExclusion=SGLangExclusion,
        VLLMExclusion=VLLMExclusion,
        sglang_parse_fp4_config=sglang_parse_fp4_config,
        sglang_kv_scale_param=sglang_kv_scale_param,
        sglang_kv_scale_params=sglang_kv_scale_params,
        vllm_kv_scale_param=vllm_kv_scale_param,
        MODELOPT_MIN_FP8_KV_SCALE=MODELOPT_MIN_FP8_KV_SCALE,
    )
