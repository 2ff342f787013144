"""Export round trip on a random tiny K2: K2.6 layout, dtypes, config, and exact read-back."""

from __future__ import annotations

import json

import pytest
import torch

from kimi_nvfp4.checkpoint.layout import LayoutKind, parse_expert_name
from kimi_nvfp4.checkpoint.reader import CheckpointReader
from kimi_nvfp4.demo_model.export import export_checkpoint
from kimi_nvfp4.checkpoint_builder.int4 import fake_quantize_int4
from kimi_nvfp4.demo_model.readback import load_transformers_model
from kimi_nvfp4.errors import OutputError

SPEC_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]


def test_config_is_kimi_k25_with_compressed_tensors_at_both_levels(exported_tiny, test_spec):
    cfg = json.loads((exported_tiny / "config.json").read_text())
    assert cfg["architectures"] == ["KimiK25ForConditionalGeneration"] and cfg["model_type"] == "kimi_k25"
    text = cfg["text_config"]
    assert text["model_type"] == "deepseek_v3" and text["first_k_dense_replace"] == 1
    assert text["scoring_func"] == "sigmoid" and text["topk_method"] == "noaux_tc"
    assert text["rope_scaling"]["type"] == "yarn" and text["rope_theta"] == 50000.0
    for qc in (cfg["quantization_config"], text["quantization_config"]):
        assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
        weights = qc["config_groups"]["group_0"]["weights"]
        assert (weights["num_bits"], weights["type"], weights["symmetric"], weights["strategy"],
                weights["group_size"]) == (4, "int", True, "group", 32)
        assert qc["config_groups"]["group_0"]["targets"] == ["Linear"]
        assert qc["ignore"][:4] == SPEC_IGNORE
    gen = json.loads((exported_tiny / "generation_config.json").read_text())
    assert gen["eos_token_id"] == test_spec.vocab_size - 256 + 2  # <|im_end|>


def test_tensor_names_dtypes_and_shapes_follow_k26(exported_tiny, test_spec):
    reader = CheckpointReader(exported_tiny)
    assert reader.layout.kind is LayoutKind.KIMI_K25 and len(reader.shard_files) == 2
    s = test_spec
    experts = 0
    for name, info in reader.tensors.items():
        parsed = parse_expert_name(name)
        if parsed is not None:
            experts += 1
            out_f, in_f = ((s.hidden_size, s.moe_intermediate_size) if parsed.proj == "down_proj"
                           else (s.moe_intermediate_size, s.hidden_size))
            expected = {"weight_packed": (torch.int32, (out_f, in_f // 8)),
                        "weight_scale": (torch.bfloat16, (out_f, in_f // 32)),
                        "weight_shape": (torch.int32, (2,))}[parsed.suffix]
            assert (info.dtype, info.shape) == expected, name
        elif name.endswith("e_score_correction_bias"):
            assert info.dtype == torch.float32 and info.shape == (s.n_routed_experts,)
        else:
            assert info.dtype == torch.bfloat16, name
            assert name.startswith(("language_model.", "vision_tower.", "mm_projector.")), name
    moe_layers = s.num_hidden_layers - s.first_k_dense_replace
    assert experts == moe_layers * s.n_routed_experts * 3 * 3
    assert "language_model.model.layers.0.mlp.gate_proj.weight" in reader
    assert "language_model.model.layers.1.mlp.shared_experts.down_proj.weight" in reader
    assert reader.info("language_model.model.layers.1.mlp.gate.weight").shape == (s.n_routed_experts, s.hidden_size)
    assert "language_model.lm_head.weight" in reader and "language_model.model.embed_tokens.weight" in reader
    assert not any("rotary_emb" in n for n in reader.tensors)


def test_read_back_equals_int4_fake_quantized_experts_and_bf16_rest(exported_tiny, random_tiny_model):
    back = load_transformers_model(exported_tiny).state_dict()
    for name, original in random_tiny_model.state_dict().items():
        if "rotary_emb" in name:
            continue
        if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
            expected = torch.stack([fake_quantize_int4(m) for m in original])
        elif name.endswith("e_score_correction_bias"):
            expected = original.float()
        else:
            expected = original.to(torch.bfloat16).float()
        assert torch.equal(back[name], expected), name


def test_read_back_model_reproduces_the_fake_quantized_model_logits(exported_tiny, random_tiny_model):
    import copy

    fq = copy.deepcopy(random_tiny_model)
    with torch.no_grad():
        for name, p in fq.named_parameters():
            if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
                p.copy_(torch.stack([fake_quantize_int4(m) for m in p]))
            else:
                p.copy_(p.to(torch.bfloat16).float())
    x = torch.arange(40).reshape(2, 20) % 500
    with torch.no_grad():
        assert torch.allclose(load_transformers_model(exported_tiny)(input_ids=x).logits, fq(input_ids=x).logits,
                              atol=1e-5, rtol=0)


def test_index_lists_every_tensor_and_the_exact_total_size(exported_tiny):
    index = json.loads((exported_tiny / "model.safetensors.index.json").read_text())
    reader = CheckpointReader(exported_tiny)
    assert set(index["weight_map"]) == set(reader.tensors)
    assert index["metadata"]["total_size"] == sum(i.nbytes for i in reader.tensors.values())
    assert not list(exported_tiny.parent.glob(".*partial"))


def test_export_refuses_a_non_empty_folder_unless_overwrite(tmp_path, random_tiny_model, tiny_tokenizer_dir, test_spec):
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    with pytest.raises(OutputError, match="not empty"):
        export_checkpoint(random_tiny_model.state_dict(), test_spec, tiny_tokenizer_dir, out)
    export_checkpoint(random_tiny_model.state_dict(), test_spec, tiny_tokenizer_dir, out, overwrite=True)
    assert not (out / "keep.txt").exists() and (out / "config.json").is_file()


def test_export_is_byte_reproducible(tmp_path, random_tiny_model, tiny_tokenizer_dir, test_spec, exported_tiny):
    again = export_checkpoint(random_tiny_model.state_dict(), test_spec, tiny_tokenizer_dir, tmp_path / "again")
    for f in exported_tiny.iterdir():
        assert (again / f.name).read_bytes() == f.read_bytes(), f.name
