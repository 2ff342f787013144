"""publish refuses a checkpoint whose validate verdict predates the requantization, and accepts a fresh one that
covers the requantized shards' hashes (real stages: convert -> calibrate --expert-stats -> validate -> requantize)."""

from __future__ import annotations

import re

import pytest

from kimi_nvfp4.checkpoint.layout import parse_expert_name
from kimi_nvfp4.checkpoint.manifest import load_manifest, save_manifest
from kimi_nvfp4.checkpoint.reader import CheckpointReader
from kimi_nvfp4.checkpoint.verdict import VERDICT_KEY, ValidateVerdict
from kimi_nvfp4.errors import GateFailure
from kimi_nvfp4.publish import check_publishable
from kimi_nvfp4.requantize import requantize_checkpoint
from kimi_nvfp4.validate import DEFAULT_GATES, validate_checkpoint


def _validate(src, out):
    gates = DEFAULT_GATES.model_copy(deep=True)
    gates.w4a4.top1_min = gates.w4a16.top1_min = 0.5  # an untrained model's top-1 is a coin toss (tests/validate)
    gates.weight_exact_fraction_min = 0.0  # requantized codes move off the E2M1-exact INT4 values by design
    report = validate_checkpoint(out, src, "sample", report_dir=out / "reports", gates=gates, samples=2,
                                 seq_len=32, device="cpu", progress=False)
    assert report.passed, report.failed_gates()


def test_publish_refuses_a_verdict_older_than_the_requantization(calibrated_pair):
    src, out = calibrated_pair
    _validate(src, out)
    assert check_publishable(out, progress=False).validation_passed is True
    sealed = load_manifest(out).stages["validate"]

    requantize_checkpoint(out, src, method="gptq", device="cpu", recalibrate=False, progress=False)
    with pytest.raises(GateFailure, match="validate has not run"):
        check_publishable(out, progress=False)
    # The old record put back (by hand, or a tool that keeps stale records): the expert shards' digests differ.
    manifest = load_manifest(out)
    manifest.stages["validate"] = sealed
    save_manifest(out, manifest)
    expert_shards = sorted({f for n, f in CheckpointReader(out).weight_map.items()
                            if (p := parse_expert_name(n)) is not None and p.suffix == "weight"})
    with pytest.raises(GateFailure, match=f"stale: shard\\(s\\) changed since validate judged them: "
                                          f"{re.escape(', '.join(expert_shards))};"):
        check_publishable(out, progress=False)

    _validate(src, out)  # a new verdict, sealed over the requantized bytes
    manifest = load_manifest(out)
    verdict = ValidateVerdict.model_validate(manifest.stages["validate"].outputs[VERDICT_KEY])
    assert all(verdict.shards[f] == manifest.shards[f].sha256 != sealed.outputs[VERDICT_KEY]["shards"][f]
               for f in expert_shards)
    assert check_publishable(out, progress=False).validation_passed is True
