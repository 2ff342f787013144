"""Oracle: the reference model's logits equal transformers' DeepseekV3ForCausalLM (fp32, 1e-4 relative).

The INT4 checkpoint's weights (experts dequantized exactly) are mapped into transformers' layout,
fused experts included (`gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`). `rms_norm_eps` is set
to 1e-6 because transformers builds q_a_layernorm / kv_a_layernorm with that default while SGLang
(and this model) use the config's eps (docs/model.md).
"""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from kimi_nvfp4.model import Int4SourceWeights, K2Model, LayerStreamRunner, open_weights
from kimi_nvfp4.model.layer_weights import MoEWeights
from kimi_nvfp4.synth import create_synthetic_checkpoint

from .conftest import TEST_VOCAB

ORACLE_REL_TOL = 1e-4
HF_EPS = 1e-6  # transformers' DeepseekV3RMSNorm default, used for the latent norms


def hf_config(c) -> DeepseekV3Config:
    rs = dict(c.rope_scaling or {})
    rope = {"rope_type": rs.pop("type", rs.pop("rope_type", "default")), "rope_theta": c.rope_theta, **rs}
    return DeepseekV3Config(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        moe_intermediate_size=c.moe_intermediate_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_attention_heads,
        n_shared_experts=c.n_shared_experts, n_routed_experts=c.n_routed_experts,
        routed_scaling_factor=c.routed_scaling_factor, kv_lora_rank=c.kv_lora_rank, q_lora_rank=c.q_lora_rank,
        qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim, qk_nope_head_dim=c.qk_nope_head_dim,
        n_group=c.n_group, topk_group=c.topk_group, num_experts_per_tok=c.num_experts_per_tok,
        first_k_dense_replace=c.first_k_dense_replace, norm_topk_prob=c.norm_topk_prob,
        max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
        rope_parameters=rope, tie_word_embeddings=False, attn_implementation="eager",
    )


def hf_model(source: Int4SourceWeights) -> DeepseekV3ForCausalLM:
    c = source.config
    model = DeepseekV3ForCausalLM(hf_config(c)).to(torch.float32).eval()
    sd = {
        "model.embed_tokens.weight": source.embed("cpu").float(),
        "model.norm.weight": source.final_norm("cpu"),
        "lm_head.weight": source.lm_head("cpu").float(),
    }
    for i in range(c.num_hidden_layers):
        w = source.layer(i, "cpu")
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = w.input_layernorm
        sd[p + "post_attention_layernorm.weight"] = w.post_attention_layernorm
        sd[p + "self_attn.kv_a_layernorm.weight"] = w.self_attn.kv_a_layernorm
        if w.self_attn.q_a_layernorm is not None:
            sd[p + "self_attn.q_a_layernorm.weight"] = w.self_attn.q_a_layernorm
        if isinstance(w.mlp, MoEWeights):
            sd[p + "mlp.gate.weight"] = w.mlp.router_weight
            sd[p + "mlp.gate.e_score_correction_bias"] = w.mlp.e_score_correction_bias
            sd[p + "mlp.experts.gate_up_proj"] = torch.stack(
                [torch.cat([e.gate_proj.weight(), e.up_proj.weight()]) for e in w.mlp.experts]
            )
            sd[p + "mlp.experts.down_proj"] = torch.stack([e.down_proj.weight() for e in w.mlp.experts])
            linears = list(w.self_attn.linears()) + list(w.mlp.shared_experts.linears())
        else:
            linears = list(w.linears())
        for lin in linears:
            sd[f"{p}{lin.module}.weight"] = lin.weight()
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and not [m for m in missing if "rotary" not in m], (missing, unexpected)
    return model


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param({}, id="k2.6-layout"),
        pytest.param({"n_group": 2, "topk_group": 1, "layout": "deepseek_v3"}, id="grouped-routing-thinking-layout"),
        pytest.param({"q_lora_rank": None, "rope_scaling": None}, id="plain-q-proj-no-yarn"),
    ],
)
def test_logits_match_transformers(tmp_path, overrides):
    layout = overrides.pop("layout", "kimi_k25")
    ckpt = create_synthetic_checkpoint(
        tmp_path / "ckpt", vocab_size=TEST_VOCAB, layout=layout, seed=3,
        config_overrides={"rms_norm_eps": HF_EPS, **overrides},
    )
    source = open_weights(ckpt)
    assert isinstance(source, Int4SourceWeights)
    reference = hf_model(source)
    gen = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, TEST_VOCAB, (n,), generator=gen) for n in (37, 5, 80)]

    ours = list(LayerStreamRunner(source, max_chunk_tokens=16, progress=False).run(sequences))
    for ids, logits in zip(sequences, ours):
        with torch.no_grad():
            ref = reference(input_ids=ids[None]).logits[0]
        assert logits.shape == ref.shape
        assert rel_err(logits, ref) < ORACLE_REL_TOL

    # the whole-model path (KV cache, fed in two pieces) agrees too
    model = K2Model(source)
    first, cache = model.forward(sequences[2][:50])
    second, _ = model.forward(sequences[2][50:], cache)
    with torch.no_grad():
        ref = reference(input_ids=sequences[2][None]).logits[0]
    assert rel_err(torch.cat([first, second]), ref) < ORACLE_REL_TOL
