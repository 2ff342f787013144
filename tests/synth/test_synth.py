"""Synthetic K2 checkpoints have the real layout, real INT4 encoding and deterministic contents."""

from __future__ import annotations

import hashlib
import itertools
import json
import runpy
from pathlib import Path

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
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import (
        CompressedTensorsDequantizer,
    )

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


# --- speed work: pinned CPU contents, parallel writers, CUDA generation -------------------------------------
# sha256 of every shard, recorded with the single-process ShardWriter implementation before the writer
# was parallelised and pack_int4 rewritten: the CPU contents (and file bytes) must never change.
PINNED_TINY_SHARDS = {  # make_tiny_k2(shards=2): the session fixture
    "model-00001-of-000002.safetensors": "683e4b15a95e97116fe943fc54eeebd105563841e238e858141c86a1670e3c55",
    "model-00002-of-000002.safetensors": "221fe9bc69e3d0df49c5b2c172fc5ddcaeed18eea0a8b166cdd0e5818c1c230c",
}
PINNED_SMALL_VOCAB_SHARDS = {  # make_tiny_k2(vocab_size=256, shards=3, seed=5)
    "model-00001-of-000003.safetensors": "421975675a08f9727a595a2efaf3dfbe4ae2ec15d2da2db18580620dbe9c9993",
    "model-00002-of-000003.safetensors": "bcd5d69ee6d7c4a8d7b51a90e0e97caa0ea6d966b9ff7a73e7b190796285986c",
    "model-00003-of-000003.safetensors": "84a356fd84a36aec89a322463d1b1bde6cfcea4552faceaf4433838ea77b31fa",
}
PINNED_UNIFORM_DEEPSEEK_SHARDS = {  # make_tiny_k2(vocab_size=256, shards=2, code_distribution="uniform", layout="deepseek_v3")
    "model-00001-of-000002.safetensors": "264ef0b114024b86522cff28de8d510dfa521d1e5e8f07d6f0c97eee427b1759",
    "model-00002-of-000002.safetensors": "ce2a913eaf917b67412b2f6946465361756ba345cd22648fd5cbdc62f86e75a5",
}
PINNED_SMALL_VOCAB_INDEX = "d91aaee247f83a7cdc3b966abd0cb6dabaf1e583b5e5510c005ed86dc5b17c0d"


def _file_digests(root) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.glob("*.safetensors"))}


def test_cpu_contents_are_pinned(tiny_int4_checkpoint, make_tiny_k2, tmp_path):
    assert _file_digests(tiny_int4_checkpoint) == PINNED_TINY_SHARDS
    small = make_tiny_k2(tmp_path / "small", vocab_size=SMALL_VOCAB, shards=3, seed=5)
    assert _file_digests(small) == PINNED_SMALL_VOCAB_SHARDS
    assert hashlib.sha256((small / INDEX_NAME).read_bytes()).hexdigest() == PINNED_SMALL_VOCAB_INDEX
    uniform = make_tiny_k2(tmp_path / "uniform", vocab_size=SMALL_VOCAB, shards=2, code_distribution="uniform",
                           layout="deepseek_v3")
    assert _file_digests(uniform) == PINNED_UNIFORM_DEEPSEEK_SHARDS
    assert not list(tmp_path.rglob("*.partial"))


def test_workers_write_the_same_files_as_one_process(make_tiny_k2, tmp_path):
    # (test_cli_workers_and_device_options checks 2 workers over 3 shards against the pinned files)
    one = make_tiny_k2(tmp_path / "one", vocab_size=SMALL_VOCAB, shards=3, seed=5, code_distribution="uniform")
    # more workers than shards: units, not shards, are spread over the processes
    many = make_tiny_k2(tmp_path / "many", vocab_size=SMALL_VOCAB, shards=1, seed=5, code_distribution="uniform",
                        workers=3)
    assert _tensor_digest(many) == _tensor_digest(one)
    assert (many / "config.json").read_bytes() == (one / "config.json").read_bytes()


def test_units_and_batches_cover_every_tensor_once():
    from kimi_nvfp4.synth.checkpoint import split_into_shards
    from kimi_nvfp4.synth.tensors import Fill, work_units
    from kimi_nvfp4.synth.writing import batch_tasks, lay_out_shards

    plan = plan_synthetic_checkpoint(preset="tiny", vocab_size=SMALL_VOCAB)
    units = work_units(plan.specs)
    assert [s for u in units for s in u.specs] == plan.specs  # plan order kept
    int4 = [u for u in units if u.specs[0].fill in (Fill.INT4_PACKED, Fill.INT4_SCALE, Fill.INT4_SHAPE)]
    assert int4 and all(len({s.name.rsplit(".", 1)[0] for s in u.specs}) == 1 and len(u.specs) == 3 for u in int4)
    # 7 shards cut some matrices' tensors apart: one unit still writes all three, into two files
    layouts, tasks = lay_out_shards(Path("/nonexistent"), split_into_shards(plan.specs, 7), [f"s{i}" for i in range(7)])
    assert any(len({path for path, _ in t.places.values()}) > 1 for t in tasks)
    for workers in (1, 3, 64):
        names = [n for batch in batch_tasks(tasks, workers) for t in batch for n in t.places]
        assert sorted(names) == sorted(s.name for s in plan.specs)
    # Offsets: each shard's tensors tile [header, size) exactly, in name order.
    sizes = {s.name: s.nbytes for s in plan.specs}
    for layout in layouts:
        suffix = f".{layout.path.name}.partial"
        places = sorted((off, n) for t in tasks for n, (path, off) in t.places.items() if path.endswith(suffix))
        assert places[0][0] == len(layout.header)
        assert [n for _, n in places] == sorted(n for _, n in places)
        assert all(a[0] + sizes[a[1]] == b[0] for a, b in itertools.pairwise(places))
        assert places[-1][0] + sizes[places[-1][1]] == layout.size


def test_failure_leaves_no_partial_or_finished_shard(tmp_path, monkeypatch):
    from kimi_nvfp4.synth import writing

    real = writing.unit_chunks
    calls = {"n": 0}

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 40:
            raise RuntimeError("boom")
        return real(*args, **kwargs)

    monkeypatch.setattr(writing, "unit_chunks", failing)
    with pytest.raises(RuntimeError, match="boom"):
        create_synthetic_checkpoint(tmp_path / "x", vocab_size=SMALL_VOCAB, shards=3)
    assert not [p.name for p in (tmp_path / "x").iterdir()]


def test_disk_full_while_writing_is_an_output_error(tmp_path, monkeypatch):
    import errno

    from kimi_nvfp4.errors import OutputError
    from kimi_nvfp4.synth import writing

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writing, "_pwrite_all", full)
    with pytest.raises(OutputError, match="disk full"):
        create_synthetic_checkpoint(tmp_path / "x", vocab_size=SMALL_VOCAB, shards=2)
    assert not [p.name for p in (tmp_path / "x").iterdir()]


def test_bad_device_and_workers_are_refused(tmp_path):
    from kimi_nvfp4.errors import DeviceError

    with pytest.raises(DeviceError):
        create_synthetic_checkpoint(tmp_path / "a", vocab_size=SMALL_VOCAB, device="tpu")
    with pytest.raises(ValueError, match="workers"):
        create_synthetic_checkpoint(tmp_path / "b", vocab_size=SMALL_VOCAB, workers=0)
    if not torch.cuda.is_available():
        with pytest.raises(DeviceError, match="CUDA"):
            create_synthetic_checkpoint(tmp_path / "c", vocab_size=SMALL_VOCAB, device="cuda")
        auto = create_synthetic_checkpoint(tmp_path / "d", vocab_size=SMALL_VOCAB, shards=3, seed=5, device="auto")
        assert _file_digests(auto) == PINNED_SMALL_VOCAB_SHARDS


def test_cli_workers_and_device_options(tmp_path):
    out = tmp_path / "cli"
    result = CliRunner().invoke(
        cli, ["synth", str(out), "--shards", "3", "--seed", "5", "--vocab-size", "256", "--workers", "2", "--device", "cpu"]
    )
    assert result.exit_code == 0, result.output
    assert _file_digests(out) == PINNED_SMALL_VOCAB_SHARDS


def test_int4_matrix_fast_path_matches_the_reference_formula():
    """The in-place / aminmax quantization equals the straightforward formula it replaced, on real widths."""
    from kimi_nvfp4.synth.tensors import (
        EXPERT_ROW_LOG_STD,
        INT4_ABSMAX_DIVISOR,
        LINEAR_WEIGHT_STD,
        CodeDistribution,
        Workspace,
        _generator,
        synthetic_int4_matrix,
    )

    out_f, in_f = 96, 7168
    gen = _generator(3, "m")
    row_std = LINEAR_WEIGHT_STD * torch.exp(torch.randn(out_f, 1, generator=gen) * EXPERT_ROW_LOG_STD)
    w = (torch.randn(out_f, in_f, generator=gen) * row_std).view(out_f, in_f // 32, 32)
    scale = (w.abs().amax(dim=-1) / INT4_ABSMAX_DIVISOR).to(torch.bfloat16)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    codes = torch.round(w / scale.float().unsqueeze(-1)).clamp_(-8, 7).to(torch.int8).view(out_f, in_f)
    workspace = Workspace()
    for _ in range(2):  # a reused workspace buffer gives the same result
        got_codes, got_scale = synthetic_int4_matrix("m", out_f, in_f, 3, CodeDistribution.REALISTIC, workspace=workspace)
        assert torch.equal(got_codes, codes) and torch.equal(got_scale.view(torch.int16), scale.view(torch.int16))


@pytest.mark.gpu
def test_cuda_synth_is_deterministic_valid_and_differs_from_cpu(make_tiny_k2, tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    a = make_tiny_k2(tmp_path / "a", vocab_size=SMALL_VOCAB, shards=3, seed=5, device="cuda")
    b = make_tiny_k2(tmp_path / "b", vocab_size=SMALL_VOCAB, shards=3, seed=5, device="cuda", workers=2)
    assert _file_digests(a) == _file_digests(b)
    assert _file_digests(a) != PINNED_SMALL_VOCAB_SHARDS
    cpu = make_tiny_k2(tmp_path / "cpu", vocab_size=SMALL_VOCAB, shards=3, seed=5)
    assert (a / INDEX_NAME).read_bytes() == (cpu / INDEX_NAME).read_bytes()  # same tensors in the same shards
    reader = CheckpointReader(a)
    assert {n: (i.dtype, i.shape) for n, i in reader.tensors.items()} == {
        n: (i.dtype, i.shape) for n, i in CheckpointReader(cpu).tensors.items()
    }
    name = "language_model.model.layers.1.mlp.experts.0.gate_proj"
    codes = unpack_int4(reader.load(f"{name}.weight_packed"), 64)
    group_max = codes.to(torch.int16).abs().view(32, 2, 32).amax(-1)
    assert bool(((group_max == 7) | (group_max == 8)).all())
    std = reader.load("language_model.model.layers.0.mlp.gate_proj.weight").float().std()
    assert 0.015 < float(std) < 0.025
