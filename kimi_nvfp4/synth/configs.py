"""config.json contents of synthetic Kimi K2 checkpoints, laid out as Moonshot ships them (docs/formats.md §1),
built by the one checkpoint builder (kimi_nvfp4/checkpoint_builder/config.py) with synth's presets.

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

from enum import Enum
from typing import Any

from ..checkpoint_builder import compressed_tensors_int4_config, k2_text_config, yarn_rope_scaling
from ..checkpoint_builder import kimi_k25_config as builder_kimi_k25_config
from ..checkpoint_builder.config import DEFAULT_YARN_BETA_FAST, K2_TEXT_MODEL_TYPE, K2_YARN_BETA_FAST
from ..checkpoint_builder.tokenizer_files import (
    BOS_TOKEN,
    EOS_TOKEN,
    KIMI_VOCAB_SIZE,
    MEDIA_PLACEHOLDER_TOKEN,
    PAD_TOKEN,
    special_id,
)

# Kimi's own special ids (163584 BPE ranks, then 256 special / reserved ids), kept whatever `vocab_size` is.
KIMI_BOS_ID = special_id(BOS_TOKEN)
KIMI_EOS_ID = special_id(EOS_TOKEN)
KIMI_PAD_ID = special_id(PAD_TOKEN)
KIMI_MEDIA_PLACEHOLDER_ID = special_id(MEDIA_PLACEHOLDER_TOKEN)
KIMI_TOKEN_IDS = {"bos_token_id": KIMI_BOS_ID, "eos_token_id": KIMI_EOS_ID, "pad_token_id": KIMI_PAD_ID}

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
    },
}

# YaRN beta_fast per preset: K2.6's real 32 for `k2.6`; `tiny` keeps 1.0, the value its configs always had.
YARN_BETA_FAST = {"tiny": DEFAULT_YARN_BETA_FAST, "k2.6": K2_YARN_BETA_FAST}

VISION_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"vt_hidden_size": 32, "vt_intermediate_size": 64, "vt_num_hidden_layers": 1, "vt_num_attention_heads": 2,
             "init_pos_emb_height": 4, "init_pos_emb_width": 4},
    "k2.6": {"vt_hidden_size": 1152, "vt_intermediate_size": 4304, "vt_num_hidden_layers": 1, "vt_num_attention_heads": 16,
             "init_pos_emb_height": 64, "init_pos_emb_width": 64},
}
# The MoonViT / projector keys of K2.5/K2.6's config.json `vision_config` whose values do not depend on the size
# (SGLang's KimiK25VisionConfig reads them; `model_type` is an empty string there).
MOONVIT_FIXED_KEYS: dict[str, Any] = {
    "init_pos_emb_time": 4,
    "merge_kernel_size": [2, 2],
    "merge_type": "sd2_tpool",
    "mm_projector_type": "patchmerger",
    "model_type": "",
    "patch_size": 14,
    "pos_emb_type": "divided_fixed",
    "projector_hidden_act": "gelu",
    "projector_ln_eps": 1e-05,
    "video_attn_type": "spatial_temporal",
}


class QuantConfigPlacement(str, Enum):
    """Where the compressed-tensors block sits in a K2.5/K2.6 config.json."""

    BOTH = "both"  # top level and text_config (the bundled demo; what older K2.5 tooling wrote)
    TEXT_CONFIG = "text_config"  # only inside text_config: what K2.5/K2.6 most likely ship


# k2.6 looks like the real upload; tiny keeps both levels (what its tests and pinned outputs were made with).
DEFAULT_QUANT_CONFIG_PLACEMENT = {"tiny": QuantConfigPlacement.BOTH, "k2.6": QuantConfigPlacement.TEXT_CONFIG}
PRESETS = tuple(TEXT_PRESETS)


def deepseek_v3_text_config(
    preset: str,
    *,
    layers: int | None = None,
    experts: int | None = None,
    vocab_size: int = KIMI_VOCAB_SIZE,
    overrides: dict[str, Any] | None = None,
    vision: bool = True,
) -> dict[str, Any]:
    """Every key of a DeepseekV3 `config.json` (as in Kimi K2), with the preset's dimensions and the
    compressed-tensors INT4 block (`vision`: the K2.5/K2.6 wrapper's, which also ignores the vision tower)."""
    dims = dict(TEXT_PRESETS[preset])
    if layers is not None:
        dims["num_hidden_layers"] = layers
    if experts is not None:
        dims["n_routed_experts"] = experts
        dims["num_experts_per_tok"] = min(dims["num_experts_per_tok"], experts)
    dims["rope_scaling"] = yarn_rope_scaling(dims["max_position_embeddings"], beta_fast=YARN_BETA_FAST[preset])
    dims = {**dims, "vocab_size": vocab_size, **(overrides or {})}
    return k2_text_config(dims, token_ids=KIMI_TOKEN_IDS, model_type=K2_TEXT_MODEL_TYPE,
                          quantization_config=compressed_tensors_int4_config(vision=vision))


def vision_config(preset: str, text_hidden_size: int) -> dict[str, Any]:
    """K2.5/K2.6's `vision_config` keys (sorted, as their config.json), at the preset's sizes."""
    v = VISION_PRESETS[preset]
    keys = {**MOONVIT_FIXED_KEYS, **v, "mm_hidden_size": v["vt_hidden_size"], "text_hidden_size": text_hidden_size}
    return dict(sorted(keys.items()))


def kimi_k25_config(
    text_config: dict[str, Any], preset: str, placement: QuantConfigPlacement | str | None = None
) -> dict[str, Any]:
    """The K2.5/K2.6 wrapper as Moonshot ships it (with its remote-code keys), around `text_config`.
    `placement`: where the quantization block goes (default: the preset's, DEFAULT_QUANT_CONFIG_PLACEMENT)."""
    placement = QuantConfigPlacement(placement or DEFAULT_QUANT_CONFIG_PLACEMENT[preset])
    return builder_kimi_k25_config(text_config, vision_config(preset, text_config["hidden_size"]),
                                   token_ids=KIMI_TOKEN_IDS, media_placeholder_token_id=KIMI_MEDIA_PLACEHOLDER_ID,
                                   remote_code=True,
                                   top_level_quantization_config=placement is QuantConfigPlacement.BOTH)
