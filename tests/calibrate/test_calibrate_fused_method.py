"""`calibrate --method gptq` (calibrate/fused_method.py): each MoE layer's experts solved in memory in the layer loop.

- the shards are byte for byte those of `calibrate --expert-stats hessian` then `requantize --method gptq
  --no-recalibrate` (the fused run propagates the int4-aware layer's outputs, as the two-stage calibrate does);
- no statistics file is written (a debug flag keeps them);
- a run killed between layers resumes to the same bytes;
- the expert batch comes from the memory planner."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch

from kimi_nvfp4.calibrate import calibrate_checkpoint
from kimi_nvfp4.calibrate.fused_method import FUSED_DIR
from kimi_nvfp4.checkpoint.k2_config import K2Config
from kimi_nvfp4.checkpoint.manifest import load_manifest
from kimi_nvfp4.convert.api import convert_checkpoint
from kimi_nvfp4.demo_model import DEMO_CHECKPOINT
from kimi_nvfp4.errors import CheckpointError, ResourceError
from kimi_nvfp4.model import weights as model_weights
from kimi_nvfp4.requantize import requantize_checkpoint
from kimi_nvfp4.stage_kit.expert_solve_plan import hessian_bytes, method_reserve_bytes, plan_expert_solve, \
    solve_bytes_per_expert
from kimi_nvfp4.stage_kit.memory_plan import plan_memory

DEMO = dict(samples=4, seq_len=128, device="cpu", progress=False)
TINY = dict(samples=4, seq_len=48, device="cpu", progress=False)
NO_OVERHEAD_CAP = 1e6


@pytest.fixture(scope="module")
def demo_converted(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fused") / "demo_nvfp4"
    convert_checkpoint(DEMO_CHECKPOINT, out, device="cpu", progress=False)
    return out


def _shards(out: Path) -> dict[str, str]:
    return {f: r.sha256 for f, r in load_manifest(out).shards.items()}


def test_fused_gptq_writes_the_two_stage_shards_and_no_statistics(demo_converted, tmp_path):
    two_stage, fused = tmp_path / "two_stage", tmp_path / "fused"
    shutil.copytree(demo_converted, two_stage)
    shutil.copytree(demo_converted, fused)
    calibrate_checkpoint(two_stage, DEMO_CHECKPOINT, "sample", expert_stats="hessian", **DEMO)
    requantize_checkpoint(two_stage, DEMO_CHECKPOINT, method="gptq", device="cpu", recalibrate=False, progress=False)
    calibrate_checkpoint(fused, DEMO_CHECKPOINT, "sample", method="gptq", **DEMO)

    converted, want, got = _shards(demo_converted), _shards(two_stage), _shards(fused)
    assert got == want
    rewritten = [f for f in want if f in converted and want[f] != converted[f]]
    assert rewritten  # the experts did change: the comparison is not of untouched shards
    assert not (fused / "calibration" / "expert_stats").exists()  # 0 bytes of statistics on disk
    assert not (fused / "calibration" / FUSED_DIR).exists()  # the staged layers are gone once the shards hold them
    manifest = load_manifest(fused)
    calibrate = manifest.stages["calibrate"]
    assert calibrate.settings["method"] == "gptq" and calibrate.settings["method_options"]["damping"] == 0.01
    requantize = manifest.stages["requantize"]
    assert requantize.complete and requantize.outputs["statistics_mode"] == "in-memory"
    two_stage_record = load_manifest(two_stage).stages["requantize"].outputs["shards"]
    for file, entry in requantize.outputs["shards"].items():
        assert entry["sources"] == two_stage_record[file]["sources"]
        assert entry["matrices_kept_search"] == two_stage_record[file]["matrices_kept_search"]


def test_the_debug_flag_keeps_the_statistics_files(demo_converted, tmp_path):
    out = tmp_path / "kept"
    shutil.copytree(demo_converted, out)
    calibrate_checkpoint(out, DEMO_CHECKPOINT, "sample", method="act-diag", keep_expert_stats=True, **DEMO)
    assert sorted(p.name for p in (out / "calibration" / "expert_stats").iterdir())
    with pytest.raises(CheckpointError, match="already rewrote"):  # the experts are no longer convert's
        calibrate_checkpoint(out, DEMO_CHECKPOINT, "sample", method="gptq", **DEMO)


def test_method_options_need_a_method_and_exclude_expert_stats(demo_converted, tmp_path):
    with pytest.raises(ValueError, match="needs --method"):
        calibrate_checkpoint(demo_converted, DEMO_CHECKPOINT, "sample", method_options={"damping": 0.1}, **DEMO)
    with pytest.raises(ValueError, match="keeps the expert statistics in memory"):
        calibrate_checkpoint(demo_converted, DEMO_CHECKPOINT, "sample", method="gptq", expert_stats="hessian",
                             **DEMO)


@pytest.fixture
def fail_at_layer(monkeypatch):
    seen = Counter()
    real = model_weights._CheckpointWeights.layer

    def counting(source, i, *args, **kwargs):
        seen[i] += 1
        if i == getattr(seen, "fail_at", None):
            raise RuntimeError("injected failure")
        return real(source, i, *args, **kwargs)

    monkeypatch.setattr(model_weights._CheckpointWeights, "layer", counting)
    return seen


def test_a_fused_run_killed_between_layers_resumes_to_the_same_bytes(tmp_path, fail_at_layer):
    from kimi_nvfp4.synth import create_synthetic_checkpoint

    src = create_synthetic_checkpoint(tmp_path / "src", preset="tiny", shards=4)
    fresh, killed = tmp_path / "fresh", tmp_path / "killed"
    convert_checkpoint(src, fresh, device="cpu", progress=False)
    shutil.copytree(fresh, killed)
    options = dict(TINY, method="gptq", resume_every=1, resume_max_overhead=NO_OVERHEAD_CAP)
    calibrate_checkpoint(fresh, src, "sample", **options)
    fail_at_layer.clear()
    fail_at_layer.fail_at = 2  # 3 layers: layers 0 and 1 solved, staged and snapshotted
    with pytest.raises(RuntimeError, match="injected failure"):
        calibrate_checkpoint(killed, src, "sample", **options)
    assert sorted(p.name for p in (killed / "calibration" / FUSED_DIR).iterdir()) == ["layer_001.safetensors"]
    fail_at_layer.fail_at = None
    fail_at_layer.clear()
    calibrate_checkpoint(killed, src, "sample", **options)
    assert fail_at_layer == Counter({2: 1})  # layers 0 and 1 came from the snapshot
    assert _shards(killed) == _shards(fresh)
    for file in _shards(fresh):
        assert (killed / file).read_bytes() == (fresh / file).read_bytes()


def _k26() -> K2Config:
    config = json.loads((DEMO_CHECKPOINT / "config.json").read_text())
    text = config.get("text_config", config)
    text.update(hidden_size=7168, moe_intermediate_size=2048, n_routed_experts=384, num_experts_per_tok=8)
    return K2Config.from_dict(text)


def test_the_expert_batch_is_planned_from_the_memory_left():
    cfg = _k26()
    assert hessian_bytes(cfg, torch.device("cuda")) == 384 * (7168**2 + 2048**2) * 4  # float32 sums, consumed
    plan = plan_memory(cfg, stage="calibrate", device=torch.device("cuda"), dtype=torch.bfloat16, tokens=65536,
                       seq_len=2048, streams=1, sources=1, gpu_memory=400 * 2**30, host_memory=900 * 2**30,
                       default_chunk_tokens=65536)
    solve = plan_expert_solve(cfg, plan, torch.device("cuda"))
    assert solve.group_experts == 384 and solve.groups == 1  # 400 GiB: the layer's statistics fit at once
    left = plan.gpu_budget_bytes - plan.estimated_peak_gpu_bytes + plan.components["chunk_work"] - solve.hessian_bytes
    assert solve.batch_experts == min(384, left // solve_bytes_per_expert(cfg)) and 1 <= solve.batch_experts < 384
    assert plan.components["expert_hessians"] == solve.hessian_bytes
    bigger = plan.model_copy(update={"gpu_budget_bytes": plan.gpu_budget_bytes + 50 * 2**30})
    assert plan_expert_solve(cfg, bigger, torch.device("cuda")).batch_experts > solve.batch_experts
    one = hessian_bytes(cfg, torch.device("cuda"), experts=1)
    small = plan.model_copy(update={"gpu_budget_bytes": plan.estimated_peak_gpu_bytes + one,
                                    "components": {**plan.components, "chunk_work": 0}})
    with pytest.raises(ResourceError, match="do not fit"):
        plan_expert_solve(cfg, small, torch.device("cuda"))


@pytest.mark.parametrize("gpu_gib", [139, 80])
def test_k26_at_the_defaults_is_planned_in_expert_groups_on_one_gpu(gpu_gib):
    """K2.6's 85 GB of statistics per MoE layer do not fit beside calibrate on an H200 or an 80 GB GPU at 512 x 2048:
    the plan takes the experts in groups instead of refusing (the issue: never an OOM or a refusal at the defaults)."""
    cfg = _k26()
    plan = plan_memory(cfg, stage="calibrate", device=torch.device("cuda"), dtype=torch.bfloat16,
                       tokens=512 * 2048, seq_len=2048, streams=1, sources=1, gpu_memory=gpu_gib * 2**30,
                       host_memory=1800 * 2**30, default_chunk_tokens=65536,
                       reserve_bytes=method_reserve_bytes(cfg, torch.device("cuda")))
    solve = plan_expert_solve(cfg, plan, torch.device("cuda"))
    assert 1 < solve.groups and solve.group_experts * solve.groups >= 384 > solve.group_experts * (solve.groups - 1)
    assert plan.estimated_peak_gpu_bytes + solve.hessian_bytes <= plan.gpu_budget_bytes  # a group's rerun pass
    between_passes = plan.estimated_peak_gpu_bytes - plan.components["chunk_work"]  # the solve: chunks freed
    assert between_passes + solve.hessian_bytes + solve.batch_experts * solve.solve_bytes_per_expert \
        <= plan.gpu_budget_bytes
    assert 1 <= solve.batch_experts <= solve.group_experts


def test_expert_groups_give_the_bytes_of_one_pass(demo_converted, tmp_path, monkeypatch, stage_device):
    """Statistics taken a group of experts at a time (each later group from a statistics-only rerun of the MoE over
    the same post-attention states) solve to the same shards as one pass: 16 demo experts in groups of 5."""
    import kimi_nvfp4.calibrate.memory as calibrate_memory

    one, grouped = tmp_path / "one", tmp_path / "grouped"
    shutil.copytree(demo_converted, one)
    shutil.copytree(demo_converted, grouped)
    options = {**DEMO, "device": stage_device}
    calibrate_checkpoint(one, DEMO_CHECKPOINT, "sample", method="gptq", **options)
    planned = []

    def in_groups_of_five(*args, **kwargs):
        solve = plan_expert_solve(*args, **kwargs)
        planned.append(solve.model_copy(update={"group_experts": 5, "groups": 4}))
        return planned[-1]

    monkeypatch.setattr(calibrate_memory, "plan_expert_solve", in_groups_of_five)
    calibrate_checkpoint(grouped, DEMO_CHECKPOINT, "sample", method="gptq", **options)
    assert planned and _shards(grouped) == _shards(one)
    record = load_manifest(grouped).stages["calibrate"].outputs["fused_method"]
    assert record["group_experts"] == 5
