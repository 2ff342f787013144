"""config.json contents of synthetic Kimi K2 checkpoints, laid out exactly as Moonshot ships them (SPEC §1).

Two presets:
- `tiny`: every dimension small (hidden 64, experts 8 x width 32) but a multiple of the INT4 group
  (32) and the NVFP4 block (16), so every code path runs in milliseconds;
- `k2.6`: the real K2.6 dimensions (hidden 7168, moe width 2048, 384 experts, MLA ranks); only the
  layer and expert counts are usually overridden, for benchmarks on real tensor shapes.

Vocabulary: both presets keep Kimi's real `vocab_size` 163840, because the synthetic tokenizer
places Kimi's special tokens at their real ids (163584..163839); a model whose vocabulary did not
cover them could not embed a rendered chat. Pass `vocab_size=` to shrink it when only the
weights matter (the tokenizer ids then exceed the vocabulary; do not run chats through it).
"""

from __future__ import annotations

import copy
from typing import Any

# Kimi's tokenizer: 163584 BPE ranks followed by 256 special / reserved ids.
KIMI_VOCAB_SIZE = 163840
KIMI_BOS_ID = 163584
KIMI_EOS_ID = 163585
KIMI_PAD_ID = 163839
KIMI_MEDIA_PLACEHOLDER_ID = 163605

TEXT_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "q_lora_rank": 32,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 16,
        "v_head_dim": 16,
        "max_position_embeddings": 4096,
        "routed_scaling_factor": 2.827,
    },
    "k2.6": {
        "hidden_size": 7168,
        "num_hidden_layers": 61,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "n_routed_experts": 384,
        "num_experts_per_tok": 8,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "num_attention_heads": 64,
        "num_key_value_heads": 64,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "max_position_embeddings": 262144,
        "routed_scaling_factor": 2.827,
    },
}

VISION_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"vt_hidden_size": 32, "vt_intermediate_size": 64, "vt_num_hidden_layers": 1, "vt_num_attention_heads": 2},
    "k2.6": {"vt_hidden_size": 1152, "vt_intermediate_size": 4304, "vt_num_hidden_layers": 1, "vt_num_attention_heads": 16},
}
PRESETS = tuple(TEXT_PRESETS)

# compressed-tensors `pack-quantized` INT4 group-32 block exactly as Kimi K2.5/K2.6/K2-Thinking ship it.
_COMPRESSED_TENSORS_INT4 = {
    "config_groups": {
        "group_0": {
            "input_activations": None,
            "output_activations": None,
            "targets": ["Linear"],
            "weights": {
                "actorder": None,
                "block_structure": None,
                "dynamic": False,
                "group_size": 32,
                "num_bits": 4,
                "observer": "minmax",
                "observer_kwargs": {},
                "strategy": "group",
                "symmetric": True,
                "type": "int",
            },
        }
    },
    "format": "pack-quantized",
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}


def compressed_tensors_int4_config() -> dict[str, Any]:
    return copy.deepcopy(_COMPRESSED_TENSORS_INT4)


def _yarn_rope_scaling(max_positions: int) -> dict[str, Any]:
    # K2.x: YaRN with factor 64 over a 4096-token original window (262144 = 64 * 4096).
    return {
        "beta_fast": 1.0,
        "beta_slow": 1.0,
        "factor": 64.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": max(1, max_positions // 64),
        "type": "yarn",
    }


def deepseek_v3_text_config(
    preset: str,
    *,
    layers: int | None = None,
    experts: int | None = None,
    vocab_size: int = KIMI_VOCAB_SIZE,
    overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Every key of a DeepseekV3 `config.json` (as in Kimi K2), with the preset's dimensions."""
    dims = dict(TEXT_PRESETS[preset])
    if layers is not None:
        dims["num_hidden_layers"] = layers
    if experts is not None:
        dims["n_routed_experts"] = experts
        dims["num_experts_per_tok"] = min(dims["num_experts_per_tok"], experts)
    cfg: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "aux_loss_alpha": 0.001,
        "bos_token_id": KIMI_BOS_ID,
        "eos_token_id": KIMI_EOS_ID,
        "ep_size": 1,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "model_type": "deepseek_v3",
        "moe_layer_freq": 1,
        "n_group": 1,
        "norm_topk_prob": True,
        "num_nextn_predict_layers": 0,
        "pad_token_id": KIMI_PAD_ID,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_theta": 50000.0,
        "scoring_func": "sigmoid",
        "seq_aux": True,
        "tie_word_embeddings": False,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": vocab_size,
        **dims,
    }
    cfg["rope_scaling"] = _yarn_rope_scaling(cfg["max_position_embeddings"])
    cfg.update(overrides or {})
    cfg["quantization_config"] = compressed_tensors_int4_config()
    return dict(sorted(cfg.items()))


def vision_config(preset: str, text_hidden_size: int) -> dict[str, Any]:
    v = VISION_PRESETS[preset]
    return {
        "model_type": "moonvit",
        "patch_size": 14,
        "init_pos_emb_height": 4,
        "init_pos_emb_width": 4,
        "merge_kernel_size": [2, 2],
        "mm_hidden_size": v["vt_hidden_size"],
        "text_hidden_size": text_hidden_size,
        **v,
    }


def kimi_k25_config(text_config: dict[str, Any], preset: str) -> dict[str, Any]:
    """The K2.5/K2.6 wrapper: quantization_config at the top level AND inside text_config (SPEC §1)."""
    return {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "auto_map": {
            "AutoConfig": "configuration_kimi_k25.KimiK25Config",
            "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
            "AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
        },
        "bos_token_id": KIMI_BOS_ID,
        "eos_token_id": KIMI_EOS_ID,
        "ignore_index": -100,
        "media_placeholder_token_id": KIMI_MEDIA_PLACEHOLDER_ID,
        "model_type": "kimi_k25",
        "pad_token_id": KIMI_PAD_ID,
        "quantization_config": compressed_tensors_int4_config(),
        "text_config": text_config,
        "tie_word_embeddings": False,
        "use_unified_vision_chunk": True,
        "vision_config": vision_config(preset, text_config["hidden_size"]),
    }


def deepseek_v3_config(text_config: dict[str, Any]) -> dict[str, Any]:
    """Kimi-K2-Thinking: the text config is the whole config.json (no wrapper, no prefix)."""
    cfg = dict(text_config)
    cfg["auto_map"] = {
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModel": "modeling_deepseek.DeepseekV3Model",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
    }
    return dict(sorted(cfg.items()))
