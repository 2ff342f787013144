"""The INT4 demo checkpoint as transformers' DeepseekV3ForCausalLM, its INT4 experts dequantized exactly.

Every weight comes from our own `Int4SourceWeights` loader (INT4 experts: `q * bf16 group scale`, exact in
fp32; everything else as stored), so the HF model and our reference model are the same function of the same
numbers; tests/bench/test_modelopt_hf_model.py holds their logits equal within fp32 summation-order noise.

The config is the checkpoint's own `text_config` (model_type deepseek_v3), with two settings aligned to the
engine our reference follows: eager attention in fp32, and `q_a_layernorm` / `kv_a_layernorm` built with
`rms_norm_eps` (SGLang's DeepseekV2AttentionMLA does; transformers leaves them at its 1e-6 default).

Routed experts stay transformers 5's fused 3-D parameters (`mlp.experts.gate_up_proj [E, 2I, H]`, `down_proj
[E, H, I]`, gate rows first): Model Optimizer 0.47 quantizes those itself through its `_QuantFusedExperts`
plugin (per-expert weight quantizers over each expert's slice, ONE input quantizer per layer for gate/up and
one for down, shared by the experts -- SGLang's per-layer static input scales) and exports them per expert
(`modelopt.torch.export.moe_utils._export_fused_experts`), so nothing is unfused here.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kimi_nvfp4.checkpoint.reader import CheckpointReader
from kimi_nvfp4.model import Int4SourceWeights
from kimi_nvfp4.model.layer_weights import MLPWeights, MoEWeights

TEXT_CONFIG_KEY = "text_config"
DROPPED_KEYS = ("quantization_config", "architectures", "auto_map")
ATTENTION = "eager"


def deepseek_v3_config(checkpoint: str | Path):
    from transformers import DeepseekV3Config

    raw = json.loads((Path(checkpoint) / "config.json").read_text())
    text = {k: v for k, v in raw.get(TEXT_CONFIG_KEY, raw).items() if k not in DROPPED_KEYS}
    cfg = DeepseekV3Config(**text)
    cfg._attn_implementation = ATTENTION
    return cfg


def _copy_mlp(dst: torch.nn.Module, w: MLPWeights) -> None:
    for name in ("gate_proj", "up_proj", "down_proj"):
        getattr(dst, name).weight.copy_(getattr(w, name).weight())


def _copy_moe(dst: torch.nn.Module, w: MoEWeights) -> None:
    dst.gate.weight.copy_(w.router_weight)
    if w.e_score_correction_bias is not None:
        dst.gate.e_score_correction_bias.copy_(w.e_score_correction_bias)
    for e, expert in enumerate(w.experts):
        dst.experts.gate_up_proj[e].copy_(torch.cat([expert.gate_proj.weight(), expert.up_proj.weight()]))
        dst.experts.down_proj[e].copy_(expert.down_proj.weight())
    if w.shared_experts is not None:
        _copy_mlp(dst.shared_experts, w.shared_experts)


def _copy_attention(dst: torch.nn.Module, w, eps: float) -> None:
    for name in ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
        lin = getattr(w, name)
        if lin is not None:
            getattr(dst, name).weight.copy_(lin.weight())
    for name in ("q_a_layernorm", "kv_a_layernorm"):
        norm = getattr(w, name)
        if norm is not None:
            getattr(dst, name).weight.copy_(norm)
            getattr(dst, name).variance_epsilon = eps  # the engine's eps (module docstring)


@torch.no_grad()
def load_deepseek_v3(checkpoint: str | Path):
    """`DeepseekV3ForCausalLM` in fp32 on CPU holding the checkpoint's weights (INT4 experts dequantized)."""
    from transformers import DeepseekV3ForCausalLM

    cfg = deepseek_v3_config(checkpoint)
    model = DeepseekV3ForCausalLM(cfg).to(torch.float32).eval()
    src = Int4SourceWeights(CheckpointReader(checkpoint))
    model.model.embed_tokens.weight.copy_(src.embed("cpu"))
    model.model.norm.weight.copy_(src.final_norm("cpu"))
    model.lm_head.weight.copy_(src.lm_head("cpu"))
    for i, layer in enumerate(model.model.layers):
        w = src.layer(i, "cpu", torch.float32)
        layer.input_layernorm.weight.copy_(w.input_layernorm)
        layer.post_attention_layernorm.weight.copy_(w.post_attention_layernorm)
        _copy_attention(layer.self_attn, w.self_attn, cfg.rms_norm_eps)
        (_copy_moe if isinstance(w.mlp, MoEWeights) else _copy_mlp)(layer.mlp, w.mlp)
    src.close()
    return model
