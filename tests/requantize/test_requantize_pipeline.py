"""`kimi-nvfp4 run` with `[requantize] enabled`: calibrate records the statistics the method needs, requantize runs
after it, validate judges the requantized bytes, and a second run resumes everything."""

from __future__ import annotations

from pathlib import Path

import pytest

from kimi_nvfp4.checkpoint.manifest import load_manifest
from kimi_nvfp4.checkpoint.verdict import VERDICT_KEY
from kimi_nvfp4.pipeline import StageContext, StageStatus, pipeline_config_from_dict, run_pipeline
from kimi_nvfp4.calibrate.stage import CalibrateStage
from kimi_nvfp4.registry import pipeline_stages

RANDOM_MODEL_GATES = ["weight_exact_fraction_min=0", "w4a4.top1_min=0"]  # tests/pipeline/test_pipeline_e2e.py
CONFIG = {
    "device": "cpu",
    "calibrate": {"samples": 4, "seq_len": 48, "data": "sample"},
    "requantize": {"enabled": True, "method": "gptq"},
    "validate": {"samples": 2, "seq_len": 32, "modes": ["w4a4"], "gate_overrides": RANDOM_MODEL_GATES},
}


def test_requantize_is_a_stage_after_calibrate():
    names = [stage.name for stage in pipeline_stages()]
    assert names.index("calibrate") + 1 == names.index("requantize") < names.index("validate")


@pytest.mark.parametrize(
    "requantize, calibrate, wanted",
    [({}, {}, None), ({"enabled": True, "method": "act-diag"}, {}, "diag"),
     ({"enabled": True, "method": "gptq"}, {}, "hessian"),
     ({"enabled": True, "method": "gptq-w4a4"}, {}, "w4a4"),
     ({"enabled": True, "method": "gptq-w4a4-diag"}, {}, "w4a4"),
     ({"enabled": True, "method": "act-diag"}, {"expert_stats": "hessian"}, "hessian"),
     ({"enabled": False, "method": "gptq"}, {}, None)],
    ids=["off", "act-diag", "gptq", "gptq-w4a4", "gptq-w4a4-diag", "explicit", "disabled"],
)
def test_calibrate_records_the_statistics_the_requantize_method_needs(requantize, calibrate, wanted):
    config = pipeline_config_from_dict({"requantize": requantize, "calibrate": calibrate})
    ctx = StageContext(Path("src"), Path("out"), config, Path("out/reports"), progress=False)
    assert CalibrateStage().settings(ctx).get("expert_stats") == wanted


@pytest.mark.slow  # the real stages on a tiny model: ~1 min of CPU
def test_run_calibrates_with_statistics_then_requantizes_then_validates(tmp_path, _calibrated_master):
    src, _ = _calibrated_master
    out = tmp_path / "nvfp4"
    config = pipeline_config_from_dict(CONFIG)
    first = run_pipeline(src, out, config, progress=False)
    assert first.exit_code == 0, first.to_table()
    for name in ("convert", "calibrate", "requantize", "validate"):
        assert first.result(name).status is StageStatus.RAN, name
    manifest = load_manifest(out)
    assert manifest.stages["calibrate"].settings["expert_stats"] == "hessian"
    assert manifest.stages["requantize"].complete and manifest.stages["requantize"].outputs["recalibrated"]
    verdict = manifest.stages["validate"].outputs[VERDICT_KEY]
    assert verdict["shards"] == {f: r.sha256 for f, r in manifest.shards.items()}  # the requantized bytes

    second = run_pipeline(src, out, config, progress=False)
    for name in ("convert", "calibrate", "requantize", "validate"):
        assert second.result(name).status is StageStatus.SKIPPED, name
