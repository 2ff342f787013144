"""A converted checkpoint is ModelOpt-format NVFP4 for the experts and bit-identical everywhere else."""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from kimi_nvfp4.checkpoint.layout import parse_expert_name
from kimi_nvfp4.checkpoint.manifest import load_manifest
from kimi_nvfp4.checkpoint.modelopt_config import HF_QUANT_CONFIG_NAME, is_excluded
from kimi_nvfp4.checkpoint.reader import INDEX_NAME, CheckpointReader
from kimi_nvfp4.convert import convert_checkpoint
from kimi_nvfp4.numerics.constants import NVFP4_TENSOR_SCALE_DENOMINATOR
from kimi_nvfp4.numerics.methods import Int4Matrix
from kimi_nvfp4.numerics.nvfp4 import NVFP4Tensor, dequantize_nvfp4
from kimi_nvfp4.synth import make_tiny_k2

from .conftest import SMALL_VOCAB, move_tensors


def _load_all(root: Path) -> dict[str, torch.Tensor]:
    reader = CheckpointReader(root)
    return {name: reader.load(name) for name in reader.weight_map}


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.fixture
def converted(source, tmp_path) -> tuple[Path, Path]:
    out = tmp_path / "out"
    convert_checkpoint(source, out, method="amax", device="cpu", progress=False)
    return source, out


def test_experts_become_modelopt_nvfp4_and_the_rest_is_bit_identical(converted):
    src, out = converted
    before, after = _load_all(src), _load_all(out)
    modules = set()
    for name, t in before.items():
        expert = parse_expert_name(name)
        if expert is None:
            assert _bytes(after[name]) == _bytes(t) and after[name].dtype == t.dtype and after[name].shape == t.shape, name
            continue
        modules.add(expert.module)
        if expert.suffix in ("weight_packed", "weight_shape"):
            assert name not in after
    assert len(modules) == 2 * 8 * 3
    reader = CheckpointReader(src)
    for module in modules:
        out_f, in_f = reader.info(f"{module}.weight_packed").shape[0], reader.info(f"{module}.weight_packed").shape[1] * 8
        w, s, s2 = after[f"{module}.weight"], after[f"{module}.weight_scale"], after[f"{module}.weight_scale_2"]
        assert (w.dtype, tuple(w.shape)) == (torch.uint8, (out_f, in_f // 2))
        assert (s.dtype, tuple(s.shape)) == (torch.float8_e4m3fn, (out_f, in_f // 16))
        assert (s2.dtype, tuple(s2.shape)) == (torch.float32, ())
        # Dequantized NVFP4 stays close to the exact INT4 values.
        ref = Int4Matrix.from_packed(before[f"{module}.weight_packed"], before[f"{module}.weight_scale"], in_f).values()
        got = dequantize_nvfp4(NVFP4Tensor(w, s, s2))
        assert float((got - ref).square().sum() / ref.square().sum()) < 0.05
    assert set(after) - set(before) == {f"{m}.{s}" for m in modules for s in ("weight", "weight_scale_2")}


def test_gate_and_up_share_weight_scale_2_from_their_joint_amax(converted):
    src, out = converted
    before, after = _load_all(src), _load_all(out)
    for e in range(8):
        p = f"language_model.model.layers.2.mlp.experts.{e}."
        gate, up, down = (after[f"{p}{proj}.weight_scale_2"] for proj in ("gate_proj", "up_proj", "down_proj"))
        assert torch.equal(gate, up)
        amax = max(
            float(Int4Matrix.from_packed(before[f"{p}{proj}.weight_packed"], before[f"{p}{proj}.weight_scale"], 64).amax())
            for proj in ("gate_proj", "up_proj")
        )
        assert float(gate) == pytest.approx(amax / NVFP4_TENSOR_SCALE_DENOMINATOR, rel=1e-6)
        assert not torch.equal(down, gate)


def test_configs_index_manifest_and_copied_files(converted):
    src, out = converted
    config = json.loads((out / "config.json").read_text())
    src_config = json.loads((src / "config.json").read_text())
    qc = config["quantization_config"]
    assert qc == config["text_config"]["quantization_config"]
    # weight-only until calibrate writes the input scales (W4A16_NVFP4, no input_activations)
    assert (qc["quant_method"], qc["quant_algo"]) == ("modelopt", "W4A16_NVFP4")
    assert "input_activations" not in qc["config_groups"]["group_0"]
    assert qc["config_groups"]["group_0"]["weights"] == {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
    assert qc["kv_cache_scheme"] == {"dynamic": False, "num_bits": 8, "type": "float"}
    assert "compressed-tensors" not in json.dumps(config)
    strip = lambda c: {k: v for k, v in c.items() if k not in ("quantization_config", "text_config")}
    assert strip(config) == strip(src_config)
    assert strip(config["text_config"]) == strip(src_config["text_config"])

    hf = json.loads((out / HF_QUANT_CONFIG_NAME).read_text())["quantization"]
    assert (hf["quant_algo"], hf["kv_cache_quant_algo"], hf["group_size"]) == ("W4A16_NVFP4", "FP8", 16)
    assert hf["exclude_modules"] == qc["ignore"]

    index = json.loads((out / INDEX_NAME).read_text())
    total = 0
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(str(out / shard), "pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                assert index["weight_map"][name] == shard
                t = f.get_tensor(name)
                total += t.numel() * t.element_size()
    assert index["metadata"]["total_size"] == total
    assert sorted(set(index["weight_map"].values())) == sorted(set(json.loads((src / INDEX_NAME).read_text())["weight_map"].values()))

    for name in ("tiktoken.model", "tokenizer_config.json", "chat_template.jinja", "generation_config.json", "tokenization_kimi.py"):
        assert (out / name).read_bytes() == (src / name).read_bytes()
    assert "tokenization_kimi" not in sys.modules  # copied, never imported

    manifest = load_manifest(out)
    assert manifest.complete and manifest.settings.method == "amax"
    assert len(manifest.shards) == 5
    for file, rec in manifest.shards.items():
        assert hashlib.sha256((out / file).read_bytes()).hexdigest() == rec.sha256
        assert (out / file).stat().st_size == rec.bytes
    assert len(manifest.tensor_stats) == 48
    stats = next(iter(manifest.tensor_stats.values()))
    assert 0 <= stats["rel_mse"] < 0.05 and 0 < stats["exact_fraction"] <= 1


def test_exclude_list_covers_exactly_the_bf16_linears_under_sglang_matching(converted):
    src, out = converted
    patterns = json.loads((out / HF_QUANT_CONFIG_NAME).read_text())["quantization"]["exclude_modules"]
    reader = CheckpointReader(src)
    bf16_linears = {n[: -len(".weight")] for n, i in reader.tensors.items()
                    if n.endswith(".weight") and len(i.shape) == 2 and "embed_tokens" not in n and parse_expert_name(n) is None}
    for module in bf16_linears:
        assert is_excluded(module, patterns), module
    # SGLang's fused module names for the same BF16 weights are excluded too ...
    for fused in ("language_model.model.layers.1.self_attn.fused_qkv_a_proj_with_mqa",
                  "language_model.model.layers.0.mlp.gate_up_proj",
                  "language_model.model.layers.2.mlp.shared_experts.gate_up_proj"):
        assert is_excluded(fused, patterns), fused
    # ... and no NVFP4 module, per expert or as SGLang's fused MoE, matches any entry.
    quantized = {parse_expert_name(n).module for n in reader.tensors if parse_expert_name(n)}
    quantized |= {"language_model.model.layers.1.mlp.experts", "language_model.model.layers.2.mlp.experts"}
    for module in quantized:
        assert not is_excluded(module, patterns), module


def test_workers_give_the_same_bytes_as_serial(source, tmp_path):
    serial, parallel = tmp_path / "serial", tmp_path / "parallel"
    convert_checkpoint(source, serial, device="cpu", workers=1, progress=False)
    summary = convert_checkpoint(source, parallel, device="cpu", workers=3, progress=False)
    assert summary.shards_converted == 5 and summary.workers == 3
    a, b = load_manifest(serial), load_manifest(parallel)
    assert {f: r.sha256 for f, r in a.shards.items()} == {f: r.sha256 for f, r in b.shards.items()}
    for name in ("config.json", HF_QUANT_CONFIG_NAME, INDEX_NAME):
        assert (serial / name).read_bytes() == (parallel / name).read_bytes()


def test_gate_and_up_in_different_shards_still_share_one_scale(source, tmp_path):
    p = "language_model.model.layers.1.mlp.experts.3."
    # Up's packed weight alone in a new shard; its scale stays behind in the original one.
    move_tensors(source, [f"{p}up_proj.weight_packed"], "model-extra.safetensors")
    assert CheckpointReader(source).weight_map[f"{p}gate_proj.weight_packed"] != "model-extra.safetensors"
    out = tmp_path / "out"
    summary = convert_checkpoint(source, out, device="cpu", progress=False)
    assert summary.shards_converted == 6
    after = CheckpointReader(out)
    assert after.weight_map[f"{p}up_proj.weight"] == "model-extra.safetensors"
    assert after.weight_map[f"{p}up_proj.weight_scale"] == "model-extra.safetensors"
    assert after.weight_map[f"{p}gate_proj.weight"] != "model-extra.safetensors"
    assert torch.equal(after.load(f"{p}gate_proj.weight_scale_2"), after.load(f"{p}up_proj.weight_scale_2"))
    reference = tmp_path / "reference"
    convert_checkpoint(_unsplit_copy(source, tmp_path), reference, device="cpu", progress=False)
    ref = CheckpointReader(reference)
    for proj in ("gate_proj", "up_proj"):
        for suffix in ("weight", "weight_scale", "weight_scale_2"):
            name = f"{p}{proj}.{suffix}"
            assert _bytes(after.load(name)) == _bytes(ref.load(name)), name


def _unsplit_copy(source: Path, tmp_path: Path) -> Path:
    """The same tensors with the moved one back in a regular shard (for a byte comparison)."""
    copy = tmp_path / "unsplit"
    shutil.copytree(source, copy)
    names = [n for n, f in json.loads((copy / INDEX_NAME).read_text())["weight_map"].items() if f == "model-extra.safetensors"]
    first = min(set(json.loads((copy / INDEX_NAME).read_text())["weight_map"].values()))
    index = json.loads((copy / INDEX_NAME).read_text())
    tensors = load_file(str(copy / first))
    tensors.update(load_file(str(copy / "model-extra.safetensors")))
    save_file(tensors, str(copy / first), metadata={"format": "pt"})
    (copy / "model-extra.safetensors").unlink()
    for n in names:
        index["weight_map"][n] = first
    (copy / INDEX_NAME).write_text(json.dumps(index))
    return copy


def test_k2_thinking_layout_without_prefix(tmp_path):
    src = make_tiny_k2(tmp_path / "src", vocab_size=SMALL_VOCAB, shards=2, layout="deepseek_v3")
    out = tmp_path / "out"
    convert_checkpoint(src, out, device="cpu", kv_cache_quant_algo=None, progress=False)
    config = json.loads((out / "config.json").read_text())
    assert "text_config" not in config and config["quantization_config"]["quant_method"] == "modelopt"
    assert "kv_cache_scheme" not in config["quantization_config"]
    hf = json.loads((out / HF_QUANT_CONFIG_NAME).read_text())["quantization"]
    assert hf["kv_cache_quant_algo"] is None
    assert "lm_head" in hf["exclude_modules"] and "model.layers.0*" in hf["exclude_modules"]
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in CheckpointReader(out).weight_map


def test_summary_counts_and_cli_json(source, tmp_path):
    from click.testing import CliRunner

    from kimi_nvfp4.cli import cli

    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["convert", str(source), str(out), "--device", "cpu", "--json", "--no-progress"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert summary["matrices_converted"] == 48 and summary["shards_converted"] == 5
    assert summary["int4_bytes_in"] > 0 and summary["bytes_out"] > 0 and summary["gb_per_s"] > 0
    assert summary["activations"] == "w4a16"
    text = CliRunner().invoke(cli, ["convert", str(source), str(out), "--device", "cpu", "--no-progress"])
    assert text.exit_code == 0 and "weight-only declared (quant_algo W4A16_NVFP4" in text.output


def test_compressed_tensors_reads_the_output_as_modelopt_nvfp4(converted):
    """compressed-tensors' own ModelOpt-NVFP4 converter accepts every output shard as is."""
    from compressed_tensors.entrypoints.convert.converters.modelopt_nvfp4 import (
        ModelOptNvfp4Converter,
    )

    _, out = converted
    converter = ModelOptNvfp4Converter()
    experts = 0
    for shard in sorted(p for p in out.glob("*.safetensors")):
        tensors = load_file(str(shard))
        scale_2 = {n: t.clone() for n, t in tensors.items() if n.endswith(".weight_scale_2")}
        converted_tensors = converter.validate(dict(tensors))
        for name, s2 in scale_2.items():
            module = name[: -len(".weight_scale_2")]
            assert converted_tensors[f"{module}.weight_packed"].dtype == torch.uint8
            assert torch.equal(converted_tensors[f"{module}.weight_global_scale"], 1 / s2)
            experts += 1
    assert experts == 48
