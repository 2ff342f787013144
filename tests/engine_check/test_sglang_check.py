"""SGLang 0.5.23's own loader over our outputs (skipped without SGLang): both activation states of the demo,
a weight-only checkpoint on the W4A4-only TRT-LLM backend, a broken checkpoint, K2.6 shapes, and the full
61-layer 384-expert model on the meta device."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kimi_nvfp4.calibrate.kv_cache import is_kv_cache_scale
from kimi_nvfp4.calibrate.shard import INPUT_SCALES_SHARD, install_input_scales

from kimi_nvfp4.cli import main
from kimi_nvfp4.engine_check import BuildDevice, check_engine
from kimi_nvfp4.engine_check.report import ParameterVerdict

pytestmark = [pytest.mark.usefixtures("sglang_installed"), pytest.mark.engines, pytest.mark.slow]


def _verdicts(report) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for f in report.parameter_findings:
        out.setdefault(f.verdict.value, set()).add(f.parameter.rsplit(".", 1)[-1])
    return out


def _value(report, prefix: str):
    return next(v for v in report.values if v.name.startswith(prefix))


def test_convert_only_output_loads_as_weight_only_with_marlin(demo_w4a16, tmp_path):
    report = check_engine(demo_w4a16, "sglang", device="cpu", report_dir=tmp_path)
    assert report.passed, report.misses
    assert report.engine_view["weight-only (is_w4a16)"] == "True" and report.settings["moe runner backend"] == "marlin"
    assert report.tensors.read == report.tensors.in_checkpoint == report.tensors.routed
    verdicts = _verdicts(report)
    assert verdicts["unused"] == {"w13_input_scale", "w2_input_scale"}  # weight-only: no activation scales
    assert verdicts["engine_default"] == {"k_scale", "v_scale"}  # FP8 KV cache without scales: SGLang uses 1.0
    assert _value(report, "expert tensors").passed and _value(report, "expert tensors").checked > 0
    assert _value(report, "gate/up weight_scale_2").passed
    assert any("prepare_moe_nvfp4_layer_for_marlin" in p.target for p in report.patches)
    assert (tmp_path / "engine_check_sglang.json").is_file() and (tmp_path / "engine_check_sglang.md").is_file()


def test_calibrated_output_loads_w4a4_on_flashinfer_trtllm(demo_w4a4):
    report = check_engine(demo_w4a4, "sglang", device="cpu")
    assert report.passed, report.misses
    assert report.engine_view["weight-only (is_w4a16)"] == "False"
    assert report.settings["moe runner backend"] == "flashinfer_trtllm"
    assert "unused" not in _verdicts(report)  # every input scale written
    for check in ("floating tensors land", "model-built tensors", "expert tensors", "gate/up weight_scale_2",
                  "gate/up input scales", "g1_alphas == g1_alphas_up", "served input scale = max"):
        assert _value(report, check).passed, check
    assert report.tensors.fused  # fused_qkv_a_proj_with_mqa <- q_a_proj + kv_a_proj_with_mqa
    assert (demo_w4a4 / "reports" / "engine_check_sglang.md").is_file()


def test_calibrated_kv_scales_land_in_attn_mqa(demo_w4a4, tmp_path):
    """The checkpoint's `self_attn.k_proj.k_scale` / `v_proj.v_scale` become the `k_scale_float` / `v_scale_float`
    of SGLang's `self_attn.attn_mqa` (deepseek_weight_loader.py: k_proj -> attn_mqa); distinct values per layer
    (calibrate writes 1.0 for the demo, the engine's default, which would prove nothing)."""
    out = tmp_path / "kv"
    shutil.copytree(demo_w4a4, out)
    tensors = load_file(out / INPUT_SCALES_SHARD)
    kv = sorted(n for n in tensors if is_kv_cache_scale(n))
    assert len(kv) == 2 * 4  # k and v for each of the demo's 4 layers, written by calibrate
    for i, name in enumerate(kv):
        tensors[name] = torch.tensor(1.5 + i, dtype=torch.float32)
    install_input_scales(out, tensors, stage_settings={})
    report = check_engine(out, "sglang", device="cpu", report_dir=tmp_path)
    assert report.passed, report.misses
    check = _value(report, "FP8 KV scales land")
    assert check.passed and check.checked == len(kv), check.detail
    # attn_mha (prefill MHA path) has no checkpoint tensor: SGLang's default 1.0
    defaults = {f.parameter for f in report.parameter_findings if f.verdict is ParameterVerdict.ENGINE_DEFAULT}
    assert defaults and all(".attn_mha." in p for p in defaults)


def test_weight_only_output_on_the_w4a4_only_trtllm_backend_is_a_miss(demo_w4a16, tmp_path, capsys):
    """SGLang 0.5.23 quantizes a W4A16_NVFP4 checkpoint's activations on flashinfer_trtllm with scale 1.0."""
    with pytest.raises(SystemExit) as e:
        main(["check-engine", str(demo_w4a16), "--moe-runner-backend", "flashinfer_trtllm", "--report", str(tmp_path)])
    assert e.value.code == 1
    report = json.loads((tmp_path / "engine_check_sglang.json").read_text())
    misses = [f for f in report["parameter_findings"] if f["verdict"] == ParameterVerdict.MISS.value]
    assert {f["parameter"].rsplit(".", 1)[-1] for f in misses} == {"w13_input_scale", "w2_input_scale"}
    assert all("--moe-runner-backend marlin" in f["reason"] for f in misses)
    assert "w13_input_scale_quant" in misses[0]["reason"]


def test_a_missing_expert_scale_is_never_written_and_exits_1(demo_w4a4, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(demo_w4a4, broken)
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    victim = next(n for n in index["weight_map"] if n.endswith("experts.3.down_proj.weight_scale_2"))
    shard = broken / index["weight_map"].pop(victim)
    tensors = load_file(shard)
    del tensors[victim]
    save_file(tensors, shard, metadata={"format": "pt"})
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(SystemExit) as e:
        main(["check-engine", str(broken), "--device", "cpu"])
    assert e.value.code == 1
    report = json.loads((broken / "reports" / "engine_check_sglang.json").read_text())
    miss = next(f for f in report["parameter_findings"] if f["parameter"].endswith("w2_weight_scale_2"))
    assert miss["verdict"] == "miss" and miss["unwritten"] == 1


def test_k26_shapes_load_on_cpu(synth_k26):
    text = json.loads((synth_k26 / "config.json").read_text())["text_config"]
    report = check_engine(synth_k26, "sglang", device="cpu")
    assert report.passed, report.misses
    assert report.modules.nvfp4_modules == text["num_hidden_layers"] - 1  # layer 0 is dense
    # per expert: gate and up halves of w13 and w2, weights and block scales
    assert _value(report, "expert tensors").checked == text["n_routed_experts"] * 6


def test_full_k26_builds_and_routes_every_tensor_on_meta(full_size_k26):
    report = check_engine(full_size_k26, "sglang")  # a listing: auto -> meta
    assert report.device is BuildDevice.META
    assert report.passed, report.misses[:10]
    assert report.tensors.in_checkpoint == report.tensors.read == report.tensors.routed > 270_000
    assert report.modules.nvfp4_modules == 60 and report.modules.by_method["ModelOptNvFp4FusedMoEMethod"] == 60
    assert report.settings["moe runner backend"] == "flashinfer_trtllm"


def test_the_old_demo_vision_config_cannot_be_built(demo_w4a16, tmp_path):
    """Before the fix the demo's vision_config lacked what SGLang's K2VLMultiModalProjector reads."""
    old = tmp_path / "old_demo"
    shutil.copytree(demo_w4a16, old)
    config = json.loads((old / "config.json").read_text())
    for key in ("vt_hidden_size", "text_hidden_size"):
        del config["vision_config"][key]
    (old / "config.json").write_text(json.dumps(config))
    report = check_engine(old, "sglang", device="meta")
    assert not report.passed and "vt_hidden_size" in report.errors[0]
