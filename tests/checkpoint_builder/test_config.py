"""config.json from the one builder: K2.6's layout for synth and the demo export, byte for byte what ships."""

from __future__ import annotations

import json

import pytest

from kimi_nvfp4.checkpoint.layout import CheckpointLayout, LayoutKind
from kimi_nvfp4.checkpoint.source_checks import check_quantization_config
from kimi_nvfp4.checkpoint_builder.config import (
    KIMI_K25_AUTO_MAP,
    TEXT_INT4_IGNORE,
    VISION_INT4_IGNORE,
    compressed_tensors_int4_config,
    yarn_rope_scaling,
)
from kimi_nvfp4.synth.checkpoint import plan_synthetic_checkpoint

SPEC_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]


def test_the_demo_export_config_is_the_shipped_config_json_byte_for_byte():
    from kimi_nvfp4.demo_model import DEMO_CHECKPOINT
    from kimi_nvfp4.demo_model.build import REPORT_FILE
    from kimi_nvfp4.demo_model.export import CONFIG_FILE, kimi_k25_config, to_json
    from kimi_nvfp4.demo_model.model_config import TinyK2Spec
    from kimi_nvfp4.demo_model.vision_stub import vision_config

    spec = TinyK2Spec.from_dict(json.loads((DEMO_CHECKPOINT / REPORT_FILE).read_text())["spec"])
    assert to_json(kimi_k25_config(spec, vision_config(spec.hidden_size))) == (DEMO_CHECKPOINT / CONFIG_FILE).read_text()


@pytest.mark.parametrize("layout", ["kimi_k25", "deepseek_v3"])
def test_synth_configs_are_accepted_as_kimi_int4_at_both_levels(layout):
    config = plan_synthetic_checkpoint(layout=layout, vocab_size=256).config
    parsed = check_quantization_config(config)  # the levels agree, the scheme is Kimi's
    assert parsed.ignore[:4] == SPEC_IGNORE
    kind = CheckpointLayout.from_config(config).kind
    if layout == "kimi_k25":
        assert kind is LayoutKind.KIMI_K25 and parsed.ignore[4:] == list(VISION_INT4_IGNORE)
        assert config["auto_map"] == KIMI_K25_AUTO_MAP and config["use_unified_vision_chunk"] is True
        assert config["quantization_config"] == config["text_config"]["quantization_config"]
    else:
        assert kind is LayoutKind.DEEPSEEK_V3 and parsed.ignore == SPEC_IGNORE and "text_config" not in config


def test_text_config_keys_lead_with_the_architecture_and_end_with_ids_and_quantization():
    text = plan_synthetic_checkpoint(vocab_size=256).config["text_config"]
    keys = list(text)
    assert keys[:2] == ["architectures", "model_type"]
    assert keys[-4:] == ["bos_token_id", "eos_token_id", "pad_token_id", "quantization_config"]
    assert keys[2:-4] == sorted(keys[2:-4])
    assert text["rope_scaling"] == yarn_rope_scaling(text["max_position_embeddings"])


def test_compressed_tensors_block_ignores_the_vision_tower_only_in_the_wrapper():
    assert compressed_tensors_int4_config(vision=False)["ignore"] == list(TEXT_INT4_IGNORE)
    assert compressed_tensors_int4_config(vision=True)["ignore"] == list(TEXT_INT4_IGNORE + VISION_INT4_IGNORE)


def test_wrapper_can_keep_the_quantization_block_only_in_text_config():
    from kimi_nvfp4.checkpoint_builder.config import KIMI_K25_VIDEO_PLACEHOLDER, k2_text_config, kimi_k25_config

    dims = plan_synthetic_checkpoint(vocab_size=256).config["text_config"]
    text = k2_text_config({k: v for k, v in dims.items() if k not in ("architectures", "model_type",
                                                                       "quantization_config")},
                          token_ids={}, quantization_config=compressed_tensors_int4_config(vision=True),
                          model_type="kimi_k2")
    assert text["model_type"] == "kimi_k2"
    inner_only = kimi_k25_config(text, {}, token_ids={}, media_placeholder_token_id=0, remote_code=True,
                                 top_level_quantization_config=False)
    assert "quantization_config" not in inner_only and inner_only["text_config"]["quantization_config"]
    assert inner_only["video_placeholder"] == KIMI_K25_VIDEO_PLACEHOLDER
    both = kimi_k25_config(text, {}, token_ids={}, media_placeholder_token_id=0)
    assert both["quantization_config"] == text["quantization_config"] and "video_placeholder" not in both
    check_quantization_config(inner_only)
    check_quantization_config(both)


def test_yarn_beta_fast_defaults_to_the_demos_and_takes_k26s():
    from kimi_nvfp4.checkpoint_builder.config import K2_YARN_BETA_FAST

    assert yarn_rope_scaling(262144)["beta_fast"] == 1.0
    assert yarn_rope_scaling(262144, beta_fast=K2_YARN_BETA_FAST)["beta_fast"] == 32.0 == K2_YARN_BETA_FAST
