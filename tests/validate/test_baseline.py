"""The amax baseline stream and its gates (validate/baseline.py)."""

from __future__ import annotations

import torch

from kimi_nvfp4.checkpoint.reader import CheckpointReader
from kimi_nvfp4.convert.api import convert_checkpoint
from kimi_nvfp4.model import Int4SourceWeights, NVFP4Weights
from kimi_nvfp4.validate.api import validate_checkpoint
from kimi_nvfp4.validate.baseline import BASELINE_MIN_TOKENS, BASELINE_MODE, baseline_enabled, baseline_layer
from kimi_nvfp4.validate.corruptions import flip_nibble_order


def _moe_layer(reader: CheckpointReader) -> int:
    cfg = reader.layout.text
    return next(i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i))


def test_baseline_experts_are_the_amax_conversion(calibrated_pair, tmp_path):
    src, out = calibrated_pair
    amax_out = tmp_path / "amax"
    convert_checkpoint(src, amax_out, device="cpu", progress=False, method="amax")
    reader = CheckpointReader(out)
    layer = _moe_layer(reader)
    w_ref = Int4SourceWeights(CheckpointReader(src)).layer(layer, "cpu")
    w_nv = NVFP4Weights(reader, activations="w4a16").layer(layer, "cpu")
    w_amax = NVFP4Weights(CheckpointReader(amax_out), activations="w4a16").layer(layer, "cpu")
    base = baseline_layer(w_ref, w_nv)
    assert base.self_attn is w_nv.self_attn  # only the routed experts are replaced
    for mine, theirs in zip(base.mlp.experts, w_amax.mlp.experts):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            a, b = getattr(mine, proj), getattr(theirs, proj)
            assert a.mode is BASELINE_MODE
            assert torch.equal(a.tensor.weight, b.tensor.weight)
            assert torch.equal(a.tensor.weight_scale.view(torch.uint8), b.tensor.weight_scale.view(torch.uint8))
            assert torch.equal(a.tensor.weight_scale_2, b.tensor.weight_scale_2)


def _validate(src, out, report):
    return validate_checkpoint(out, src, "sample", report_dir=report, samples=3, seq_len=48, device="cpu",
                               progress=False, record_in_manifest=False, baseline=True)


def test_a_correct_checkpoint_passes_and_a_broken_expert_fails_the_baseline_gates(calibrated_pair, tmp_path):
    src, out = calibrated_pair
    good = _validate(src, out, tmp_path / "good")
    names = {g.name: g for g in good.gates}
    assert good.baseline is not None and good.baseline.kl_mean > 0
    assert names["baseline.kl_mean_ratio"].passed and names["baseline.drift_ratio_max"].passed
    assert all(l.baseline_drift is not None for l in good.layers if l.layer > 0)

    flip_nibble_order(out)
    bad = _validate(src, out, tmp_path / "bad")
    failed = {g.name for g in bad.failed_gates()}
    assert {"baseline.kl_mean_ratio", "baseline.drift_ratio_max"} & failed


def test_no_baseline_means_no_baseline_gates(calibrated_pair, tmp_path):
    src, out = calibrated_pair
    report = validate_checkpoint(out, src, "sample", report_dir=tmp_path / "r", samples=2, seq_len=32,
                                 device="cpu", progress=False, record_in_manifest=False, baseline=False)
    assert report.baseline is None
    assert not [g for g in report.gates if g.name.startswith("baseline.")]


def test_auto_runs_the_baseline_only_on_enough_tokens():
    assert baseline_enabled("auto", BASELINE_MIN_TOKENS) and not baseline_enabled("auto", BASELINE_MIN_TOKENS - 1)
    assert baseline_enabled("on", 1) and not baseline_enabled("off", 10**9)
