"""config.json of a Kimi K2-layout INT4 checkpoint: the DeepseekV3 text config, the K2.5/K2.6 wrapper around it,
and the compressed-tensors INT4 block that both levels carry (docs/formats.md §1).

Key order is part of the output (config.json bytes): the wrapper's keys in the order the bundled demo checkpoint
ships them, and in the text config `architectures`, `model_type`, the other keys sorted, then the special-token
ids and the quantization block.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from ..numerics.constants import INT4_GROUP_SIZE

INT4_BITS = 4
# K2.x: YaRN with factor 64 over a window 64x smaller than the context (262144 = 64 * 4096), rope theta 50000.
YARN_FACTOR = 64
ROPE_THETA = 50000.0
# YaRN's fast-rotation boundary: K2.6's config.json says 32.0; the bundled demo model was trained with 1.0
# (its config keeps it, so this builder's default stays 1.0 and synth's k2.6 preset asks for 32).
DEFAULT_YARN_BETA_FAST = 1.0
K2_YARN_BETA_FAST = 32.0
# The text config's model_type as K2.x ship it (config.json `kimi_k2`; transformers' class is DeepseekV3).
K2_TEXT_MODEL_TYPE = "kimi_k2"
DEEPSEEK_V3_MODEL_TYPE = "deepseek_v3"
ROUTED_SCALING_FACTOR = 2.827
RMS_NORM_EPS = 1e-5
INITIALIZER_RANGE = 0.02

# The four `ignore` patterns of Kimi's compressed-tensors block (docs/formats.md §1): only routed experts are INT4.
TEXT_INT4_IGNORE = ("lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*")
# K2.5/K2.6 also name the BF16 vision tower and projector, so a compressed-tensors loader never looks for packed
# weights there.
VISION_INT4_IGNORE = ("re:vision_tower.*", "re:mm_projector.*")

# K2.6's remote code (configuration_kimi_k25.py / modeling_kimi_k25.py, shipped beside the weights). kimi-nvfp4
# never runs it; a checkpoint that ships no code (the demo) carries no auto_map.
KIMI_K25_AUTO_MAP = {
    "AutoConfig": "configuration_kimi_k25.KimiK25Config",
    "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
    "AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
}
KIMI_K25_VIDEO_PLACEHOLDER = "<|kimi_k25_video_placeholder|>"
DEEPSEEK_V3_AUTO_MAP = {
    "AutoConfig": "configuration_deepseek.DeepseekV3Config",
    "AutoModel": "modeling_deepseek.DeepseekV3Model",
    "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
}


def compressed_tensors_int4_config(*, vision: bool) -> dict[str, Any]:
    """Kimi's compressed-tensors `pack-quantized` block: symmetric INT4, group 32, min-max observer, no activation
    quantization. `vision`: the K2.5/K2.6 wrapper, whose vision tower and projector are also ignored."""
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": INT4_BITS, "type": "int", "symmetric": True, "strategy": "group",
                            "group_size": INT4_GROUP_SIZE, "dynamic": False, "actorder": None, "observer": "minmax",
                            "observer_kwargs": {}, "block_structure": None},
                "input_activations": None,
                "output_activations": None,
                "format": "pack-quantized",
            }
        },
        "ignore": list(TEXT_INT4_IGNORE + (VISION_INT4_IGNORE if vision else ())),
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "global_compression_ratio": None,
    }


def yarn_rope_scaling(max_position_embeddings: int, beta_fast: float = DEFAULT_YARN_BETA_FAST) -> dict[str, Any]:
    return {"type": "yarn", "factor": float(YARN_FACTOR),
            "original_max_position_embeddings": max(1, max_position_embeddings // YARN_FACTOR),
            "beta_fast": float(beta_fast), "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}


def k2_text_config(dims: Mapping[str, Any], *, token_ids: Mapping[str, int],
                   quantization_config: dict[str, Any] | None,
                   model_type: str = DEEPSEEK_V3_MODEL_TYPE) -> dict[str, Any]:
    """A DeepseekV3 config.json with K2's fixed choices (sigmoid `noaux_tc` routing, `n_group 1`, normalised
    top-k times 2.827, yarn rope, no MTP layer) and the sizes in `dims` (hidden_size, num_hidden_layers,
    intermediate_size, moe_intermediate_size, n_routed_experts, num_experts_per_tok, n_shared_experts,
    first_k_dense_replace, num_attention_heads, num_key_value_heads, q_lora_rank, kv_lora_rank,
    qk_nope_head_dim, qk_rope_head_dim, v_head_dim, max_position_embeddings, vocab_size; any fixed key may be
    overridden there too).

    :param token_ids: bos_token_id, eos_token_id, pad_token_id.
    :param quantization_config: the compressed-tensors block (None: a BF16 config).
    :param model_type: `kimi_k2` as K2.x's own files say, or `deepseek_v3` (the bundled demo's).
    """
    body: dict[str, Any] = {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "aux_loss_alpha": 0.001,
        "ep_size": 1,
        "hidden_act": "silu",
        "initializer_range": INITIALIZER_RANGE,
        "moe_layer_freq": 1,
        "n_group": 1,
        "norm_topk_prob": True,
        "num_nextn_predict_layers": 0,
        "pretraining_tp": 1,
        "rms_norm_eps": RMS_NORM_EPS,
        "rope_theta": ROPE_THETA,
        "routed_scaling_factor": ROUTED_SCALING_FACTOR,
        "scoring_func": "sigmoid",
        "seq_aux": True,
        "tie_word_embeddings": False,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16",
        "use_cache": True,
        **dims,
    }
    body.setdefault("rope_scaling", yarn_rope_scaling(body["max_position_embeddings"]))
    config = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": model_type, **dict(sorted(body.items())),
              **token_ids}
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    return config


def kimi_k25_config(text_config: dict[str, Any], vision_config: dict[str, Any], *, token_ids: Mapping[str, int],
                    media_placeholder_token_id: int, remote_code: bool = False,
                    top_level_quantization_config: bool = True) -> dict[str, Any]:
    """The K2.5/K2.6 wrapper (`KimiK25ForConditionalGeneration`): the text config, a MoonViT vision config, and
    (by default) the text config's quantization block repeated at the top level (docs/formats.md §1; give the text
    config `compressed_tensors_int4_config(vision=True)`).

    :param remote_code: add the keys K2.6's own files carry for its remote code (`auto_map`,
        `use_unified_vision_chunk`, `video_placeholder`), as in Moonshot's upload; False for a checkpoint that
        ships no code.
    :param top_level_quantization_config: False: the block only inside `text_config`, which is what K2.5/K2.6's
        config.json most likely holds (their configuration_kimi_k25.py copies it up when loaded; SGLang's
        KimiK25Config does the same: "Propagate quantization config from text model").
    """
    config: dict[str, Any] = {"architectures": ["KimiK25ForConditionalGeneration"]}
    if remote_code:
        config["auto_map"] = dict(KIMI_K25_AUTO_MAP)
    config.update({
        "model_type": "kimi_k25",
        "text_config": text_config,
        "vision_config": vision_config,
    })
    if remote_code:
        config["use_unified_vision_chunk"] = True
        config["video_placeholder"] = KIMI_K25_VIDEO_PLACEHOLDER
    config.update({
        "media_placeholder_token_id": media_placeholder_token_id,
        "ignore_index": -100,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        **token_ids,
    })
    if top_level_quantization_config and "quantization_config" in text_config:  # both levels must agree (convert/source checks refuse otherwise)
        config["quantization_config"] = copy.deepcopy(text_config["quantization_config"])
    return config


def deepseek_v3_config(text_config: dict[str, Any]) -> dict[str, Any]:
    """Kimi-K2-Thinking: the text config is the whole config.json (no wrapper, no `language_model.` prefix)."""
    return {**text_config, "auto_map": dict(DEEPSEEK_V3_AUTO_MAP)}
