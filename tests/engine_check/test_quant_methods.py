"""The quant-method audit: what the checkpoint holds per engine module, against the engine's method."""

from __future__ import annotations

from kimi_nvfp4.engine_check.quant_methods import audit_methods

NVFP4 = [f"lm.layers.1.mlp.experts.{e}.{p}" for e in range(2) for p in ("gate_proj", "up_proj", "down_proj")]
PACKED = {"gate_up_proj": ["gate_proj", "up_proj"], "fused_qkv_a_proj_with_mqa": ["q_a_proj", "kv_a_proj_with_mqa"]}


def test_agreeing_methods_count_nvfp4_modules_and_methods():
    assigned = [
        ("lm.layers.1.mlp.experts", "ModelOptNvFp4FusedMoEMethod", True),
        ("lm.layers.1.mlp.shared_experts.gate_up_proj", "UnquantizedLinearMethod", False),
        ("lm.layers.1.self_attn.fused_qkv_a_proj_with_mqa", "UnquantizedLinearMethod", False),
        ("lm.layers.1.self_attn.attn_mqa", "ModelOptFp8KVCacheMethod", None),
    ]
    out = audit_methods(assigned, NVFP4, PACKED, kv_cache_declared=True)
    assert out.mismatches == [] and out.nvfp4_modules == 1
    assert out.by_method == {"ModelOptNvFp4FusedMoEMethod": 1, "UnquantizedLinearMethod": 2, "ModelOptFp8KVCacheMethod": 1}


def test_disagreements_in_both_directions_and_an_undeclared_kv_method_are_reported():
    assigned = [
        ("lm.layers.1.mlp.experts", "UnquantizedFusedMoEMethod", False),  # NVFP4 experts served as BF16
        ("lm.layers.1.mlp.shared_experts.gate_up_proj", "ModelOptFp4LinearMethod", True),  # BF16 linear as NVFP4
        ("lm.layers.1.self_attn.attn_mqa", "ModelOptFp8KVCacheMethod", None),
    ]
    out = audit_methods(assigned, NVFP4, PACKED, kv_cache_declared=False)
    assert len(out.mismatches) == 3
    assert "checkpoint holds NVFP4 tensors" in out.mismatches[0]
    assert "checkpoint holds no NVFP4 tensor (BF16)" in out.mismatches[1]
    assert "declares no KV-cache quantization" in out.mismatches[2]


def test_a_fused_module_holds_nvfp4_when_one_of_its_shards_does():
    nvfp4 = ["lm.layers.2.mlp.gate_proj", "lm.layers.2.mlp.up_proj"]
    out = audit_methods([("lm.layers.2.mlp.gate_up_proj", "UnquantizedLinearMethod", False)], nvfp4, PACKED,
                        kv_cache_declared=True)
    assert out.nvfp4_modules == 1 and len(out.mismatches) == 1
