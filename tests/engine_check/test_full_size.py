"""The full-size listing is what convert writes: checked against a real conversion at tiny size."""

from __future__ import annotations

import json

import pytest

from kimi_nvfp4.checkpoint.modelopt_config import ActivationScheme
from kimi_nvfp4.checkpoint.reader import CheckpointReader
from kimi_nvfp4.convert import convert_checkpoint
from kimi_nvfp4.engine_check.full_size import (
    K26_VISION_LAYERS,
    nvfp4_listing,
    read_listing,
    write_converted_configs,
    write_full_size_checkpoint,
)
from kimi_nvfp4.synth import create_synthetic_checkpoint
from kimi_nvfp4.synth.checkpoint import plan_synthetic_checkpoint


@pytest.fixture(scope="module")
def tiny_converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("full_size")
    create_synthetic_checkpoint(root / "src", preset="tiny", shards=2)
    convert_checkpoint(root / "src", root / "out", device="cpu", progress=False, record_stats=False)
    return root


def test_listing_equals_the_converted_checkpoints_tensors(tiny_converted):
    plan = plan_synthetic_checkpoint(preset="tiny")
    listing = nvfp4_listing(plan.specs, ActivationScheme.W4A16)
    converted = CheckpointReader(tiny_converted / "out").tensors
    assert {n: (i.dtype, i.shape) for n, i in listing.items()} == {n: (i.dtype, i.shape) for n, i in converted.items()}
    w4a4 = nvfp4_listing(plan.specs, ActivationScheme.W4A4)
    assert set(w4a4) - set(listing) == {n.replace(".weight_scale_2", ".input_scale") for n in listing if
                                        n.endswith(".weight_scale_2")}


def test_configs_equal_converts(tiny_converted, tmp_path):
    plan = plan_synthetic_checkpoint(preset="tiny")
    listing = nvfp4_listing(plan.specs, ActivationScheme.W4A16)
    hf, config = write_converted_configs(tmp_path, plan.config, listing, scheme=ActivationScheme.W4A16,
                                         kv_cache_quant_algo="FP8")
    out = tiny_converted / "out"
    assert hf == json.loads((out / "hf_quant_config.json").read_text())
    assert config == json.loads((out / "config.json").read_text())


def test_full_size_folder_holds_configs_and_listing_only(tmp_path):
    path = write_full_size_checkpoint(tmp_path, layers=3, experts=8)
    listing = read_listing(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "hf_quant_config.json", "tensor_listing.json"]
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["text_config"]["num_hidden_layers"] == 3 and config["text_config"]["n_routed_experts"] == 8
    assert config["vision_config"]["vt_num_hidden_layers"] == K26_VISION_LAYERS
    assert f"vision_tower.encoder.blocks.{K26_VISION_LAYERS - 1}.wqkv.weight" in listing
    scales = [n for n in listing if n.endswith(".input_scale")]
    assert len(scales) == 2 * 8 * 3  # two MoE layers, 8 experts, 3 projections (W4A4 by default)
    assert json.loads((tmp_path / "hf_quant_config.json").read_text())["quantization"]["quant_algo"] == "NVFP4"
