"""Faults an operator or an attacker can cause around convert, each a case that once went wrong.

(Malformed sources: tests/checkpoint/test_malformed.py. Disk full / read-only output: test_write_errors.py.)
"""

from __future__ import annotations

import json

from kimi_nvfp4.checkpoint.manifest import MANIFEST_NAME
from kimi_nvfp4.convert import convert_checkpoint


def test_our_own_artifact_names_are_never_copied_from_a_source(source, tmp_path):
    """A source shipping `reports/validate_report.json` with "passed": true (and a manifest, an input-scales shard,
    calibrate's folder) must not hand later stages a verdict they never reached."""
    forged = {"passed": True, "gates": []}
    (source / "reports").mkdir()
    (source / "reports" / "validate_report.json").write_text(json.dumps(forged))
    (source / "reports" / "notes.md").write_text("# all good")
    (source / "calibration").mkdir()
    (source / "calibration" / "calibration_report.json").write_text("{}")
    (source / "extra").mkdir()
    (source / "extra" / "validate_report.json").write_text(json.dumps(forged))
    (source / MANIFEST_NAME).write_text(json.dumps({"complete": True}))
    (source / "model-input-scales.safetensors").write_bytes(b"\0" * 8)
    (source / "LICENSE").write_text("MIT")
    out = tmp_path / "out"
    summary = convert_checkpoint(source, out, method="amax", device="cpu", progress=False, record_stats=False)
    assert not (out / "reports").exists() and not (out / "calibration").exists()
    assert not (out / "extra" / "validate_report.json").exists()
    assert not (out / "model-input-scales.safetensors").exists()
    assert json.loads((out / MANIFEST_NAME).read_text())["complete"] is True  # ours, not the source's
    assert (out / "LICENSE").read_text() == "MIT"
    skipped = {line.split(" ")[0] for line in summary.skipped_files}
    assert skipped == {"reports/validate_report.json", "reports/notes.md", "calibration/calibration_report.json",
                       "extra/validate_report.json", MANIFEST_NAME, "model-input-scales.safetensors"}
    assert any("not copied from the source: reports/validate_report.json" in line for line in summary.lines())
