"""Validate must be able to fail: five ways of breaking a converted checkpoint, each caught and named."""

from __future__ import annotations

import pytest

from kimi_nvfp4.validate import DEFAULT_GATES, validate_checkpoint
from kimi_nvfp4.validate.corruptions import CORRUPTIONS

# The synthetic tiny model is untrained: its next-token distributions are nearly flat, so top-1
# agreement there is a coin toss between near-ties. Every other threshold is the shipped default.
SYNTHETIC_GATES = DEFAULT_GATES.model_copy(deep=True)
SYNTHETIC_GATES.w4a4.top1_min = SYNTHETIC_GATES.w4a16.top1_min = 0.5


def _validate(src, out, tmp_path, modes=("w4a4",)):
    return validate_checkpoint(
        out,
        src,
        "sample",
        report_dir=tmp_path / "report",
        gates=SYNTHETIC_GATES,
        modes=modes,
        samples=2,
        seq_len=32,
        device="cpu",
        progress=False,
    )


def _failed(report) -> dict[str, str]:
    return {g.name: g.detail for g in report.gates if not g.passed}


def test_clean_checkpoint_passes_every_gate(calibrated_pair, tmp_path):
    src, out = calibrated_pair
    report = _validate(src, out, tmp_path, modes=("w4a4", "w4a16"))
    assert report.passed, _failed(report)
    assert {e.mode for e in report.end_to_end} == {"w4a4", "w4a16"}
    md = (tmp_path / "report" / "validate_report.md").read_text()
    assert md.startswith("# Validation report: PASSED")
    for png in ("layer_drift.png", "kl_histogram.png", "worst_experts.png"):
        assert (tmp_path / "report" / png).stat().st_size > 0


@pytest.mark.parametrize("name", sorted(CORRUPTIONS))
def test_each_corruption_fails_naming_the_reason(name, calibrated_pair, tmp_path):
    src, out = calibrated_pair
    corruption = CORRUPTIONS[name]
    broken = corruption.apply(out, src) if corruption.needs_source else corruption.apply(out)
    report = _validate(src, out, tmp_path, modes=("w4a4", "w4a16"))
    failed = _failed(report)
    assert not report.passed
    for gate in corruption.must_fail:
        assert gate in failed, f"{name}: expected {gate} to fail, failed: {sorted(failed)}"
        assert broken in failed[gate], f"{name}: {gate} does not name {broken}: {failed[gate]}"
    md = (tmp_path / "report" / "validate_report.md").read_text()
    assert "FAILED" in md.splitlines()[0] and corruption.must_fail[0] in md
    if name == "drop-input-scale":  # W4A16 needs no input scale and still runs
        assert not any(k.startswith("w4a16.") for k in failed) and "w4a4" in report.mode_errors
