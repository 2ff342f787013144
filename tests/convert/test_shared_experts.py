"""`convert --shared-experts nvfp4`: the BF16 shared experts become Model Optimizer NVFP4 linears (gate/up sharing
one weight_scale_2), leave the exclude list, and everything else is what the default conversion writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

from kimi_nvfp4.checkpoint.manifest import load_manifest
from kimi_nvfp4.checkpoint.modelopt_config import HF_QUANT_CONFIG_NAME, is_excluded
from kimi_nvfp4.checkpoint.reader import CheckpointReader
from kimi_nvfp4.cli import cli
from kimi_nvfp4.convert import convert_checkpoint
from kimi_nvfp4.convert.plan import plan_conversion
from kimi_nvfp4.errors import CheckpointError, OutputError
from kimi_nvfp4.numerics.nvfp4 import tensor_scale_from_amax

from .conftest import edit_tensor

MOE_LAYERS = (1, 2)  # the tiny checkpoint: layer 0 dense, layers 1-2 MoE
PROJS = ("gate_proj", "up_proj", "down_proj")


def _shared(layer: int, proj: str) -> str:
    return f"language_model.model.layers.{layer}.mlp.shared_experts.{proj}"


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.fixture
def converted(source, tmp_path) -> tuple[Path, Path]:
    out = tmp_path / "out"
    result = CliRunner().invoke(
        cli, ["convert", str(source), str(out), "--device", "cpu", "--no-progress", "--shared-experts", "nvfp4"]
    )
    assert result.exit_code == 0, result.output
    assert "shared experts: NVFP4" in result.output
    return source, out


def test_shared_experts_are_model_optimizer_nvfp4_with_one_scale_for_gate_and_up(converted):
    src, out = converted
    before, after = CheckpointReader(src), CheckpointReader(out)
    for layer in MOE_LAYERS:
        weights = {p: before.load(f"{_shared(layer, p)}.weight") for p in PROJS}
        assert all(w.dtype == torch.bfloat16 for w in weights.values())
        gate_up_scale = tensor_scale_from_amax(torch.stack([weights[p].float().abs().amax() for p in PROJS[:2]]).amax())
        for proj, w in weights.items():
            module = _shared(layer, proj)
            q, scale, scale_2 = (after.load(f"{module}.{s}") for s in ("weight", "weight_scale", "weight_scale_2"))
            out_f, in_f = w.shape
            assert (q.dtype, tuple(q.shape)) == (torch.uint8, (out_f, in_f // 2))
            assert (scale.dtype, tuple(scale.shape)) == (torch.float8_e4m3fn, (out_f, in_f // 16))
            assert (scale_2.dtype, tuple(scale_2.shape)) == (torch.float32, ())
            shared = gate_up_scale if proj != "down_proj" else None
            oracle_q, oracle_scale, oracle_scale_2 = NVFP4QTensor.quantize(
                w.float().clone(), 16, weights_scaling_factor_2=shared
            )
            assert _bytes(q) == _bytes(oracle_q._quantized_data), module
            assert _bytes(scale) == _bytes(oracle_scale), module
            assert _bytes(scale_2) == _bytes(oracle_scale_2.float().reshape(())), module
        gate_s2, up_s2 = (after.load(f"{_shared(layer, p)}.weight_scale_2") for p in PROJS[:2])
        assert _bytes(gate_s2) == _bytes(up_s2) == _bytes(gate_up_scale)


def test_only_the_shared_experts_differ_from_the_default_conversion(converted, tmp_path):
    src, out = converted
    default = tmp_path / "default"
    convert_checkpoint(src, default, device="cpu", progress=False)
    a, b = CheckpointReader(default), CheckpointReader(out)
    shared_modules = {_shared(layer, p) for layer in MOE_LAYERS for p in PROJS}
    only_default = {n for n in a.weight_map if n not in b.weight_map}
    only_nvfp4 = {n for n in b.weight_map if n not in a.weight_map}
    assert only_default == set()
    assert only_nvfp4 == {f"{m}.{s}" for m in shared_modules for s in ("weight_scale", "weight_scale_2")}
    for name in a.weight_map:
        if name.rsplit(".", 1)[0] not in shared_modules:
            assert _bytes(a.load(name)) == _bytes(b.load(name)), name


def test_shared_experts_leave_the_exclude_list_only_when_nvfp4(converted, tmp_path):
    src, out = converted
    default = tmp_path / "default"
    convert_checkpoint(src, default, device="cpu", progress=False)
    for root, excluded in ((out, False), (default, True)):
        patterns = json.loads((root / HF_QUANT_CONFIG_NAME).read_text())["quantization"]["exclude_modules"]
        config = json.loads((root / "config.json").read_text())
        assert config["quantization_config"]["ignore"] == patterns
        assert config["text_config"]["quantization_config"]["ignore"] == patterns
        for layer in MOE_LAYERS:
            for proj in PROJS:
                assert is_excluded(_shared(layer, proj), patterns) is excluded
            # the router and attention stay BF16 and excluded either way
            assert is_excluded(f"language_model.model.layers.{layer}.mlp.gate", patterns)
            assert is_excluded(f"language_model.model.layers.{layer}.self_attn.kv_b_proj", patterns)
    manifest = load_manifest(out)
    assert manifest.settings.shared_experts == "nvfp4"
    assert load_manifest(default).settings.shared_experts == "bf16"


def test_a_resume_with_the_other_shared_experts_option_is_refused(converted):
    src, out = converted
    with pytest.raises(OutputError, match="other settings"):
        convert_checkpoint(src, out, device="cpu", progress=False)  # default bf16
    with pytest.raises(OutputError, match="other settings"):
        convert_checkpoint(src, out, device="cpu", progress=False, shared_experts="nvfp4", shared_expert_scales="mse")
    summary = convert_checkpoint(src, out, device="cpu", progress=False, shared_experts="nvfp4")
    assert summary.shards_converted == 0  # same settings: nothing to redo


def test_mse_scales_change_only_block_scales_and_codes_of_shared_experts(source, tmp_path):
    amax, mse = tmp_path / "amax", tmp_path / "mse"
    convert_checkpoint(source, amax, device="cpu", progress=False, shared_experts="nvfp4", record_stats=False)
    convert_checkpoint(source, mse, device="cpu", progress=False, shared_experts="nvfp4",
                       shared_expert_scales="mse", record_stats=False)
    a, b = CheckpointReader(amax), CheckpointReader(mse)
    assert set(a.weight_map) == set(b.weight_map)
    for name in a.weight_map:
        if ".shared_experts." not in name or name.endswith("weight_scale_2"):
            assert _bytes(a.load(name)) == _bytes(b.load(name)), name


def test_the_default_plan_copies_shared_experts_through(source):
    plan = plan_conversion(source)
    passthrough = {t.name for j in plan.jobs for t in j.passthrough}
    assert all(f"{_shared(layer, p)}.weight" in passthrough for layer in MOE_LAYERS for p in PROJS)
    assert not any(j.dense_groups for j in plan.jobs)
    assert _shared(1, "up_proj") in plan.bf16_linears


def test_a_shared_expert_with_a_wrong_shape_is_refused_before_writing(source, tmp_path):
    name = f"{_shared(2, 'down_proj')}.weight"
    edit_tensor(source, name, lambda t: t[:, :-1])
    with pytest.raises(CheckpointError, match="shared expert") as e:
        convert_checkpoint(source, tmp_path / "out", device="cpu", progress=False, shared_experts="nvfp4")
    assert name in str(e.value)
    assert not (tmp_path / "out").exists()
