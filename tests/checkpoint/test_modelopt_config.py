"""The ModelOpt quant config we write matches Model Optimizer's own export, and the exclude list is exact."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import modelopt
import pytest

from kimi_nvfp4.checkpoint.layout import CheckpointLayout
from kimi_nvfp4.checkpoint.modelopt_config import (
    ActivationScheme,
    bf16_linear_modules,
    build_modelopt_quant_config,
    is_excluded,
    rewrite_config_for_nvfp4,
    summarize_exclude_modules,
)
from kimi_nvfp4.checkpoint.reader import CheckpointReader


def _modelopt_converter():
    """modelopt.torch.export.convert_hf_config, loaded by path (importing modelopt.torch takes seconds)."""
    path = Path(modelopt.__file__).parent / "torch" / "export" / "convert_hf_config.py"
    spec = importlib.util.spec_from_file_location("_modelopt_convert_hf_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.convert_hf_quant_config_format


@pytest.mark.parametrize("scheme", list(ActivationScheme), ids=lambda s: s.value)
@pytest.mark.parametrize("kv", ["FP8", None], ids=["fp8-kv", "no-kv"])
def test_config_json_block_equals_modelopts_conversion_of_hf_quant_config(tiny_int4_checkpoint, kv, scheme):
    layout = CheckpointReader(tiny_int4_checkpoint).layout
    hf_quant_config, quantization_config = build_modelopt_quant_config(layout, ["lm_head", "x*"], kv, scheme)
    algo = {ActivationScheme.W4A4: "NVFP4", ActivationScheme.W4A16: "W4A16_NVFP4"}[scheme]
    assert hf_quant_config["quantization"] == {
        "quant_algo": algo, "kv_cache_quant_algo": kv, "group_size": 16, "exclude_modules": ["lm_head", "x*"]
    }
    assert quantization_config == _modelopt_converter()(hf_quant_config)
    # vLLM 0.33 reads weight-only from "every input_activations is null" (ModelOptNvFp4Config._from_config)
    group = quantization_config["config_groups"]["group_0"]
    assert (group.get("input_activations") is None) == (scheme is ActivationScheme.W4A16)


def test_convert_declares_weight_only_by_default(tiny_int4_checkpoint):
    hf_quant_config, _ = build_modelopt_quant_config(CheckpointReader(tiny_int4_checkpoint).layout, [], "FP8")
    assert hf_quant_config["quantization"]["quant_algo"] == "W4A16_NVFP4"


def test_rewrite_replaces_both_levels_and_keeps_the_rest(tiny_int4_checkpoint):
    reader = CheckpointReader(tiny_int4_checkpoint)
    _, qc = build_modelopt_quant_config(reader.layout, [], "FP8")
    out = rewrite_config_for_nvfp4(reader.config, qc)
    assert out["quantization_config"] == qc == out["text_config"]["quantization_config"]
    assert reader.config["quantization_config"]["quant_method"] == "compressed-tensors"  # input untouched
    assert out["vision_config"] == reader.config["vision_config"]


def test_bf16_linears_are_exactly_the_two_dimensional_non_expert_weights(tiny_int4_checkpoint):
    reader = CheckpointReader(tiny_int4_checkpoint)
    modules = bf16_linear_modules(reader)
    assert "language_model.lm_head" in modules and "language_model.model.layers.1.mlp.gate" in modules
    assert "language_model.model.layers.0.mlp.down_proj" in modules
    assert "vision_tower.encoder.blocks.0.wqkv" in modules and "mm_projector.proj.2" in modules
    assert "language_model.model.embed_tokens" not in modules
    assert not any(".experts." in m or "norm" in m or "patch_embed" in m for m in modules)
    layout = CheckpointLayout.from_config(reader.config)
    assert len([m for m in modules if m.startswith(layout.layer_prefix(1))]) == 5 + 1 + 3  # attention, router, shared


def test_summary_uses_shortest_safe_prefixes():
    excluded = ["m.layers.0.mlp.up_proj", "m.layers.0.self_attn.o_proj", "m.layers.1.self_attn.o_proj",
                "m.layers.1.mlp.gate", "m.layers.10.self_attn.q_proj", "lm_head"]
    quantized = ["m.layers.1.mlp.experts.0.up_proj", "m.layers.10.mlp.experts.0.up_proj"]
    patterns = summarize_exclude_modules(excluded, quantized)
    assert patterns == ["lm_head", "m.layers.0*", "m.layers.1.mlp.gate", "m.layers.1.self_attn*", "m.layers.10.self_attn*"]
    assert all(is_excluded(m, patterns) for m in excluded)
    assert not any(is_excluded(q, patterns) for q in quantized)


def test_sglang_matching_strips_the_language_model_prefix():
    assert is_excluded("language_model.model.layers.3.self_attn.o_proj", ["model.layers.3.self_attn*"])
    assert is_excluded("model.layers.3.self_attn.fused_qkv_a_proj_with_mqa", ["model.layers.3.self_attn*"])
    assert not is_excluded("model.layers.13.self_attn.o_proj", ["model.layers.3.self_attn*"])


def test_sglang_matching_is_a_regex_fullmatch_not_a_substring():
    """SGLang 0.5.23 `is_layer_excluded`: fullmatch on the prefix or on one dotted part, no substring rule."""
    assert not is_excluded("language_model.model.layers.3.self_attn.o_proj", ["model.layers.3.self_attn"])
    assert is_excluded("language_model.model.layers.3.self_attn.o_proj", ["self_attn"])  # one dotted part
    assert is_excluded("model.layers.3.mtp_block.x", ["mtp*"])
    # an entry ending in a fused component matches any module whose last part contains it, in every layer
    fused = "model.layers.4.self_attn.fused_qkv_a_proj_with_mqa"
    assert is_excluded(fused, ["model.layers.3.self_attn.kv_a_proj_with_mqa"])
    assert not is_excluded(fused, ["model.layers.3.self_attn.q_a_proj"])  # "q_a_proj" is not in "fused_qkv_a..."
