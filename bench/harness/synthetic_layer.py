"""One K2.6-shaped MoE decoder layer synthesised in memory (random INT4 codes + bf16 group scales, random NVFP4
codes + E4M3 block scales): what bench.speed.model_layer times and bench.quality.batch_invariance runs."""

from __future__ import annotations


import torch

from kimi_nvfp4.checkpoint.k2_config import K2Config
from kimi_nvfp4.model.layer_weights import (
    AttentionWeights,
    LayerWeights,
    MLPWeights,
    MoEWeights,
)
from kimi_nvfp4.model.linear import (
    ActivationMode,
    DenseLinear,
    Int4Linear,
    Linear,
    NVFP4Linear,
)
from kimi_nvfp4.numerics.constants import (
    E4M3_MAX,
    INT4_GROUP_SIZE,
    INT4_PER_INT32,
    NVFP4_BLOCK_SIZE,
    NVFP4_TENSOR_SCALE_DENOMINATOR,
)
from kimi_nvfp4.numerics.nvfp4 import NVFP4Tensor

MODES = ("int4", "nvfp4-w4a4", "nvfp4-w4a16")
# Synthetic magnitudes, typical of trained K2 projections.
WEIGHT_STD = 0.02
WEIGHT_AMAX = 0.12
ACTIVATION_AMAX = 8.0
MOE_LAYER = 1  # layer 0 is the dense one (first_k_dense_replace = 1)
TINY_VOCAB = 512


class InMemoryLayerSource:
    """A WeightSource that hands out one prebuilt layer (the bench times compute, not disk)."""

    def __init__(self, config: K2Config, layer: LayerWeights):
        self.config = config
        self._layer = layer

    def layer(self, i, device, dtype=torch.float32):
        return self._layer


def _bf16_linear(name: str, out_f: int, in_f: int, device, g, dtype=torch.float32) -> Linear:
    w = (torch.randn(out_f, in_f, device=device, generator=g) * WEIGHT_STD).to(torch.bfloat16)
    return DenseLinear(name, w, dtype)


def _expert_linear(name: str, out_f: int, in_f: int, mode: str, device, g, dtype=torch.float32) -> Linear:
    if mode == "int4":
        packed = torch.randint(-(2**31), 2**31 - 1, (out_f, in_f // INT4_PER_INT32), dtype=torch.int32, device=device, generator=g)
        scale = (torch.rand(out_f, in_f // INT4_GROUP_SIZE, device=device, generator=g) + 0.5) * (WEIGHT_STD / 4)
        return Int4Linear(name, packed, scale.to(torch.bfloat16), in_f, dtype)
    codes = torch.randint(0, 256, (out_f, in_f // 2), dtype=torch.uint8, device=device, generator=g)
    block = torch.rand(out_f, in_f // NVFP4_BLOCK_SIZE, device=device, generator=g) * E4M3_MAX
    tensor = NVFP4Tensor(
        codes, block.clamp(min=1.0).to(torch.float8_e4m3fn),
        torch.tensor(WEIGHT_AMAX / NVFP4_TENSOR_SCALE_DENOMINATOR, device=device),
    )
    activations = ActivationMode.W4A4 if mode == "nvfp4-w4a4" else ActivationMode.W4A16
    input_scale = torch.tensor(ACTIVATION_AMAX / NVFP4_TENSOR_SCALE_DENOMINATOR, device=device)
    return NVFP4Linear(name, tensor, dtype, input_scale=input_scale, mode=activations)


def synthetic_moe_layer(cfg: K2Config, mode: str, device, seed: int = 0, dtype=torch.float32) -> LayerWeights:
    """One K2.6-shaped MoE layer with random weights; `dtype`: the compute dtype its linears dequantize to."""
    g = torch.Generator(device=device).manual_seed(seed)
    h, n_h = cfg.hidden_size, cfg.num_attention_heads
    a = "self_attn."
    attn = AttentionWeights(
        q_a_proj=_bf16_linear(f"{a}q_a_proj", cfg.q_lora_rank, h, device, g, dtype),
        q_a_layernorm=torch.ones(cfg.q_lora_rank, device=device),
        q_b_proj=_bf16_linear(f"{a}q_b_proj", n_h * cfg.qk_head_dim, cfg.q_lora_rank, device, g, dtype),
        kv_a_proj_with_mqa=_bf16_linear(f"{a}kv_a_proj_with_mqa", cfg.kv_lora_rank + cfg.qk_rope_head_dim, h, device, g, dtype),
        kv_a_layernorm=torch.ones(cfg.kv_lora_rank, device=device),
        kv_b_proj=_bf16_linear(f"{a}kv_b_proj", n_h * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank, device, g, dtype),
        o_proj=_bf16_linear(f"{a}o_proj", h, n_h * cfg.v_head_dim, device, g, dtype),
    )
    width = cfg.moe_intermediate_size
    experts = [
        MLPWeights(
            _expert_linear(f"mlp.experts.{e}.gate_proj", width, h, mode, device, g, dtype),
            _expert_linear(f"mlp.experts.{e}.up_proj", width, h, mode, device, g, dtype),
            _expert_linear(f"mlp.experts.{e}.down_proj", h, width, mode, device, g, dtype),
        )
        for e in range(cfg.n_routed_experts)
    ]
    shared_w = width * cfg.n_shared_experts
    shared = MLPWeights(
        _bf16_linear("mlp.shared_experts.gate_proj", shared_w, h, device, g, dtype),
        _bf16_linear("mlp.shared_experts.up_proj", shared_w, h, device, g, dtype),
        _bf16_linear("mlp.shared_experts.down_proj", h, shared_w, device, g, dtype),
    )
    moe = MoEWeights(
        router_weight=torch.randn(cfg.n_routed_experts, h, device=device, generator=g) * WEIGHT_STD,
        e_score_correction_bias=torch.rand(cfg.n_routed_experts, device=device, generator=g) * 0.01,
        experts=experts,
        shared_experts=shared,
    )
    return LayerWeights(MOE_LAYER, torch.ones(h, device=device), torch.ones(h, device=device), attn, moe)


def layer_bytes(layer: LayerWeights) -> int:
    seen = 0
    for lin in layer.linears():
        for t in vars(lin).values():
            if isinstance(t, torch.Tensor):
                seen += t.numel() * t.element_size()
            elif isinstance(t, NVFP4Tensor):
                seen += sum(x.numel() * x.element_size() for x in (t.weight, t.weight_scale, t.weight_scale_2))
    return seen
