"""A tiny MoonViT-shaped `vision_tower` and `mm_projector`, so the demo checkpoint has K2.6's
pass-through BF16 tensors.

The weights are seeded random values, not a trained vision model: the pipeline never runs them
(convert copies them bit for bit, docs/formats.md §2 keeps them BF16); they exist so every stage meets the
same tensor families as in the real checkpoint. Names follow MoonViT's module tree as shipped
with Kimi K2.5/K2.6 (patch embedding, encoder blocks with fused wqkv, patch-merging projector).
"""

from __future__ import annotations

from typing import Any

import torch

PATCH_SIZE = 14
MERGE_KERNEL = (2, 2)
INIT_POS_EMB = 8  # position-embedding grid (64 x 64 in K2.6)
INIT_POS_EMB_TIME = 4  # frames per video chunk, as in K2.6


def vision_config(
    text_hidden: int, hidden: int = 64, layers: int = 1, heads: int = 2, intermediate: int = 128
) -> dict[str, Any]:
    """K2.6's vision_config keys at toy size, plus the unprefixed sizes SGLang's MoonViT reads.

    K2.6 ships the tower sizes as `vt_*` and the projector's input/output widths as `mm_hidden_size` /
    `text_hidden_size`; SGLang 0.5.23 builds `K2VLMultiModalProjector` from `vt_hidden_size` and
    `text_hidden_size` but the tower itself from `hidden_size`, `num_hidden_layers`, ... whose defaults
    are K2.6's sizes (srt/configs/kimi_k25.py `KimiK25VisionConfig`). A model of another size must
    therefore state both spellings.
    """
    return {
        "model_type": "moonvit",
        "patch_size": PATCH_SIZE,
        "init_pos_emb_height": INIT_POS_EMB,
        "init_pos_emb_width": INIT_POS_EMB,
        "init_pos_emb_time": INIT_POS_EMB_TIME,
        "pos_emb_type": "divided_fixed",
        "merge_kernel_size": list(MERGE_KERNEL),
        "merge_type": "sd2_tpool",
        "video_attn_type": "spatial_temporal",
        "vt_hidden_size": hidden,
        "vt_num_hidden_layers": layers,
        "vt_num_attention_heads": heads,
        "vt_intermediate_size": intermediate,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "intermediate_size": intermediate,
        "mm_projector_type": "patchmerger",
        "mm_hidden_size": hidden,
        "projector_hidden_act": "gelu",
        "projector_ln_eps": 1e-05,
        "text_hidden_size": text_hidden,
    }


def vision_tensors(cfg: dict[str, Any], text_hidden: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    merged = h * MERGE_KERNEL[0] * MERGE_KERNEL[1]

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.bfloat16)

    def zeros(n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.bfloat16)

    t: dict[str, torch.Tensor] = {
        "vision_tower.patch_embed.proj.weight": rnd(h, 3, PATCH_SIZE, PATCH_SIZE),
        "vision_tower.patch_embed.proj.bias": zeros(h),
        "vision_tower.patch_embed.pos_emb.weight": rnd(cfg["init_pos_emb_height"], cfg["init_pos_emb_width"], h),
        "vision_tower.encoder.final_layernorm.weight": ones(h),
        "vision_tower.encoder.final_layernorm.bias": zeros(h),
        "mm_projector.pre_norm.weight": ones(h),
        "mm_projector.pre_norm.bias": zeros(h),
        "mm_projector.proj.0.weight": rnd(merged, merged),
        "mm_projector.proj.0.bias": zeros(merged),
        "mm_projector.proj.2.weight": rnd(text_hidden, merged),
        "mm_projector.proj.2.bias": zeros(text_hidden),
    }
    for i in range(cfg["num_hidden_layers"]):
        b = f"vision_tower.encoder.blocks.{i}."
        t.update({
            b + "norm0.weight": ones(h), b + "norm0.bias": zeros(h),
            b + "wqkv.weight": rnd(3 * h, h), b + "wqkv.bias": zeros(3 * h),
            b + "wo.weight": rnd(h, h), b + "wo.bias": zeros(h),
            b + "norm1.weight": ones(h), b + "norm1.bias": zeros(h),
            b + "mlp.fc0.weight": rnd(inter, h), b + "mlp.fc0.bias": zeros(inter),
            b + "mlp.fc1.weight": rnd(h, inter), b + "mlp.fc1.bias": zeros(h),
        })
    return t
