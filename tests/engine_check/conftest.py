"""Converted checkpoints for the engine checks, and skips when SGLang / vLLM are not installed.

The engines are looked up by their distribution metadata instead of being imported: importing SGLang
patches transformers process-wide, so only the check's child processes import it.
Fixtures: `demo_w4a16` (the bundled demo model converted: weight-only), `demo_w4a4` (the same,
calibrated), `synth_k26` (synth --preset k2.6, 2 layers, 4 experts, converted), `full_size_k26` (config
files and tensor listing of the whole converted K2.6, for the meta device).
"""

from __future__ import annotations

import importlib.metadata
import json
import shutil
from pathlib import Path

import pytest

from kimi_nvfp4.calibrate.api import calibrate_checkpoint
from kimi_nvfp4.convert import convert_checkpoint
from kimi_nvfp4.demo_model import DEMO_CHECKPOINT
from kimi_nvfp4.synth import create_synthetic_checkpoint

SYNTH_LAYERS, SYNTH_EXPERTS = 2, 4
SYNTH_VOCAB = 1024  # embeddings at K2.6's width; the vocabulary does not matter to the loaders
CALIBRATION = {"samples": 8, "seq_len": 64}


def _installed(dist: str) -> bool:
    try:
        importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.fixture(scope="session")
def sglang_installed() -> None:
    if not _installed("sglang"):
        pytest.skip("SGLang is not installed (kimi-nvfp4[engines], docs/engine_check.md)")


@pytest.fixture(scope="session")
def vllm_installed() -> None:
    if not _installed("vllm"):
        pytest.skip("vLLM is not installed (kimi-nvfp4[engines], docs/engine_check.md)")


@pytest.fixture(scope="session")
def demo_w4a16(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("engine_demo") / "w4a16"
    convert_checkpoint(DEMO_CHECKPOINT, out, device="cpu", progress=False, record_stats=False)
    return out


@pytest.fixture(scope="session")
def demo_w4a4(demo_w4a16, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("engine_demo_calibrated") / "w4a4"
    shutil.copytree(demo_w4a16, out)
    calibrate_checkpoint(out, DEMO_CHECKPOINT, "sample", device="cpu", progress=False, save_activation_stats=False,
                         **CALIBRATION)
    return out


@pytest.fixture(scope="session")
def synth_k26(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("engine_synth_k26")
    src = create_synthetic_checkpoint(root / "src", preset="k2.6", layers=SYNTH_LAYERS, experts=SYNTH_EXPERTS,
                                      vocab_size=SYNTH_VOCAB, shards=2)
    # SGLang builds MoonViT from vision_config's unprefixed sizes, whose defaults are K2.6's (27 blocks); the synth
    # tower has one block, so say so in the names SGLang reads (the real K2.6 relies on the defaults).
    config = json.loads((src / "config.json").read_text())
    v = config["vision_config"]
    v.update(hidden_size=v["vt_hidden_size"], num_hidden_layers=v["vt_num_hidden_layers"],
             num_attention_heads=v["vt_num_attention_heads"], intermediate_size=v["vt_intermediate_size"])
    (src / "config.json").write_text(json.dumps(config, indent=2))
    convert_checkpoint(src, root / "out", device="cpu", progress=False, record_stats=False, fsync=False)
    shutil.rmtree(src)
    return root / "out"


@pytest.fixture(scope="session")
def full_size_k26(tmp_path_factory) -> Path:
    from kimi_nvfp4.engine_check.full_size import write_full_size_checkpoint

    folder = tmp_path_factory.mktemp("engine_full_size") / "k26"
    write_full_size_checkpoint(folder)
    return folder
