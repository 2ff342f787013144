"""requantize on a tiny calibrated checkpoint: only routed-expert tensors change, a killed run resumes to the same
bytes, statistics and method are recorded per shard, the input scales are recalibrated, and wrong inputs are
refused with a named error."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

from kimi_nvfp4.calibrate import INPUT_SCALES_SHARD
from kimi_nvfp4.checkpoint.layout import parse_expert_name
from kimi_nvfp4.checkpoint.manifest import StageRecord, load_manifest, save_manifest
from kimi_nvfp4.checkpoint.reader import CheckpointReader
from kimi_nvfp4.checkpoint.writer import sha256_file
from kimi_nvfp4.cli import cli
from kimi_nvfp4.errors import CheckpointError
from kimi_nvfp4.requantize import REQUANTIZE_STAGE, RequantizeRecord, requantize_checkpoint
from kimi_nvfp4.requantize import api as requantize_api

from .conftest import calibrate_tiny, copy_of

NVFP4_SUFFIXES = ("weight", "weight_scale", "weight_scale_2")


def _tensors(path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {n: f.get_tensor(n) for n in f.keys()}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-equal (NaN payloads and signed zeros included)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                     b.reshape(-1).view(torch.uint8))


def _digests(folder) -> dict[str, str]:
    return {p.name: sha256_file(p) for p in sorted(folder.glob("*.safetensors"))}


def _is_expert_nvfp4(name: str) -> bool:
    parsed = parse_expert_name(name)
    return parsed is not None and parsed.suffix in NVFP4_SUFFIXES


def test_only_routed_expert_tensors_are_rewritten(calibrated_pair):
    src, out = calibrated_pair
    before = _digests(out)
    reader = CheckpointReader(out)
    expert_shards = {f for n, f in reader.weight_map.items() if _is_expert_nvfp4(n)}
    other_shards = set(before) - expert_shards
    assert expert_shards and len(other_shards) >= 3  # two shards without experts, and the input scales
    old = {f: _tensors(out / f) for f in expert_shards}

    result = requantize_checkpoint(out, src, method="gptq", device="cpu", recalibrate=False, progress=False)

    after = _digests(out)
    assert sorted(result.shards_rewritten) == sorted(expert_shards) and not result.shards_skipped
    assert {f: after[f] for f in other_shards} == {f: before[f] for f in other_shards}  # byte-identical
    changed = 0
    for f in expert_shards:
        new = _tensors(out / f)
        assert set(new) == set(old[f])
        for name, t in old[f].items():
            assert new[name].dtype == t.dtype and new[name].shape == t.shape, name
            if not _is_expert_nvfp4(name):
                assert _same(new[name], t), name
            else:
                changed += not _same(new[name], t)
    assert changed > 0  # the method did change some experts
    manifest = load_manifest(out)
    for f in expert_shards:
        assert manifest.shards[f].sha256 == after[f]  # publish verifies against these
    record = RequantizeRecord.model_validate(manifest.stages[REQUANTIZE_STAGE].outputs)
    assert manifest.stages[REQUANTIZE_STAGE].complete and record.method == "gptq"
    stats = manifest.stages["calibrate"].outputs["expert_stats"]["files"]
    for f in expert_shards:
        entry = record.shards[f]
        assert entry.sha256 == after[f] and entry.method == "gptq"
        assert entry.statistics and all(stats[p.rsplit("/", 1)[1]] == d for p, d in entry.statistics.items())
    assert record.counts()["expert-dense"] > 0


def test_method_options_are_recorded_and_decide_what_a_rerun_reuses(calibrated_pair):
    """`method_options` reach the method (other bytes), are recorded whole per shard and in the stage's settings,
    and a rerun with other options rewrites the shards a rerun with the same options skips."""
    src, out = calibrated_pair
    default = requantize_checkpoint(out, src, method="gptq", device="cpu", recalibrate=False, progress=False)
    default_digests = _digests(out)
    damped = requantize_checkpoint(out, src, method="gptq", method_options={"damping": 0.5}, device="cpu",
                                   recalibrate=False, progress=False)
    assert sorted(damped.shards_rewritten) == sorted(default.shards_rewritten) and not damped.shards_skipped
    assert _digests(out) != default_digests  # the option changed the experts' bytes
    manifest = load_manifest(out)
    record = RequantizeRecord.model_validate(manifest.stages[REQUANTIZE_STAGE].outputs)
    recorded = manifest.stages[REQUANTIZE_STAGE].settings["method_options"]
    assert recorded["damping"] == 0.5 and recorded["damping_retries"] == 4  # the whole typed options
    assert all(entry.method_options == recorded for entry in record.shards.values())
    again = requantize_checkpoint(out, src, method="gptq", method_options={"damping": 0.5}, device="cpu",
                                  recalibrate=False, progress=False)
    assert not again.shards_rewritten and sorted(again.shards_skipped) == sorted(damped.shards_rewritten)


def test_a_killed_run_resumes_to_the_bytes_of_an_uninterrupted_run(calibrated_pair, tmp_path, monkeypatch):
    src, out = calibrated_pair
    straight = copy_of(calibrated_pair, tmp_path / "straight")
    requantize_checkpoint(straight, src, method="gptq", device="cpu", progress=False)

    real = requantize_api.rewrite_shard
    calls = []

    def killed_after_first(*args, **kwargs):
        if calls:
            raise KeyboardInterrupt("killed")
        calls.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(requantize_api, "rewrite_shard", killed_after_first)
    with pytest.raises(KeyboardInterrupt):
        requantize_checkpoint(out, src, method="gptq", device="cpu", progress=False)
    stage = load_manifest(out).stages[REQUANTIZE_STAGE]
    assert not stage.complete and list(RequantizeRecord.model_validate(stage.outputs).shards) == calls
    monkeypatch.setattr(requantize_api, "rewrite_shard", real)

    resumed = requantize_checkpoint(out, src, method="gptq", device="cpu", progress=False)
    assert resumed.shards_skipped == calls and len(resumed.shards_rewritten) == 1
    assert _digests(out) == _digests(straight)  # expert shards and the recalibrated input scales


def test_recalibration_rewrites_the_input_scales_and_keeps_calibrate_complete(calibrated_pair):
    src, out = calibrated_pair
    calibrate_before = load_manifest(out).stages["calibrate"]
    scales_before = _tensors(out / INPUT_SCALES_SHARD)
    manifest = load_manifest(out)
    manifest.stages["validate"] = StageRecord(settings={"samples": 2}, complete=True, outputs={"passed": True})
    save_manifest(out, manifest)

    result = requantize_checkpoint(out, src, method="act-diag", device="cpu", progress=False)

    assert result.recalibrated
    scales_after = _tensors(out / INPUT_SCALES_SHARD)
    assert set(scales_after) == set(scales_before)
    # down_proj reads silu(gate x) * up x of the new gate/up weights: its activation range moves
    down = [n for n in scales_before if n.endswith("down_proj.input_scale")]
    assert any(not torch.equal(scales_after[n], scales_before[n]) for n in down)
    manifest = load_manifest(out)
    calibrate = manifest.stages["calibrate"]
    assert calibrate.complete and calibrate.settings == calibrate_before.settings  # the pipeline still resumes
    assert calibrate.outputs["expert_stats"] == calibrate_before.outputs["expert_stats"]
    assert calibrate.outputs["sha256"] == sha256_file(out / INPUT_SCALES_SHARD)
    assert manifest.shards[INPUT_SCALES_SHARD].sha256 == calibrate.outputs["sha256"]
    assert "validate" not in manifest.stages  # its verdict judged other bytes
    again = requantize_checkpoint(out, src, method="act-diag", device="cpu", progress=False)
    assert not again.shards_rewritten and _tensors(out / INPUT_SCALES_SHARD).keys() == scales_after.keys()


def test_requantize_without_the_statistics_its_method_needs_is_refused(calibrated_pair, tmp_path):
    src, out = calibrated_pair
    plain = tmp_path / "plain"
    copy_of(calibrated_pair, plain)
    calibrate_tiny(src, plain)  # no --expert-stats: the record has no statistics
    with pytest.raises(CheckpointError, match="needs calibrate --expert-stats hessian"):
        requantize_checkpoint(plain, src, method="gptq", device="cpu", progress=False)
    diag = tmp_path / "diag"
    copy_of(calibrated_pair, diag)
    calibrate_tiny(src, diag, expert_stats="diag")
    with pytest.raises(CheckpointError, match="calibrate recorded diag"):
        requantize_checkpoint(diag, src, method="gptq", device="cpu", progress=False)
    before = _digests(diag)
    assert requantize_checkpoint(diag, src, method="act-diag", device="cpu", recalibrate=False,
                                 progress=False).shards_rewritten
    assert _digests(diag) != before


def test_a_changed_statistics_file_is_refused_before_any_shard_is_written(calibrated_pair):
    src, out = calibrated_pair
    stats = sorted((out / "calibration" / "expert_stats").glob("layer_*.safetensors"))[0]
    stats.write_bytes(stats.read_bytes()[:-8] + b"\0" * 8)
    before = _digests(out)
    with pytest.raises(CheckpointError, match="changed since calibrate recorded it") as e:
        requantize_checkpoint(out, src, device="cpu", progress=False)
    assert str(stats) in str(e.value)
    assert _digests(out) == before


def test_requantize_help_lists_its_options():
    result = CliRunner().invoke(cli, ["requantize", "--help"])
    assert result.exit_code == 0, result.output
    for option in ("--source", "--method [act-diag|gptq|gptq-w4a4|gptq-w4a4-diag]", "--device", "--recalibrate / --no-recalibrate"):
        assert option in result.output


def test_the_cli_requantizes(calibrated_pair):
    src, out = calibrated_pair
    result = CliRunner().invoke(cli, ["requantize", str(out), "--source", str(src), "--method", "act-diag",
                                      "--device", "cpu", "--no-recalibrate", "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "requantized (act-diag): 2 shards rewritten" in result.output
