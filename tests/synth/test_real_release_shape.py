"""Synthetic checkpoints look like Moonshot's K2.6 upload: config keys and values, where the quantization block
sits, the remote-code files beside the tokenizer (copied, never run), and the order of the shards."""

from __future__ import annotations

import json
import runpy

import pytest

from kimi_nvfp4.checkpoint.reader import CONFIG_NAME, CheckpointReader
from kimi_nvfp4.checkpoint.source_checks import check_quantization_config
from kimi_nvfp4.convert.api import convert_checkpoint
from kimi_nvfp4.data.tokenizer import load_tokenizer
from kimi_nvfp4.errors import CheckpointError
from kimi_nvfp4.synth import create_synthetic_checkpoint, plan_synthetic_checkpoint
from kimi_nvfp4.synth.checkpoint import ShardLayout, shard_file_name, split_like_release
from kimi_nvfp4.synth.tokenizer_files import EXECUTED_MARKER_SUFFIX

SMALL_VOCAB = 256
# K2.5/K2.6 config.json `vision_config` keys (Moonshot's upload; SGLang 0.5.23 configs/kimi_k25.py reads them).
K26_VISION_KEYS = {
    "init_pos_emb_height", "init_pos_emb_time", "init_pos_emb_width", "merge_kernel_size", "merge_type",
    "mm_hidden_size", "mm_projector_type", "model_type", "patch_size", "pos_emb_type", "projector_hidden_act",
    "projector_ln_eps", "text_hidden_size", "video_attn_type", "vt_hidden_size", "vt_intermediate_size",
    "vt_num_attention_heads", "vt_num_hidden_layers",
}
K26_LAYERS = 61


def test_k26_config_has_the_real_keys_and_values():
    config = plan_synthetic_checkpoint(preset="k2.6").config
    text, vision = config["text_config"], config["vision_config"]
    assert text["model_type"] == "kimi_k2" and text["architectures"] == ["DeepseekV3ForCausalLM"]
    assert text["rope_scaling"] == {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                                    "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    assert "quantization_config" not in config and "quantization_config" in text  # only inside text_config
    assert set(vision) == K26_VISION_KEYS and list(vision) == sorted(vision)
    assert (vision["vt_hidden_size"], vision["mm_hidden_size"], vision["text_hidden_size"]) == (1152, 1152, 7168)
    assert (vision["pos_emb_type"], vision["merge_type"], vision["mm_projector_type"]) == (
        "divided_fixed", "sd2_tpool", "patchmerger")
    assert config["video_placeholder"] == "<|kimi_k25_video_placeholder|>"
    assert config["auto_map"]["AutoConfig"] == "configuration_kimi_k25.KimiK25Config"


def test_tiny_keeps_beta_fast_one_and_both_levels():
    config = plan_synthetic_checkpoint(preset="tiny", vocab_size=SMALL_VOCAB).config
    assert config["text_config"]["rope_scaling"]["beta_fast"] == 1.0
    assert config["quantization_config"] == config["text_config"]["quantization_config"]
    assert config["text_config"]["model_type"] == "kimi_k2"
    assert set(config["vision_config"]) == K26_VISION_KEYS


@pytest.mark.parametrize("placement", ["both", "text_config"])
def test_both_placements_convert(make_tiny_k2, tmp_path, placement):
    src = make_tiny_k2(tmp_path / "src", vocab_size=SMALL_VOCAB, quant_config_placement=placement)
    config = json.loads((src / CONFIG_NAME).read_text())
    assert ("quantization_config" in config) is (placement == "both")
    check_quantization_config(config)
    out = tmp_path / "out"
    convert_checkpoint(src, out, device="cpu", progress=False, record_stats=False)
    reader = CheckpointReader(out)
    assert any(n.endswith(".weight_scale_2") for n in reader.weight_map)
    converted = json.loads((out / CONFIG_NAME).read_text())
    assert converted["text_config"]["quantization_config"]["quant_method"] == "modelopt"


def test_two_copies_that_disagree_are_refused(make_tiny_k2, tmp_path):
    src = make_tiny_k2(tmp_path / "src", vocab_size=SMALL_VOCAB, quant_config_placement="both")
    config = json.loads((src / CONFIG_NAME).read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 128
    (src / CONFIG_NAME).write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="top-level and text_config blocks differ") as e:
        convert_checkpoint(src, tmp_path / "out", device="cpu", progress=False)
    assert CONFIG_NAME in str(e.value)
    assert not (tmp_path / "out" / CONFIG_NAME).exists()


def test_configuration_kimi_k25_is_copied_byte_for_byte_and_never_executed(make_tiny_k2, tmp_path):
    src = make_tiny_k2(tmp_path / "src", vocab_size=SMALL_VOCAB)
    code = (src / "configuration_kimi_k25.py").read_bytes()
    assert (src / "tokenization_kimi.py").is_file()
    out = tmp_path / "out"
    convert_checkpoint(src, out, device="cpu", progress=False, record_stats=False)
    load_tokenizer(out)  # what calibrate / validate / serve-check read from the folder
    assert (out / "configuration_kimi_k25.py").read_bytes() == code
    assert not list(tmp_path.rglob(f"*{EXECUTED_MARKER_SUFFIX}"))  # nothing ran it
    # ... and the stand-in is a real tripwire: running it leaves the marker and raises
    with pytest.raises(RuntimeError, match="never run checkpoint code"):
        runpy.run_path(str(out / "configuration_kimi_k25.py"))
    assert (out / f"configuration_kimi_k25.py{EXECUTED_MARKER_SUFFIX}").is_file()


def test_deepseek_layout_ships_its_own_configuration_module(make_tiny_k2, tmp_path):
    src = make_tiny_k2(tmp_path / "src", vocab_size=SMALL_VOCAB, layout="deepseek_v3")
    assert (src / "configuration_deepseek.py").is_file() and not (src / "configuration_kimi_k25.py").exists()


def test_k26_release_order_puts_each_layer_alone_then_head_projector_tower():
    plan = plan_synthetic_checkpoint(preset="k2.6")
    groups = split_like_release(plan.specs, plan.prefix, plan.text.num_hidden_layers)
    assert len(groups) == K26_LAYERS + 3  # model-00001..00061 layers, 00062 head, 00063 projector, 00064 tower
    assert shard_file_name(len(groups), len(groups)) == "model-00064-of-000064.safetensors"
    for layer in range(K26_LAYERS):
        assert {s.name.split(".")[3] for s in groups[layer]} == {str(layer)}
    tail = [s.name for s in groups[K26_LAYERS]]
    assert tail[0] == "language_model.lm_head.weight"
    assert set(tail) == {"language_model.lm_head.weight", "language_model.model.embed_tokens.weight",
                         "language_model.model.norm.weight"}
    assert all(s.name.startswith("mm_projector.") for s in groups[K26_LAYERS + 1])
    assert all(s.name.startswith("vision_tower.") for s in groups[K26_LAYERS + 2])
    assert sum(map(len, groups)) == len(plan.specs)


def test_release_layout_written(make_tiny_k2, tmp_path):
    """The same grouping on disk (tiny sizes; k2.6 picks it by default whenever shards > 1)."""
    out = make_tiny_k2(tmp_path / "rel", vocab_size=SMALL_VOCAB, shards=2, shard_layout=ShardLayout.RELEASE)
    reader = CheckpointReader(out)
    layers = reader.layout.text.num_hidden_layers
    assert len(reader.shard_files) == layers + 3
    for layer in range(layers):
        assert {f for n, f in reader.weight_map.items() if f".layers.{layer}." in n} == {
            shard_file_name(layer + 1, layers + 3)}
    assert reader.weight_map["language_model.lm_head.weight"] == shard_file_name(layers + 1, layers + 3)
    assert reader.weight_map["language_model.model.embed_tokens.weight"] == shard_file_name(layers + 1, layers + 3)



def test_cli_options_for_placement_and_shard_layout(tmp_path):
    from click.testing import CliRunner

    from kimi_nvfp4.cli import cli

    out = tmp_path / "cli"
    result = CliRunner().invoke(cli, ["synth", str(out), "--vocab-size", str(SMALL_VOCAB), "--shards", "2",
                                      "--shard-layout", "release", "--quant-config-placement", "text_config"])
    assert result.exit_code == 0, result.output
    config = json.loads((out / CONFIG_NAME).read_text())
    assert "quantization_config" not in config
    assert len(CheckpointReader(out).shard_files) == config["text_config"]["num_hidden_layers"] + 3
