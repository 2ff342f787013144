"""Per-layer peak memory in calibrate's and validate's reports (stage_kit/layer_memory.py): the process's peak RSS
so far per layer everywhere, the GPU's peak allocated bytes per layer on CUDA only."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from kimi_nvfp4.calibrate import calibrate_checkpoint
from kimi_nvfp4.calibrate.report import CalibrationReport
from kimi_nvfp4.convert.api import convert_checkpoint
from kimi_nvfp4.stage_kit.layer_memory import LayerMemory, host_peak_rss_bytes, peak_allocated, reset_peak
from kimi_nvfp4.synth import create_synthetic_checkpoint
from kimi_nvfp4.validate import validate_checkpoint
from kimi_nvfp4.validate.report import ValidationReport

OPTIONS = dict(samples=4, seq_len=48, progress=False)
LAYERS = 3  # the tiny preset's


@pytest.fixture(scope="module")
def _converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("layer_memory")
    src = create_synthetic_checkpoint(root / "src", preset="tiny", shards=2)
    out = root / "out"
    convert_checkpoint(src, out, device="cpu", progress=False)
    return src, out


@pytest.fixture
def pair(_converted, tmp_path):
    src, out = _converted
    shutil.copytree(out, tmp_path / "out")
    return src, tmp_path / "out"


def _check(memory: LayerMemory, device: str) -> None:
    assert len(memory.host_peak_rss_bytes) == LAYERS
    assert all(isinstance(b, int) and b > 0 for b in memory.host_peak_rss_bytes)
    # a running maximum: never decreases from layer to layer
    assert memory.host_peak_rss_bytes == sorted(memory.host_peak_rss_bytes)
    if device == "cpu":
        assert memory.gpu_peak_bytes is None
    else:
        assert memory.gpu_peak_bytes is not None and len(memory.gpu_peak_bytes) == LAYERS
        assert all(b > 0 for b in memory.gpu_peak_bytes)


def test_host_peak_rss_is_bytes():
    assert host_peak_rss_bytes() > 10 * 2**20  # a Python process with torch holds far more than 10 MiB


def test_calibrate_and_validate_reports_carry_per_layer_memory(pair, tmp_path, stage_device):
    src, out = pair
    cal = calibrate_checkpoint(out, src, "sample", device=stage_device, **OPTIONS)
    assert len(cal.layer_seconds) == LAYERS and all(s > 0 for s in cal.layer_seconds)
    _check(cal.layer_memory, stage_device)
    written = json.loads((out / "calibration" / "calibration_report.json").read_text())
    assert written["layer_memory"] == cal.layer_memory.model_dump(mode="json")
    assert len(written["layer_seconds"]) == LAYERS
    if stage_device == "cpu":
        assert written["layer_memory"]["gpu_peak_bytes"] is None

    val = validate_checkpoint(out, src, "sample", report_dir=tmp_path / "report", device=stage_device, **OPTIONS)
    assert len(val.layer_seconds) == LAYERS
    _check(val.layer_memory, stage_device)
    written = json.loads((tmp_path / "report" / "validate_report.json").read_text())
    assert written["layer_memory"] == val.layer_memory.model_dump(mode="json")


def test_reports_written_before_the_fields_still_load(pair, tmp_path):
    src, out = pair
    cal = calibrate_checkpoint(out, src, "sample", device="cpu", **OPTIONS)
    val = validate_checkpoint(out, src, "sample", report_dir=tmp_path / "report", device="cpu", **OPTIONS)
    for model, report in ((CalibrationReport, cal), (ValidationReport, val)):
        old = report.model_dump(mode="json")
        del old["layer_seconds"], old["layer_memory"]
        loaded = model.model_validate(old)
        assert loaded.layer_seconds == [] and loaded.layer_memory is None


@pytest.mark.gpu
def test_gpu_peaks_are_per_layer_and_the_run_peak_survives(pair, cuda_device):
    """On CUDA each layer's peak is positive, and the run's peak read through `peak_allocated` after the stage is
    at least every layer's (the per-layer resets do not hide it)."""
    src, out = pair
    torch.cuda.synchronize(cuda_device)
    reset_peak(cuda_device)
    cal = calibrate_checkpoint(out, src, "sample", device="cuda", **OPTIONS)
    _check(cal.layer_memory, "cuda")
    assert peak_allocated(cuda_device) >= max(cal.layer_memory.gpu_peak_bytes)
