"""Layout detection from config.json and header-first reading of safetensors shards."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kimi_nvfp4.checkpoint.k2_config import K2Config
from kimi_nvfp4.checkpoint.layout import CheckpointLayout, LayoutKind, layer_of, parse_expert_name
from kimi_nvfp4.checkpoint.reader import CheckpointReader, read_safetensors_header
from kimi_nvfp4.errors import CheckpointError, UnsupportedCheckpointError

TEXT = {
    "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 128, "intermediate_size": 96,
    "moe_intermediate_size": 32, "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
    "first_k_dense_replace": 1, "num_attention_heads": 2, "kv_lora_rank": 32, "q_lora_rank": 32,
    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "model_type": "deepseek_v3",
}


def test_k25_wrapper_layout():
    layout = CheckpointLayout.from_config(
        {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": TEXT}
    )
    assert layout.kind is LayoutKind.KIMI_K25
    assert layout.text_prefix == "language_model."
    assert layout.embed_name == "language_model.model.embed_tokens.weight"
    assert layout.expert_module(1, 3, "up_proj") == "language_model.model.layers.1.mlp.experts.3.up_proj"
    assert layout.text.moe_layers == [1]


def test_plain_deepseek_layout():
    layout = CheckpointLayout.from_config({"architectures": ["DeepseekV3ForCausalLM"], **TEXT})
    assert layout.kind is LayoutKind.DEEPSEEK_V3
    assert layout.text_prefix == ""
    assert layout.lm_head_name == "lm_head.weight"


def test_unknown_architecture_is_refused():
    with pytest.raises(UnsupportedCheckpointError, match="architectures"):
        CheckpointLayout.from_config({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})


def test_missing_required_key_is_named():
    text = dict(TEXT)
    del text["kv_lora_rank"]
    with pytest.raises(UnsupportedCheckpointError, match="kv_lora_rank"):
        K2Config.from_dict(text)


def test_expert_name_parsing():
    p = parse_expert_name("language_model.model.layers.7.mlp.experts.123.down_proj.weight_packed")
    assert p is not None
    assert (p.prefix, p.layer, p.expert, p.proj, p.suffix) == ("language_model.", 7, 123, "down_proj", "weight_packed")
    assert p.module == "language_model.model.layers.7.mlp.experts.123.down_proj"
    assert parse_expert_name("model.layers.1.mlp.shared_experts.down_proj.weight") is None
    assert layer_of("model.layers.12.self_attn.o_proj.weight") == 12
    assert layer_of("lm_head.weight") is None


def _write_checkpoint(root: Path) -> None:
    root.mkdir()
    (root / "config.json").write_text(json.dumps({"architectures": ["DeepseekV3ForCausalLM"], **TEXT}))
    save_file({"a": torch.arange(6, dtype=torch.int32).reshape(2, 3)}, str(root / "s1.safetensors"))
    save_file({"b": torch.ones(4, dtype=torch.bfloat16)}, str(root / "s2.safetensors"))
    index = {"metadata": {"total_size": 32}, "weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}}
    (root / "model.safetensors.index.json").write_text(json.dumps(index))


def test_reader_headers_and_data(tmp_path):
    root = tmp_path / "ckpt"
    _write_checkpoint(root)
    reader = CheckpointReader(root)
    assert reader.shard_files == ["s1.safetensors", "s2.safetensors"]
    info = reader.info("a")
    assert (info.file, info.dtype, info.shape, info.nbytes) == ("s1.safetensors", torch.int32, (2, 3), 24)
    assert torch.equal(reader.load("a"), torch.arange(6, dtype=torch.int32).reshape(2, 3))
    assert reader.load("b").dtype == torch.bfloat16
    assert [str(p) for p in reader.other_files()] == ["config.json"]


def test_truncated_shard_names_file_and_tensor(tmp_path):
    root = tmp_path / "ckpt"
    _write_checkpoint(root)
    shard = root / "s1.safetensors"
    shard.write_bytes(shard.read_bytes()[:-4])
    with pytest.raises(CheckpointError, match=r"s1\.safetensors.*tensor a.*truncated"):
        read_safetensors_header(shard)


def test_index_names_tensor_missing_from_shard(tmp_path):
    root = tmp_path / "ckpt"
    _write_checkpoint(root)
    index = json.loads((root / "model.safetensors.index.json").read_text())
    index["weight_map"]["ghost"] = "s2.safetensors"
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="tensor ghost"):
        CheckpointReader(root).tensors


def test_missing_shard_is_reported(tmp_path):
    root = tmp_path / "ckpt"
    _write_checkpoint(root)
    (root / "s2.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"s2\.safetensors.*missing"):
        CheckpointReader(root).tensors


def test_missing_config(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="config.json"):
        CheckpointReader(tmp_path / "empty")
