"""`calibrate --method gptq --propagation sequential` (calibrate/fused_method.py): the advance pass runs the requantized
experts, so every later MoE layer is solved from other inputs than with the default (int4) propagation, while the
first MoE layer, whose inputs no requantized layer precedes, is solved to the same bytes."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from kimi_nvfp4.calibrate import calibrate_checkpoint
from kimi_nvfp4.calibrate.fused_method import FUSED_RECORD
from kimi_nvfp4.calibrate.options import CalibrateOptions
from kimi_nvfp4.checkpoint.manifest import load_manifest
from kimi_nvfp4.checkpoint.reader import CheckpointReader
from kimi_nvfp4.convert.api import convert_checkpoint
from kimi_nvfp4.demo_model import DEMO_CHECKPOINT
from kimi_nvfp4.model import NVFP4Weights
from kimi_nvfp4.model.linear import NVFP4Linear

from ..gloo_ranks import gloo_rank, spawn_ranks

DEMO = dict(samples=4, seq_len=128, device="cpu", progress=False)


def _expert_tensors(out: Path, layer: int) -> dict[str, torch.Tensor]:
    reader = CheckpointReader(out)
    prefix = f"{reader.layout.layer_prefix(layer)}mlp.experts."
    tensors = {}
    for name, file in reader.weight_map.items():
        if name.startswith(prefix) and not name.endswith("input_scale"):
            with safe_open(str(out / file), framework="pt") as f:
                tensors[name] = f.get_tensor(name)
    return tensors


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    assert a.keys() == b.keys() and a
    return all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) if a[k].dtype != torch.float32
               else torch.equal(a[k], b[k]) for k in a)


def test_sequential_propagation_changes_the_later_moe_layers_only(tmp_path):
    converted, int4, sequential = tmp_path / "converted", tmp_path / "int4", tmp_path / "sequential"
    convert_checkpoint(DEMO_CHECKPOINT, converted, device="cpu", progress=False)
    shutil.copytree(converted, int4)
    shutil.copytree(converted, sequential)
    calibrate_checkpoint(int4, DEMO_CHECKPOINT, "sample", method="gptq", **DEMO)
    calibrate_checkpoint(sequential, DEMO_CHECKPOINT, "sample", method="gptq", propagation="sequential", **DEMO)

    cfg = CheckpointReader(converted).layout.text
    moe = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    assert len(moe) >= 2
    assert _same(_expert_tensors(int4, moe[0]), _expert_tensors(sequential, moe[0]))
    assert not _same(_expert_tensors(converted, moe[0]), _expert_tensors(sequential, moe[0]))  # it was solved
    for layer in moe[1:]:
        assert not _same(_expert_tensors(int4, layer), _expert_tensors(sequential, layer)), layer

    stage = load_manifest(sequential).stages["calibrate"]
    assert stage.settings["propagation"] == "sequential"
    assert stage.outputs[FUSED_RECORD]["propagation"] == "sequential"
    default = load_manifest(int4).stages["calibrate"]
    assert "propagation" not in default.settings  # the default leaves earlier records matching
    assert default.outputs[FUSED_RECORD]["propagation"] == "int4"


def test_propagation_needs_a_method_and_enters_the_resume_fingerprint():
    with pytest.raises(ValueError, match="needs --method"):
        CalibrateOptions(propagation="sequential")
    assert "propagation" not in CalibrateOptions(method="gptq").recorded()
    assert CalibrateOptions(method="gptq", propagation="sequential").recorded()["propagation"] == "sequential"


@pytest.mark.parametrize("materialize", [False, True])
def test_replace_weights_swaps_an_experts_tensors_in_a_loaded_layer(tmp_path, materialize):
    out = tmp_path / "converted"
    convert_checkpoint(DEMO_CHECKPOINT, out, device="cpu", progress=False)
    reader = CheckpointReader(out)
    layer = next(i for i in range(reader.layout.text.num_hidden_layers) if reader.layout.text.is_moe_layer(i))
    source = NVFP4Weights(reader, activations="w4a16")
    w = source.layer(layer, torch.device("cpu"), torch.float32)
    if materialize:
        w.materialize()
    before = {lin.module: lin.weight().clone() for lin in w.linears() if isinstance(lin, NVFP4Linear)}
    # expert 0 takes expert 1's tensors
    tensors = {name.replace("mlp.experts.1.", "mlp.experts.0."): t
               for name, t in _expert_tensors(out, layer).items() if ".mlp.experts.1." in name}
    assert source.replace_weights(w, tensors) == 3
    after = {lin.module: lin for lin in w.linears() if isinstance(lin, NVFP4Linear)}
    for proj in ("gate_proj", "up_proj", "down_proj"):
        lin = after[f"mlp.experts.0.{proj}"]
        assert lin.materialized is materialize
        assert torch.equal(lin.weight(), before[f"mlp.experts.1.{proj}"])
        assert torch.equal(after[f"mlp.experts.2.{proj}"].weight(), before[f"mlp.experts.2.{proj}"])
    with pytest.raises(ValueError, match="not a tensor of layer"):
        source.replace_weights(w, {"model.layers.99.mlp.experts.0.gate_proj.weight": torch.zeros(1)})


def _rank(rank: int, world: int, port: int, out: str) -> None:
    with gloo_rank(rank, world, port):
        calibrate_checkpoint(Path(out), DEMO_CHECKPOINT, "sample", method="gptq", propagation="sequential", **DEMO)


def test_two_ranks_propagate_rank_0s_solved_experts(tmp_path):
    """Only rank 0 solves: the others' advance passes need its tensors (broadcast), or they would drift apart."""
    converted, one, two = tmp_path / "converted", tmp_path / "one", tmp_path / "two"
    convert_checkpoint(DEMO_CHECKPOINT, converted, device="cpu", progress=False)
    shutil.copytree(converted, one)
    shutil.copytree(converted, two)
    calibrate_checkpoint(one, DEMO_CHECKPOINT, "sample", method="gptq", propagation="sequential", **DEMO)
    spawn_ranks(_rank, 2, str(two))
    cfg = CheckpointReader(converted).layout.text
    for layer in [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]:
        assert _same(_expert_tensors(one, layer), _expert_tensors(two, layer)), layer
