"""convert --shared-experts nvfp4 -> calibrate -> validate on the bundled demo model (CPU): the shared experts get
calibrated input scales (gate_proj and up_proj equal: SGLang fuses them) and every validate gate passes."""

from __future__ import annotations

import pytest
import torch

from kimi_nvfp4.calibrate import calibrate_checkpoint
from kimi_nvfp4.checkpoint.modelopt_config import ActivationScheme, declared_scheme
from kimi_nvfp4.checkpoint.reader import CheckpointReader
from kimi_nvfp4.convert import convert_checkpoint
from kimi_nvfp4.demo_model import DEMO_CHECKPOINT
from kimi_nvfp4.validate import validate_checkpoint


@pytest.mark.slow
def test_demo_model_with_nvfp4_shared_experts_calibrates_and_validates(tmp_path):
    out = tmp_path / "nvfp4"
    convert_checkpoint(DEMO_CHECKPOINT, out, device="cpu", progress=False, shared_experts="nvfp4")
    calibrate_checkpoint(out, DEMO_CHECKPOINT, "sample", samples=4, seq_len=128, device="cpu", progress=False)
    assert declared_scheme(out) is ActivationScheme.W4A4
    reader = CheckpointReader(out)
    layout = reader.layout
    for layer in layout.text.moe_layers:
        module = f"{layout.layer_prefix(layer)}mlp.shared_experts"
        assert reader.info(f"{module}.down_proj.weight").dtype == torch.uint8
        scales = {p: reader.load(f"{module}.{p}.input_scale") for p in ("gate_proj", "up_proj", "down_proj")}
        assert all(s.dtype == torch.float32 and s.ndim == 0 and s.item() > 0 for s in scales.values())
        assert torch.equal(scales["gate_proj"], scales["up_proj"])
    report = validate_checkpoint(out, DEMO_CHECKPOINT, "sample", report_dir=tmp_path / "report", samples=4,
                                 seq_len=128, device="cpu", progress=False)
    assert report.passed, [g for g in report.gates if not g.passed]
    assert {e.mode for e in report.end_to_end} == {"w4a4", "w4a16"}
