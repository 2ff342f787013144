"""Names of the files kimi-nvfp4 itself writes into a checkpoint folder (its own artifacts).

convert never copies a source file by one of these names: a source that carries a `reports/validate_report.json`
with `"passed": true`, a manifest or an input-scales shard must not hand our later stages a record we never wrote.
Each name is the stage's own constant (tests/checkpoint/test_artifacts.py holds the two lists together); they are
spelled out here so that this module imports no stage.
"""

from __future__ import annotations

from pathlib import PurePath

# Files written by convert, calibrate, validate, the pipeline and publish (kimi_nvfp4_manifest.json: manifest.py;
# model-input-scales.safetensors: calibrate/shard.py; reports: calibrate/report.py, validate/report.py,
# serve_check/report.py, pipeline/summary.py, publish/stage.py's card preview).
OWN_FILE_NAMES = frozenset({
    "kimi_nvfp4_manifest.json",
    "model-input-scales.safetensors",
    "calibration_report.json",
    "calibration_report.md",
    "validate_report.json",
    "validate_report.md",
    "serve_check.json",
    "serve_check.md",
    "pipeline_summary.json",
    "pipeline_summary.md",
    "model_card_preview.md",
})
# Report folders the stages create at the top of the output (`reports`: run/demo and publish's default;
# `calibration`: calibrate's default report folder).
OWN_TOP_LEVEL_DIRS = frozenset({"reports", "calibration"})


def is_own_artifact(relative: PurePath) -> bool:
    """True for a path (relative to a checkpoint folder) that only kimi-nvfp4 may write."""
    parts = relative.parts
    return bool(parts) and (relative.name in OWN_FILE_NAMES or (len(parts) > 1 and parts[0] in OWN_TOP_LEVEL_DIRS))
