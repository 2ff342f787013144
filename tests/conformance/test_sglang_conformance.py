"""Would SGLang (and vLLM) load our NVFP4 checkpoint the way we mean it? Rules restated in conftest.py.

"A checkpoint SGLang would misload (gate/up scale mismatch, stale config, wrong nibble order) is a bug
even if our own reader accepts it." Each test names the engine code it mirrors; docs/conformance.md
lists every requirement with its source link.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

KIMI_TEXT_PREFIX = "language_model."
EXPERT_SUFFIXES_CALIBRATED = {"weight", "weight_scale", "weight_scale_2", "input_scale"}
EXPERT_SUFFIXES_CONVERTED = EXPERT_SUFFIXES_CALIBRATED - {"input_scale"}
NVFP4_GROUP = 16  # SGLang ModelOptFp4LinearMethod / FusedMoE: `hidden_size // group_size` block scales
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # code = sign << 3 | index
E4M3_NAN_BITS = 0x7F  # float8_e4m3fn has NaN at S.1111.111 only


def _json(root: Path, name: str) -> dict:
    return json.loads((root / name).read_text())


def _text_prefix(config: dict) -> str:
    return KIMI_TEXT_PREFIX if "text_config" in config else ""


def _text_config(config: dict) -> dict:
    return config.get("text_config", config)


def _expert_tensors(headers) -> dict[str, dict[str, object]]:
    """`...mlp.experts.E.{gate,up,down}_proj` -> {suffix: Header}."""
    out: dict[str, dict[str, object]] = {}
    for name, h in headers.items():
        if ".mlp.experts." in name:
            module, suffix = name.rsplit(".", 1)
            out.setdefault(module, {})[suffix] = h
    return out


def _load(root: Path, headers, names: list[str]) -> dict[str, torch.Tensor]:
    out = {}
    for name in names:
        with safe_open(root / headers[name].file, "pt") as f:
            out[name] = f.get_tensor(name)
    return out


# ------------------------------------------------------------------ quantization config


def test_hf_quant_config_parses_as_sglang_modelopt_fp4(demo_calibrated, rules):
    _, out = demo_calibrated
    hq = _json(out, "hf_quant_config.json")
    # ModelOpt's nested form; SGLang get_config_filenames() -> ["hf_quant_config.json"].
    assert set(hq) == {"producer", "quantization"} and set(hq["producer"]) == {"name", "version"}
    assert set(hq["quantization"]) == {"quant_algo", "kv_cache_quant_algo", "group_size", "exclude_modules"}
    parsed = rules.sglang_parse_fp4_config(hq)
    assert (parsed.quant_algo, parsed.kv_cache_quant_algo, parsed.group_size) == ("NVFP4", "FP8", NVFP4_GROUP)


def test_config_json_blocks_equal_modelopt_export_of_hf_quant_config(demo_calibrated, rules):
    """config.json is what SGLang reads first (model_config.py `_parse_quant_hf_config`), at both levels."""
    from modelopt.torch.export.convert_hf_config import convert_hf_quant_config_format

    _, out = demo_calibrated
    hq, config = _json(out, "hf_quant_config.json"), _json(out, "config.json")
    expected = convert_hf_quant_config_format(hq)  # what ModelOpt's own export writes into config.json
    for block in (config["quantization_config"], config["text_config"]["quantization_config"]):
        assert block == expected
        assert block["quant_method"] == "modelopt"  # vLLM `_extract_modelopt_quant_algo` needs this prefix
        parsed = rules.sglang_parse_fp4_config(block)
        assert (parsed.quant_algo, parsed.kv_cache_quant_algo, parsed.group_size) == ("NVFP4", "FP8", NVFP4_GROUP)
        assert parsed.exclude_modules == hq["quantization"]["exclude_modules"]


def test_no_compressed_tensors_remnants(demo_calibrated, rules):
    """A stale compressed-tensors block (NVIDIA's first K2.6 upload) makes engines pick the wrong format."""
    _, out = demo_calibrated
    config = _json(out, "config.json")

    def values(node):
        if isinstance(node, dict):
            for k, v in node.items():
                yield k
                yield from values(v)
        elif isinstance(node, list):
            for v in node:
                yield from values(v)
        else:
            yield node

    seen = set(map(str, values(config)))
    assert not seen & {"compressed-tensors", "compressed_tensors", "pack-quantized", "compression_config"}
    headers = rules.read_headers(out)
    assert not [n for n in headers if n.endswith((".weight_packed", ".weight_shape"))]
    assert not [n for n, h in headers.items() if h.dtype == "I32"]


def test_kv_cache_fp8_scales_land_where_the_engines_remap_them(demo_calibrated, rules):
    """SGLang/vLLM: kv_cache_scheme {float, 8} -> FP8 KV cache; calibrate ships one k_scale and one v_scale per
    decoder layer under Model Optimizer's names, which SGLang remaps onto `self_attn.attn_mqa` (every one of them
    filled) and vLLM onto `self_attn.mla_attn.mla_attn`; F32 0-d values, never below Model Optimizer's 1.0."""
    _, out = demo_calibrated
    config = _json(out, "config.json")
    block = config["quantization_config"]
    assert block["kv_cache_scheme"] == {"dynamic": False, "num_bits": 8, "type": "float"}
    headers = rules.read_headers(out)
    kv = {n: h for n, h in headers.items() if n.endswith(("k_scale", "v_scale", "kv_scale"))}
    layers = _text_config(config)["num_hidden_layers"]
    assert {rules.sglang_kv_scale_param(n) for n in kv} == rules.sglang_kv_scale_params(layers)
    assert len(kv) == 2 * layers
    for name, h in kv.items():
        assert (h.dtype, h.shape) == ("F32", ()), name
        vllm = rules.vllm_kv_scale_param(name)
        assert vllm is not None and vllm.endswith(("self_attn.mla_attn.mla_attn.k_scale",
                                                   "self_attn.mla_attn.mla_attn.v_scale")), name
    values = _scalars(out, kv)
    assert min(values.values()) >= rules.MODELOPT_MIN_FP8_KV_SCALE


def test_kv_scale_rules_restated(rules):
    """The restated remapping on Model Optimizer's names, and what it does not touch."""
    k = "language_model.model.layers.7.self_attn.k_proj.k_scale"
    assert rules.sglang_kv_scale_param(k) == "model.layers.7.self_attn.attn_mqa.k_scale"
    assert rules.sglang_kv_scale_param(k.replace("k_proj.k_scale", "v_proj.v_scale")) == (
        "model.layers.7.self_attn.attn_mqa.v_scale")
    assert rules.sglang_kv_scale_param("model.layers.7.self_attn.kv_b_proj.weight") is None
    assert rules.vllm_kv_scale_param(k) == "language_model.model.layers.7.self_attn.mla_attn.mla_attn.k_scale"
    # a name under another module would not reach the MLA attention in either engine
    assert rules.sglang_kv_scale_param("model.layers.7.self_attn.kv_b_proj.k_scale") != (
        "model.layers.7.self_attn.attn_mqa.k_scale")
    assert rules.vllm_kv_scale_param("model.layers.7.self_attn.kv_b_proj.k_scale") is None


def _scalars(root: Path, headers) -> dict[str, float]:
    """F32 0-d tensors read straight from the safetensors bytes (no torch, no kimi_nvfp4)."""
    import struct as _struct

    out = {}
    for name, h in headers.items():
        with (root / h.file).open("rb") as f:
            (length,) = _struct.unpack("<Q", f.read(8))
            meta = json.loads(f.read(length))[name]
            f.seek(8 + length + meta["data_offsets"][0])
            (out[name],) = _struct.unpack("<f", f.read(4))
    return out


# ------------------------------------------------------------------ exclude list vs the modules engines build


def _assert_sglang_matching(out: Path, rules) -> None:
    config = _json(out, "config.json")
    prefix = _text_prefix(config)
    mods = rules.engine_modules(rules.read_headers(out), text_prefix=prefix, engine="sglang")
    exclusion = rules.SGLangExclusion(config["quantization_config"]["ignore"], kimi_k25_wrapper=bool(prefix))
    assert mods.bf16_linears and mods.moe_layers
    quantized_bf16 = [m for m in mods.bf16_linears if not exclusion.linear_unquantized(m)]
    assert quantized_bf16 == [], "SGLang would build NVFP4 params for these BF16 linears"
    excluded_moe = [m for m in mods.moe_layers if exclusion.moe_unquantized(m)]
    assert excluded_moe == [], "SGLang would load these NVFP4 experts as BF16"
    text = _text_config(config)
    assert len(mods.moe_layers) == text["num_hidden_layers"] - text["first_k_dense_replace"]


def test_sglang_exclusion_on_demo_k26_layout(demo_calibrated, rules):
    _assert_sglang_matching(demo_calibrated[1], rules)


def test_sglang_exclusion_on_deepseek_v3_layout(synthetic_deepseek_v3, rules):
    _assert_sglang_matching(synthetic_deepseek_v3, rules)


def test_sglang_exclusion_with_two_digit_layers(synthetic_kimi_12_layers, rules):
    _assert_sglang_matching(synthetic_kimi_12_layers, rules)


# vLLM's KimiK25ForConditionalGeneration names the text modules `language_model.layers.N...` and does not
# remap the exclude list, so the wrapper layout must also carry entries in that spelling (engine_spellings).
@pytest.mark.parametrize(
    "checkpoint",
    [
        "synthetic_deepseek_v3",
        "demo_calibrated",
    ],
)
def test_vllm_exclusion(checkpoint, request, rules):
    fixture = request.getfixturevalue(checkpoint)
    out = fixture[1] if isinstance(fixture, tuple) else fixture
    config = _json(out, "config.json")
    mods = rules.engine_modules(rules.read_headers(out), text_prefix=_text_prefix(config), engine="vllm")
    exclusion = rules.VLLMExclusion(config["quantization_config"]["ignore"])
    assert [m for m in mods.bf16_linears if not exclusion.unquantized(m)] == []
    assert [m for m in mods.moe_layers if exclusion.unquantized(m)] == []


def test_restated_rules_catch_bad_exclude_lists(synthetic_kimi_12_layers, rules):
    """The checks above can fail: three exclude lists SGLang would misload, each caught."""
    mods = rules.engine_modules(
        rules.read_headers(synthetic_kimi_12_layers), text_prefix=KIMI_TEXT_PREFIX, engine="sglang"
    )
    overbroad = rules.SGLangExclusion(["language_model.model.layers.1*"], kimi_k25_wrapper=True)
    assert overbroad.moe_unquantized("model.layers.10.mlp.experts")  # layer 10's experts lost to `layers.1*`
    no_shared = rules.SGLangExclusion(["language_model.model.layers.2.self_attn*"], kimi_k25_wrapper=True)
    assert "model.layers.2.mlp.shared_experts.gate_up_proj" in mods.bf16_linears
    assert not no_shared.linear_unquantized("model.layers.2.mlp.shared_experts.gate_up_proj")
    half_fused = rules.SGLangExclusion(["model.layers.2.self_attn.q_a_proj"], kimi_k25_wrapper=False)
    with pytest.raises(ValueError, match="some but not all shards"):
        half_fused.linear_unquantized("model.layers.2.self_attn.fused_qkv_a_proj_with_mqa")


# ------------------------------------------------------------------ expert tensors


def _expected_shape(proj: str, text: dict) -> tuple[int, int]:
    hidden, inter = text["hidden_size"], text["moe_intermediate_size"]
    return (hidden, inter) if proj == "down_proj" else (inter, hidden)


def test_expert_tensors_match_sglang_fused_moe_params(demo_calibrated, rules):
    """ModelOptNvFp4FusedMoEMethod.create_weights: w13/w2 weight uint8 [.., in/2], weight_scale e4m3
    [.., in/16] (flashinfer_trtllm asserts exactly in/16), weight_scale_2 and input_scale f32 per expert.
    Every expert must be present: the params are torch.empty, a missing tensor stays garbage."""
    _, out = demo_calibrated
    text = _text_config(_json(out, "config.json"))
    experts = _expert_tensors(rules.read_headers(out))
    n_moe = text["num_hidden_layers"] - text["first_k_dense_replace"]
    assert len(experts) == n_moe * text["n_routed_experts"] * 3
    for module, tensors in experts.items():
        assert set(tensors) == EXPERT_SUFFIXES_CALIBRATED, module
        rows, cols = _expected_shape(module.rsplit(".", 1)[1], text)
        got = {s: (h.dtype, h.shape) for s, h in tensors.items()}
        assert got == {
            "weight": ("U8", (rows, cols // 2)),
            "weight_scale": ("F8_E4M3", (rows, cols // NVFP4_GROUP)),
            "weight_scale_2": ("F32", ()),
            "input_scale": ("F32", ()),
        }, module


def test_converted_but_uncalibrated_has_no_placeholder_input_scale(synthetic_deepseek_v3, rules):
    """Convert alone writes no input_scale: SGLang would serve torch.empty garbage for W4A4, so a
    placeholder would hide that calibrate is still needed."""
    for module, tensors in _expert_tensors(rules.read_headers(synthetic_deepseek_v3)).items():
        assert set(tensors) == EXPERT_SUFFIXES_CONVERTED, module


def test_only_experts_carry_quantization_tensors(demo_calibrated, rules):
    """BF16 modules keep a plain BF16 `weight` (UnquantizedLinearMethod); no stray scales next to them."""
    _, out = demo_calibrated
    headers = rules.read_headers(out)
    scales = [n for n in headers if n.endswith(("weight_scale", "weight_scale_2", "input_scale"))]
    assert scales and all(".mlp.experts." in n for n in scales)
    non_expert_linears = [h for n, h in headers.items() if ".mlp.experts." not in n and len(h.shape) == 2]
    assert non_expert_linears and {h.dtype for h in non_expert_linears} == {"BF16"}


def test_gate_up_share_scales_bitwise(demo_calibrated, rules):
    """SGLang keeps gate's weight_scale_2 for the fused w13 (`w13_weight_scale_2[:, 0]`, only a warning on
    mismatch) and reduces w13 input scales by max; so gate and up must carry identical values."""
    _, out = demo_calibrated
    headers = rules.read_headers(out)
    gates = [m for m in _expert_tensors(headers) if m.endswith(".gate_proj")]
    for gate in gates:
        up = gate.removesuffix("gate_proj") + "up_proj"
        names = [f"{m}.{s}" for m in (gate, up) for s in ("weight_scale_2", "input_scale")]
        t = _load(out, headers, names)
        for s in ("weight_scale_2", "input_scale"):
            g, u = t[f"{gate}.{s}"], t[f"{up}.{s}"]
            assert torch.equal(g.view(torch.int32), u.view(torch.int32)), f"{gate} {s}"
            assert torch.isfinite(g) and g > 0, f"{gate} {s}"
        # ModelOpt convention amax / (6 * 448), which SGLang inverts itself (`w13_input_scale_quant = 1 / s`);
        # compressed-tensors' reciprocal global scale would exceed 1 for any activation amax below 2688.
        assert t[f"{gate}.input_scale"] < 1, gate


def test_block_scales_are_finite_and_nonnegative(demo_calibrated, rules):
    _, out = demo_calibrated
    headers = rules.read_headers(out)
    names = [n for n in headers if n.endswith(".weight_scale") and ".experts.0." in n]
    for name, t in _load(out, headers, names).items():
        bits = t.view(torch.uint8)
        assert not ((bits & 0x7F) == E4M3_NAN_BITS).any(), name
        assert not (bits & 0x80).any(), name


def _decode_nvfp4(packed: torch.Tensor, block: torch.Tensor, scale_2: torch.Tensor, low_first: bool) -> torch.Tensor:
    lo, hi = (packed & 0x0F).long(), (packed >> 4).long()
    first, second = (lo, hi) if low_first else (hi, lo)
    codes = torch.stack([first, second], dim=-1).reshape(packed.shape[0], -1)
    table = torch.tensor(E2M1_MAGNITUDES + tuple(-m for m in E2M1_MAGNITUDES))
    values = table[codes]
    return values * block.float().repeat_interleave(NVFP4_GROUP, dim=1) * scale_2.float()


def test_even_input_column_is_the_low_nibble(demo_calibrated, rules):
    """sgl-kernel / flashinfer FP4 GEMMs read element 2k from bits 0-3 of byte k (ModelOpt's packing)."""
    from kimi_nvfp4.numerics.int4 import dequantize_int4

    source, out = demo_calibrated
    headers, src_headers = rules.read_headers(out), rules.read_headers(source)
    module = f"{KIMI_TEXT_PREFIX}model.layers.1.mlp.experts.0.gate_proj"
    t = _load(out, headers, [f"{module}.{s}" for s in ("weight", "weight_scale", "weight_scale_2")])
    s = _load(source, src_headers, [f"{module}.weight_packed", f"{module}.weight_scale"])
    reference = dequantize_int4(
        s[f"{module}.weight_packed"], s[f"{module}.weight_scale"], t[f"{module}.weight"].shape[1] * 2
    )

    def rel_err(low_first: bool) -> float:
        w = _decode_nvfp4(t[f"{module}.weight"], t[f"{module}.weight_scale"], t[f"{module}.weight_scale_2"], low_first)
        return float(((w - reference) ** 2).mean() / (reference**2).mean())

    assert rel_err(low_first=True) < 0.05
    assert rel_err(low_first=False) > 10 * rel_err(low_first=True)


# ------------------------------------------------------------------ index


def test_index_covers_every_shard_and_counts_tensor_bytes(demo_calibrated, rules):
    """SGLang keeps only the *.safetensors files named in the index (`filter_duplicate_safetensors_files`);
    input scales in a file the index forgot would silently not load."""
    _, out = demo_calibrated
    index = _json(out, "model.safetensors.index.json")
    headers = rules.read_headers(out)
    assert {n: h.file for n, h in headers.items()} == index["weight_map"]
    assert index["metadata"]["total_size"] == sum(h.nbytes for h in headers.values())
    assert "model-input-scales.safetensors" in set(index["weight_map"].values())
