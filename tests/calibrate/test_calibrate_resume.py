"""A killed calibration resumes from its last snapshot (calibrate/resume.py, stage_kit/resume.py): the same input
scales byte for byte and the same report, without running the finished layers again."""

from __future__ import annotations

import json
import logging
import shutil
from collections import Counter

import pytest

from kimi_nvfp4.calibrate import INPUT_SCALES_SHARD, calibrate_checkpoint
from kimi_nvfp4.errors import OutputError
from kimi_nvfp4.model import weights as model_weights
from kimi_nvfp4.stage_kit import resume as resume_module
from kimi_nvfp4.stage_kit.resume import RECORD_NAME, RESUME_DIR

# snapshots on every layer whatever the tiny model's layers cost next to a snapshot's fsync (the cap has its own tests)
NO_OVERHEAD_CAP = 1e6
OPTIONS = dict(samples=4, seq_len=48, device="cpu", progress=False, resume_every=1, expert_stats="diag",
               resume_max_overhead=NO_OVERHEAD_CAP)
INJECTED = "injected failure"
FAIL_AT = 2  # the tiny model has 3 layers: killed while loading the last one, after snapshots of layers 0 and 1


@pytest.fixture
def loads(monkeypatch):
    """Counts layer loads; `loads.fail_at = L` makes the load of layer L raise (a killed run)."""
    seen = Counter()
    real = model_weights._CheckpointWeights.layer

    def counting(source, i, *args, **kwargs):
        seen[i] += 1
        if i == getattr(seen, "fail_at", None):
            raise RuntimeError(INJECTED)
        return real(source, i, *args, **kwargs)

    monkeypatch.setattr(model_weights._CheckpointWeights, "layer", counting)
    return seen


def _killed(out, src, loads, **options):
    loads.fail_at = FAIL_AT
    with pytest.raises(RuntimeError, match=INJECTED):
        calibrate_checkpoint(out, src, "sample", **{**OPTIONS, **options})
    loads.fail_at = None
    loads.clear()


def _numbers(report) -> dict:
    data = report.model_dump(mode="json")
    # the memory plan records the free memory of its moment, like the wall time and the per-layer costs
    for key in ("seconds", "checkpoint", "memory_plan", "layer_seconds", "layer_memory"):
        data.pop(key)
    return data


def test_a_killed_calibration_resumes_after_the_last_snapshot(converted_pair, tmp_path, loads, stage_device):
    src, out = converted_pair
    fresh = tmp_path / "fresh"
    shutil.copytree(out, fresh)
    options = {**OPTIONS, "device": stage_device}  # CUDA: snapshots written from and loaded back onto the GPU
    expected = calibrate_checkpoint(fresh, src, "sample", **options)
    assert not (fresh / RESUME_DIR).exists()  # removed once the stage succeeded
    loads.clear()

    _killed(out, src, loads, device=stage_device)
    record = json.loads((out / RESUME_DIR / "calibrate" / RECORD_NAME).read_text())
    assert record["layer"] == FAIL_AT - 1 and record["world_size"] == 1
    assert not (out / INPUT_SCALES_SHARD).exists()  # nothing of the stage's output was written

    resumed = calibrate_checkpoint(out, src, "sample", **options)
    assert loads == Counter({FAIL_AT: 1})  # layers 0 and 1 came from the snapshot
    assert (out / INPUT_SCALES_SHARD).read_bytes() == (fresh / INPUT_SCALES_SHARD).read_bytes()
    assert _numbers(resumed) == _numbers(expected)
    # the per-layer seconds and peaks of the layers run before the kill came through the snapshot
    assert len(resumed.layer_seconds) == len(resumed.layer_memory.host_peak_rss_bytes) == len(resumed.layers)
    assert (resumed.layer_memory.gpu_peak_bytes is None) == (stage_device == "cpu")
    manifest = json.loads((out / "kimi_nvfp4_manifest.json").read_text())
    expected_manifest = json.loads((fresh / "kimi_nvfp4_manifest.json").read_text())
    stats = manifest["stages"]["calibrate"]["outputs"]["expert_stats"]
    assert stats == expected_manifest["stages"]["calibrate"]["outputs"]["expert_stats"]  # files of every layer
    assert not (out / RESUME_DIR).exists()


def test_a_changed_option_ignores_the_snapshot(converted_pair, loads, caplog):
    src, out = converted_pair
    _killed(out, src, loads)
    with caplog.at_level(logging.WARNING, logger=resume_module.__name__):
        calibrate_checkpoint(out, src, "sample", **{**OPTIONS, "min_expert_tokens": 7})
    assert loads == Counter({0: 1, 1: 1, 2: 1})  # from layer 0
    assert "resume snapshot ignored" in caplog.text and "min_expert_tokens" in caplog.text
    assert not (out / RESUME_DIR).exists()


def test_resume_every_sets_which_layers_are_snapshotted(converted_pair, loads):
    src, out = converted_pair
    _killed(out, src, loads, resume_every=2)  # layers 0-1 done: the one snapshot is after layer 1
    assert json.loads((out / RESUME_DIR / "calibrate" / RECORD_NAME).read_text())["layer"] == 1
    shutil.rmtree(out / RESUME_DIR)
    _killed(out, src, loads, resume_every=0)
    assert not (out / RESUME_DIR).exists()


def test_a_snapshot_that_cannot_be_written_does_not_stop_the_run(converted_pair, tmp_path, monkeypatch, caplog):
    src, out = converted_pair
    fresh = tmp_path / "fresh"
    shutil.copytree(out, fresh)
    calibrate_checkpoint(fresh, src, "sample", **{**OPTIONS, "resume_every": 0})

    def full_disk(*args, **kwargs):
        raise OutputError("file x: disk full while writing")

    monkeypatch.setattr(resume_module, "StreamingShardWriter", full_disk)  # the snapshots' writer only
    with caplog.at_level(logging.WARNING, logger=resume_module.__name__):
        calibrate_checkpoint(out, src, "sample", **OPTIONS)
    assert "cannot write the resume snapshot after layer 0" in caplog.text
    assert caplog.text.count("cannot write") == 1  # no further attempts
    assert (out / INPUT_SCALES_SHARD).read_bytes() == (fresh / INPUT_SCALES_SHARD).read_bytes()


def test_the_command_takes_resume_every(converted_pair, loads):
    from click.testing import CliRunner

    from kimi_nvfp4.calibrate.cli import calibrate_command

    src, out = converted_pair
    args = [str(out), "--source", str(src), "--data", "sample", "--samples", "4", "--seq-len", "48", "--device", "cpu",
            "--no-progress", "--resume-every", "1", "--resume-max-overhead", str(NO_OVERHEAD_CAP)]
    loads.fail_at = FAIL_AT
    killed = CliRunner().invoke(calibrate_command, args)
    assert killed.exit_code != 0 and (out / RESUME_DIR / "calibrate" / RECORD_NAME).is_file()
    loads.fail_at = None
    loads.clear()
    resumed = CliRunner().invoke(calibrate_command, args)
    assert resumed.exit_code == 0, resumed.output
    assert loads == Counter({FAIL_AT: 1}) and not (out / RESUME_DIR).exists()
