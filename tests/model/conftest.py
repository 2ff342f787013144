"""Fixtures of the model tests: tiny INT4 checkpoints (via the shared synth factory) and their
NVFP4 conversions, made here with `quantize_nvfp4` so these tests do not depend on the convert stage."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kimi_nvfp4.checkpoint.layout import parse_expert_name
from kimi_nvfp4.checkpoint.modelopt_config import HF_QUANT_CONFIG_NAME
from kimi_nvfp4.checkpoint.reader import INDEX_NAME, CheckpointReader
from kimi_nvfp4.numerics.int4 import dequantize_int4
from kimi_nvfp4.numerics.nvfp4 import quantize_nvfp4, tensor_scale_from_amax
from kimi_nvfp4.synth import create_synthetic_checkpoint

# Small vocabulary: the tests never run the tokenizer, and a 163840-row table would dominate run time.
TEST_VOCAB = 512
NVFP4_SHARD = "model-00001-of-000001.safetensors"


def nvfp4_from_int4(
    src: Path,
    dst: Path,
    input_scales: Callable[[str], float] | None = None,
    dense_nvfp4: Callable[[str], float | None] | None = None,
) -> Path:
    """Write `dst`: `src` with every routed expert re-quantized to ModelOpt NVFP4 (gate/up share one
    weight_scale_2), `input_scales(module) -> float` adding `input_scale` tensors when given.
    `dense_nvfp4(module)` returning an input scale (not None) also quantizes that BF16 linear, alone."""
    reader = CheckpointReader(src)
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, torch.Tensor]] = {}
    for name in reader.weight_map:
        parsed = parse_expert_name(name)
        module = name.removesuffix(".weight")
        dense_scale = dense_nvfp4(module) if dense_nvfp4 is not None and name.endswith(".weight") else None
        if dense_scale is not None:
            q = quantize_nvfp4(reader.load(name).to(torch.float32))
            out[f"{module}.weight"], out[f"{module}.weight_scale"] = q.weight, q.weight_scale
            out[f"{module}.weight_scale_2"] = q.weight_scale_2.clone()
            out[f"{module}.input_scale"] = torch.tensor(float(dense_scale), dtype=torch.float32)
        elif parsed is None:
            out[name] = reader.load(name)
        else:
            experts.setdefault(parsed.module, {})[parsed.suffix] = reader.load(name)
    dense = {
        module: dequantize_int4(t["weight_packed"], t["weight_scale"], int(t["weight_shape"][1]))
        for module, t in experts.items()
    }
    for module in dense:
        if module.endswith("up_proj"):
            continue
        partner = module.replace("gate_proj", "up_proj") if module.endswith("gate_proj") else None
        group = [module] + ([partner] if partner else [])
        scale_2 = tensor_scale_from_amax(max(dense[m].abs().max() for m in group))
        for m in group:
            q = quantize_nvfp4(dense[m], weight_scale_2=scale_2)
            out[f"{m}.weight"], out[f"{m}.weight_scale"], out[f"{m}.weight_scale_2"] = (
                q.weight, q.weight_scale, q.weight_scale_2.clone(),
            )
            if input_scales is not None:
                out[f"{m}.input_scale"] = torch.tensor(float(input_scales(m)), dtype=torch.float32)
    dst.mkdir(parents=True)
    save_file(out, str(dst / NVFP4_SHARD))
    (dst / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": {n: NVFP4_SHARD for n in out}}))
    config = json.loads((src / "config.json").read_text())
    modelopt = {"quant_method": "modelopt", "quant_algo": "NVFP4"}
    config["quantization_config"] = modelopt
    if "text_config" in config:
        config["text_config"]["quantization_config"] = modelopt
    (dst / "config.json").write_text(json.dumps(config))
    (dst / HF_QUANT_CONFIG_NAME).write_text(json.dumps({"quantization": {"quant_algo": "NVFP4", "group_size": 16}}))
    return dst


@pytest.fixture(scope="session")
def tiny_src(tmp_path_factory) -> Path:
    """Tiny K2.6-layout INT4 checkpoint (3 layers: dense layer 0, two MoE layers of 8 experts, top-2)."""
    return create_synthetic_checkpoint(tmp_path_factory.mktemp("model") / "int4", vocab_size=TEST_VOCAB, shards=2)


@pytest.fixture(scope="session")
def tiny_nvfp4(tiny_src, tmp_path_factory) -> Path:
    """The NVFP4 conversion of `tiny_src`, without input scales."""
    return nvfp4_from_int4(tiny_src, tmp_path_factory.mktemp("model") / "nvfp4")


@pytest.fixture(scope="session")
def tiny_nvfp4_calibrated(tiny_src, tmp_path_factory) -> Path:
    """The NVFP4 conversion with a distinct input_scale per expert linear (expert e, proj p)."""
    def scale(module: str) -> float:
        parsed = parse_expert_name(module + ".weight")
        proj_offset = {"gate_proj": 0.0, "up_proj": 0.5, "down_proj": 0.25}[parsed.proj]
        return 0.001 * (1 + parsed.expert + proj_offset)

    return nvfp4_from_int4(tiny_src, tmp_path_factory.mktemp("model") / "nvfp4_cal", scale)


@pytest.fixture
def copy_checkpoint(tmp_path) -> Callable[[Path], Path]:
    def _copy(src: Path) -> Path:
        dst = tmp_path / src.name
        shutil.copytree(src, dst)
        return dst

    return _copy
