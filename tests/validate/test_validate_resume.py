"""A killed validation resumes from its last snapshot (validate/resume.py, stage_kit/resume.py): the same report
numbers, without streaming the finished layers or scanning the structure again."""

from __future__ import annotations

import logging
from collections import Counter

import pytest

from kimi_nvfp4.model import weights as model_weights
from kimi_nvfp4.stage_kit import resume as resume_module
from kimi_nvfp4.stage_kit.resume import RESUME_DIR
from kimi_nvfp4.validate import api as validate_api
from kimi_nvfp4.validate.api import validate_checkpoint

# baseline on: every stream the snapshot carries (INT4, W4A4, W4A16, amax baseline)
# snapshots on every layer whatever the tiny model's layers cost next to a snapshot's fsync (the cap has its own tests)
NO_OVERHEAD_CAP = 1e6
OPTIONS = dict(samples=4, seq_len=48, device="cpu", progress=False, resume_every=1, record_in_manifest=False,
               resume_max_overhead=NO_OVERHEAD_CAP,
               baseline="on")
INJECTED = "injected failure"
FAIL_AT = 2  # the tiny model has 3 layers


@pytest.fixture
def counts(monkeypatch):
    """Layer loads (both checkpoints) and structural scans; `counts.fail_at = L` makes loading layer L raise."""
    seen = Counter()
    load, scan = model_weights._CheckpointWeights.layer, validate_api.check_structure

    def counting_load(source, i, *args, **kwargs):
        seen[i] += 1
        if i == getattr(seen, "fail_at", None):
            raise RuntimeError(INJECTED)
        return load(source, i, *args, **kwargs)

    def counting_scan(*args, **kwargs):
        seen["structure"] += 1
        return scan(*args, **kwargs)

    monkeypatch.setattr(model_weights._CheckpointWeights, "layer", counting_load)
    monkeypatch.setattr(validate_api, "check_structure", counting_scan)
    return seen


def _killed(out, src, report_dir, counts, **options):
    counts.fail_at = FAIL_AT
    with pytest.raises(RuntimeError, match=INJECTED):
        validate_checkpoint(out, src, "sample", report_dir=report_dir, **{**OPTIONS, **options})
    counts.fail_at = None
    counts.clear()


def _numbers(report) -> dict:
    data = report.model_dump(mode="json")
    data.pop("seconds")
    data.pop("memory_plan")  # the free memory of its moment, like the wall time
    data.pop("layer_seconds"), data.pop("layer_memory")
    data["verdict"].pop("sealed_at")
    return data


def test_a_killed_validation_resumes_with_the_same_report(calibrated_pair, tmp_path, counts, stage_device):
    src, out = calibrated_pair
    options = {**OPTIONS, "device": stage_device}  # CUDA: snapshots written from and loaded back onto the GPU
    expected = validate_checkpoint(out, src, "sample", report_dir=tmp_path / "fresh", **options)
    assert not (tmp_path / "fresh" / RESUME_DIR).exists()
    counts.clear()

    report_dir = tmp_path / "report"
    _killed(out, src, report_dir, counts, device=stage_device)
    assert not (report_dir / "validate_report.json").exists()
    resumed = validate_checkpoint(out, src, "sample", report_dir=report_dir, **options)
    assert counts == Counter({FAIL_AT: 2})  # the last layer of each checkpoint, once; no second structural scan
    assert _numbers(resumed) == _numbers(expected)
    # the per-layer seconds and peaks of the layers run before the kill came through the snapshot
    assert len(resumed.layer_seconds) == len(resumed.layer_memory.host_peak_rss_bytes) == len(resumed.layers)
    assert (resumed.layer_memory.gpu_peak_bytes is None) == (stage_device == "cpu")
    assert resumed.baseline is not None and len(resumed.end_to_end) == 2
    assert not (report_dir / RESUME_DIR).exists()


def test_another_mode_list_ignores_the_snapshot(calibrated_pair, tmp_path, counts, caplog):
    src, out = calibrated_pair
    report_dir = tmp_path / "report"
    _killed(out, src, report_dir, counts)
    with caplog.at_level(logging.WARNING, logger=resume_module.__name__):
        validate_checkpoint(out, src, "sample", report_dir=report_dir, **{**OPTIONS, "modes": ["w4a16"]})
    assert counts == Counter({0: 2, 1: 2, 2: 2, "structure": 1})  # from layer 0
    assert "resume snapshot ignored" in caplog.text and "options.modes" in caplog.text
