"""The real stages end to end on a tiny synthetic K2.6 checkpoint: run, resume, a failing gate, the CLI.

One output folder is carried through the steps (each depends on the previous), so the whole pipeline runs once.
The synthetic model is random, so validate's default gates (tuned on the trained demo model) are loosened where
a random model cannot meet them; a later step tightens one gate to make validate fail on purpose.
"""

from __future__ import annotations

import json

import pytest

from kimi_nvfp4.checkpoint.manifest import load_manifest
from kimi_nvfp4.cli import main
from kimi_nvfp4.pipeline import StageStatus, pipeline_config_from_dict, run_pipeline

# A random model has no consistent next token, and random INT4 codes are less often E2M1-exact than real ones.
RANDOM_MODEL_GATES = ["weight_exact_fraction_min=0", "w4a4.top1_min=0"]
CONFIG = {
    "device": "cpu",
    "calibrate": {"samples": 4, "seq_len": 64, "dtype": "float32"},
    "validate": {"samples": 2, "seq_len": 64, "modes": ["w4a4"], "gate_overrides": RANDOM_MODEL_GATES},
    "serve_check": {"enabled": True, "reference": True, "quick": True,
                    "load": {"concurrency": [1, 2], "turns": 2},
                    "quality": {"humaneval_limit": 1, "tool_call_limit": 1, "agreement_limit": 1}},
    "publish": {"enabled": True, "dry_run": True, "repo_id": "me/tiny-k2-nvfp4"},
}
TOML = """
device = "cpu"
[calibrate]
samples = 4
seq_len = 64
[validate]
samples = 2
seq_len = 64
modes = ["w4a4"]
gate_overrides = ["weight_exact_fraction_min=0", "w4a4.top1_min=0"]
[serve_check]
enabled = true
reference = true
quick = true
load = { concurrency = [1, 2], turns = 2 }
quality = { humaneval_limit = 1, tool_call_limit = 1, agreement_limit = 1 }
[publish]
enabled = true
dry_run = true
repo_id = "me/tiny-k2-nvfp4"
"""


def _run_cli(argv: list[str]) -> int:
    try:
        main(argv)
    except SystemExit as e:
        return int(e.code or 0)
    return 0


@pytest.mark.slow  # ~20 s of CPU; minutes of wall time on a busy machine
def test_pipeline_runs_resumes_and_stops_at_a_failed_gate(tiny_int4_checkpoint, tmp_path, capsys):
    out = tmp_path / "nvfp4"
    config = pipeline_config_from_dict(CONFIG)

    # 1. everything runs and passes
    first = run_pipeline(tiny_int4_checkpoint, out, config, progress=False)
    assert first.exit_code == 0, first.to_table()
    assert first.result("requantize").status is StageStatus.DISABLED  # off unless [requantize] enabled
    assert [s.status for s in first.stages if s.name != "requantize"] == [StageStatus.RAN] * 5
    manifest = load_manifest(out)
    assert manifest.complete and {"calibrate", "validate", "serve_check"} <= set(manifest.stages)
    assert manifest.stages["validate"].outputs["passed"] is True
    assert manifest.stages["calibrate"].settings["dtype"] == "float32"  # [calibrate] dtype reached the stage
    reports = out / "reports"
    for name in ("validate_report.json", "serve_check.json", "serve_check.png", "model_card_preview.md",
                 "pipeline_summary.json", "pipeline_summary.md"):
        assert (reports / name).is_file(), name
    card = (reports / "model_card_preview.md").read_text()
    assert "## Validation" in card and "All gates passed" in card and "reference emulator" in card
    assert "NVFP4 W4A4" in card  # calibrated experts carry input_scale

    # 2. the same settings again: every stage but the (always shown) publish dry run is skipped
    second = run_pipeline(tiny_int4_checkpoint, out, config, progress=False)
    assert [s.status for s in second.stages if s.name != "requantize"][:4] == [StageStatus.SKIPPED] * 4
    assert second.result("publish").status is StageStatus.RAN and second.exit_code == 0

    # 3. a stricter gate: validate re-runs and fails; serve-check and publish do not run; exit 1
    strict = json.loads(json.dumps(CONFIG))
    strict["validate"]["gate_overrides"] = RANDOM_MODEL_GATES[1:] + ["weight_exact_fraction_min=1.0"]
    third = run_pipeline(tiny_int4_checkpoint, out, pipeline_config_from_dict(strict), progress=False)
    assert third.result("calibrate").status is StageStatus.SKIPPED
    assert third.result("validate").status is StageStatus.FAILED
    assert "weights.exact_fraction" in third.result("validate").summary
    assert third.result("serve_check").status is StageStatus.NOT_RUN
    assert third.result("publish").status is StageStatus.NOT_RUN
    assert third.exit_code == 1

    # 4. the CLI over the original settings: validate runs again (its last run failed), the rest resumes
    config_file = tmp_path / "pipeline.toml"
    config_file.write_text(TOML)
    capsys.readouterr()
    assert _run_cli(["run", str(tiny_int4_checkpoint), str(out), "--config", str(config_file), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "validate     ran" in printed and "convert      skipped" in printed and "pipeline OK" in printed
