"""Synthetic K2 checkpoints have the real layout, real INT4 encoding and deterministic contents."""

from __future__ import annotations

import hashlib
import json
import runpy

import pytest
import torch
from click.testing import CliRunner
from compressed_tensors.quantization import QuantizationConfig

from kimi_nvfp4.checkpoint.layout import LayoutKind, parse_expert_name
from kimi_nvfp4.checkpoint.reader import INDEX_NAME, CheckpointReader
from kimi_nvfp4.cli import cli
from kimi_nvfp4.numerics.int4 import dequantize_int4, unpack_int4
from kimi_nvfp4.synth import create_synthetic_checkpoint, plan_synthetic_checkpoint

SMALL_VOCAB = 256


def test_tiny_k26_layout_names_dtypes_shapes(tiny_int4_checkpoint):
    reader = CheckpointReader(tiny_int4_checkpoint)
    layout = reader.layout
    assert layout.kind is LayoutKind.KIMI_K25 and layout.text_prefix == "language_model."
    c = layout.text
    assert (c.hidden_size, c.num_hidden_layers, c.n_routed_experts, c.moe_intermediate_size) == (64, 3, 8, 32)
    assert c.moe_layers == [1, 2]
    assert len(reader.shard_files) == 2
    t = reader.tensors
    p = "language_model.model.layers.1.mlp."
    assert t[f"{p}gate.e_score_correction_bias"].dtype == torch.float32
    assert t[f"{p}gate.weight"].dtype == torch.bfloat16 and t[f"{p}gate.weight"].shape == (8, 64)
    assert t[f"{p}experts.7.gate_proj.weight_packed"].shape == (32, 8)
    assert t[f"{p}experts.7.gate_proj.weight_scale"].shape == (32, 2)
    assert t[f"{p}experts.7.down_proj.weight_packed"].shape == (64, 4)
    assert reader.load(f"{p}experts.7.down_proj.weight_shape").tolist() == [64, 32]
    assert "language_model.model.layers.0.mlp.gate_proj.weight" in t  # layer 0 dense
    assert f"{p}shared_experts.down_proj.weight" in t
    assert any(n.startswith("vision_tower.") for n in t) and any(n.startswith("mm_projector.") for n in t)
    # Only routed experts are INT4; every other tensor is BF16 except the router bias.
    for name, info in t.items():
        expert = parse_expert_name(name)
        if expert is None:
            expected = torch.float32 if name.endswith("e_score_correction_bias") else torch.bfloat16
            assert info.dtype == expected, name
    n_expert_tensors = sum(parse_expert_name(n) is not None for n in t)
    assert n_expert_tensors == 2 * 8 * 3 * 3


def test_quantization_config_at_both_levels_is_valid_compressed_tensors(tiny_int4_checkpoint):
    config = json.loads((tiny_int4_checkpoint / "config.json").read_text())
    top, inner = config["quantization_config"], config["text_config"]["quantization_config"]
    assert top == inner
    parsed = QuantizationConfig.model_validate(top)
    weights = parsed.config_groups["group_0"].weights
    assert (weights.num_bits, weights.group_size, weights.symmetric, parsed.format) == (4, 32, True, "pack-quantized")
    assert config["text_config"]["rope_scaling"]["type"] == "yarn"
    assert config["text_config"]["rope_scaling"]["factor"] == 64.0
    assert config["architectures"] == ["KimiK25ForConditionalGeneration"]


def test_int4_encoding_matches_compressed_tensors_dequantizer(tiny_int4_checkpoint):
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer

    reader = CheckpointReader(tiny_int4_checkpoint)
    module = "language_model.model.layers.2.mlp.experts.3.up_proj"
    tensors = reader.load_many(f"{module}.{s}" for s in ("weight_packed", "weight_scale", "weight_shape"))
    ours = dequantize_int4(tensors[f"{module}.weight_packed"], tensors[f"{module}.weight_scale"], 64)
    theirs = CompressedTensorsDequantizer(tiny_int4_checkpoint, dtype=torch.float32).process(dict(tensors))
    # compressed-tensors multiplies in the scale dtype (bf16); ours is the exact fp32 product.
    assert torch.equal(theirs[f"{module}.weight"].float(), ours.to(torch.bfloat16).float())


def test_realistic_codes_use_the_whole_range_with_absmax_scales(make_tiny_k2, tmp_path):
    root = make_tiny_k2(tmp_path / "ckpt", vocab_size=SMALL_VOCAB)
    reader = CheckpointReader(root)
    name = "language_model.model.layers.1.mlp.experts.0.gate_proj"
    codes = unpack_int4(reader.load(f"{name}.weight_packed"), 64)
    scale = reader.load(f"{name}.weight_scale")
    assert int(codes.max()) == 7 and int(codes.min()) == -8
    # absmax/7.5 scales (compressed-tensors' symmetric rule): every group's extreme code is +7 or -8.
    group_max = codes.to(torch.int16).abs().view(32, 2, 32).amax(-1)
    assert bool(((group_max == 7) | (group_max == 8)).all())
    assert bool((scale > 0).all()) and bool(torch.isfinite(scale.float()).all())
    # roughly Gaussian: small codes much more common than large ones
    hist = torch.bincount((codes.flatten() + 8).long(), minlength=16)
    assert hist[8] > hist[15] * 2


def test_uniform_codes_cover_all_sixteen_levels(make_tiny_k2, tmp_path):
    root = make_tiny_k2(tmp_path / "ckpt", vocab_size=SMALL_VOCAB, code_distribution="uniform")
    reader = CheckpointReader(root)
    codes = unpack_int4(reader.load("language_model.model.layers.1.mlp.experts.0.down_proj.weight_packed"), 32)
    assert sorted(codes.unique().tolist()) == list(range(-8, 8))


def _tensor_digest(root) -> dict[str, str]:
    reader = CheckpointReader(root)
    return {n: hashlib.sha256(reader.load(n).contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
            for n in sorted(reader.weight_map)}


def test_contents_depend_on_seed_not_on_sharding(make_tiny_k2, tmp_path):
    a = make_tiny_k2(tmp_path / "a", vocab_size=SMALL_VOCAB, shards=1)
    b = make_tiny_k2(tmp_path / "b", vocab_size=SMALL_VOCAB, shards=4)
    c = make_tiny_k2(tmp_path / "c", vocab_size=SMALL_VOCAB, shards=1, seed=1)
    assert _tensor_digest(a) == _tensor_digest(b)
    assert _tensor_digest(a) != _tensor_digest(c)
    index = json.loads((b / INDEX_NAME).read_text())
    assert sorted(set(index["weight_map"].values())) == [f"model-0000{i}-of-000004.safetensors" for i in range(1, 5)]
    reader = CheckpointReader(b)
    assert index["metadata"]["total_size"] == sum(i.nbytes for i in reader.tensors.values())


def test_small_shards_split_expert_partners(make_tiny_k2, tmp_path):
    root = make_tiny_k2(tmp_path / "ckpt", vocab_size=SMALL_VOCAB, shards=7)
    reader = CheckpointReader(root)
    split = [
        m for m in {parse_expert_name(n).module.rsplit(".", 1)[0] for n in reader.weight_map if parse_expert_name(n)}
        if len({reader.weight_map[f"{m}.{p}.{s}"] for p in ("gate_proj", "up_proj") for s in ("weight_packed", "weight_scale")}) > 1
    ]
    assert split, "expected at least one expert whose gate/up tensors span two shards"


def test_deepseek_v3_layout_has_no_wrapper_prefix_or_vision(make_tiny_k2, tmp_path):
    root = make_tiny_k2(tmp_path / "ckpt", vocab_size=SMALL_VOCAB, layout="deepseek_v3")
    config = json.loads((root / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"] and "text_config" not in config
    assert config["quantization_config"]["format"] == "pack-quantized"
    reader = CheckpointReader(root)
    assert reader.layout.kind is LayoutKind.DEEPSEEK_V3
    assert "model.layers.1.mlp.experts.0.gate_proj.weight_packed" in reader.weight_map
    assert not any(n.startswith(("language_model.", "vision_tower.", "mm_projector.")) for n in reader.weight_map)


def test_config_overrides_reach_the_tensors(make_tiny_k2, tmp_path):
    root = make_tiny_k2(tmp_path / "ckpt", vocab_size=SMALL_VOCAB, q_lora_rank=None, hidden_size=96, layers=2, experts=4)
    reader = CheckpointReader(root)
    assert reader.layout.text.hidden_size == 96 and reader.layout.text.n_routed_experts == 4
    assert reader.info("language_model.model.layers.0.self_attn.q_proj.weight").shape == (2 * 32, 96)
    assert reader.info("language_model.model.layers.1.mlp.experts.3.gate_proj.weight_packed").shape == (32, 12)


def test_k26_preset_has_the_real_shapes_without_writing():
    plan = plan_synthetic_checkpoint(preset="k2.6", layers=2, experts=4)
    shapes = {s.name: (s.shape, s.dtype) for s in plan.specs}
    p = "language_model.model.layers.1.mlp."
    assert shapes[f"{p}experts.0.gate_proj.weight_packed"] == ((2048, 896), torch.int32)
    assert shapes[f"{p}experts.0.gate_proj.weight_scale"] == ((2048, 224), torch.bfloat16)
    assert shapes[f"{p}experts.3.down_proj.weight_packed"] == ((7168, 256), torch.int32)
    assert shapes[f"{p}experts.3.down_proj.weight_scale"] == ((7168, 64), torch.bfloat16)
    assert shapes[f"{p}gate.weight"] == ((4, 7168), torch.bfloat16)
    assert shapes["language_model.model.embed_tokens.weight"] == ((163840, 7168), torch.bfloat16)
    assert shapes["language_model.model.layers.0.mlp.gate_proj.weight"] == ((18432, 7168), torch.bfloat16)
    assert plan.text.q_lora_rank == 1536 and plan.text.kv_lora_rank == 512


def test_tokenizer_files_encode_chats_with_kimi_special_ids(tiny_int4_checkpoint):
    import tiktoken
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from tiktoken.load import load_tiktoken_bpe

    ranks = load_tiktoken_bpe(str(tiny_int4_checkpoint / "tiktoken.model"))
    assert len(ranks) > 256 and all(bytes([b]) in ranks for b in range(256))
    cfg = json.loads((tiny_int4_checkpoint / "tokenizer_config.json").read_text())
    specials = {v["content"]: int(k) for k, v in cfg["added_tokens_decoder"].items()}
    assert specials["<|im_end|>"] == 163586 and specials["[PAD]"] == 163839 and specials["<think>"] == 163606
    enc = tiktoken.Encoding("synthetic-kimi", pat_str=r"""\s+|\S+""", mergeable_ranks=ranks, special_tokens=specials)
    template = ImmutableSandboxedEnvironment().from_string(
        (tiny_int4_checkpoint / "chat_template.jinja").read_text()
    )
    text = template.render(messages=[{"role": "user", "content": "fix the test"}], add_generation_prompt=True)
    assert text.endswith("<|im_user|>user<|im_middle|>fix the test<|im_end|><|im_assistant|>assistant<|im_middle|>")
    ids = enc.encode(text, allowed_special="all")
    vocab = CheckpointReader(tiny_int4_checkpoint).layout.text.vocab_size
    assert specials["<|im_user|>"] in ids and max(ids) < vocab
    assert enc.decode(ids) == text


def test_remote_code_stand_in_raises_if_executed(tiny_int4_checkpoint):
    with pytest.raises(RuntimeError, match="never run checkpoint code"):
        runpy.run_path(str(tiny_int4_checkpoint / "tokenization_kimi.py"))


def test_refuses_non_empty_output(tmp_path):
    from kimi_nvfp4.errors import OutputError

    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "keep.txt").write_text("mine")
    with pytest.raises(OutputError, match="not empty"):
        create_synthetic_checkpoint(tmp_path / "x", vocab_size=SMALL_VOCAB)


def test_cli_writes_a_checkpoint(tmp_path):
    out = tmp_path / "cli"
    result = CliRunner().invoke(
        cli, ["synth", str(out), "--layers", "2", "--experts", "4", "--shards", "2", "--vocab-size", "256",
              "--layout", "deepseek_v3"]
    )
    assert result.exit_code == 0, result.output
    reader = CheckpointReader(out)
    assert reader.layout.text.n_routed_experts == 4 and len(reader.shard_files) == 2
