"""A checkpoint with NaN weights fails validate's gates and still gets its full report (figures included)."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file, save_file

from kimi_nvfp4.checkpoint.reader import CheckpointReader
from kimi_nvfp4.validate import validate_checkpoint


def test_nan_weights_fail_finite_and_the_report_is_still_written(calibrated_pair, tmp_path):
    src, out = calibrated_pair
    reader = CheckpointReader(out)
    name = f"{reader.layout.layer_prefix(1)}self_attn.o_proj.weight"
    shard = out / reader.weight_map[name]
    tensors = load_file(str(shard))
    tensors[name] = torch.full_like(tensors[name], float("nan"))
    save_file(tensors, str(shard), metadata={"format": "pt"})
    report_dir = tmp_path / "r"
    report = validate_checkpoint(out, src, "sample", report_dir=report_dir, samples=2, seq_len=32, device="cpu",
                                 progress=False, record_in_manifest=False)
    failed = {g.name for g in report.failed_gates()}
    assert "structure.finite" in failed and not report.passed
    for png in ("kl_histogram.png", "layer_drift.png", "worst_experts.png"):
        assert (report_dir / png).stat().st_size > 0
    assert json.loads((report_dir / "validate_report.json").read_text())["passed"] is False
