"""requantize --method gptq-w4a4 on a tiny checkpoint calibrated with `--expert-stats w4a4`: it rewrites only the
routed-expert shards from those statistics (recorded per shard), resumes to the same bytes, and neither kind of
statistics stands in for the other (gptq needs hessian, gptq-w4a4 needs w4a4)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from kimi_nvfp4.checkpoint.manifest import load_manifest
from kimi_nvfp4.checkpoint.writer import sha256_file
from kimi_nvfp4.cli import cli
from kimi_nvfp4.errors import CheckpointError
from kimi_nvfp4.requantize import REQUANTIZE_STAGE, RequantizeRecord, requantize_checkpoint

from .conftest import calibrate_tiny, copy_of


def _digests(folder) -> dict[str, str]:
    return {p.name: sha256_file(p) for p in sorted(folder.glob("*.safetensors"))}


@pytest.fixture(scope="module")
def _w4a4_master(tmp_path_factory, _calibrated_master):
    src, out = _calibrated_master
    dst = tmp_path_factory.mktemp("w4a4") / "out"
    copy_of((src, out), dst)
    calibrate_tiny(src, dst, expert_stats="w4a4")
    return src, dst


@pytest.fixture
def w4a4_pair(tmp_path, _w4a4_master):
    src, out = _w4a4_master
    return src, copy_of(_w4a4_master, tmp_path / "w4a4")


def test_gptq_w4a4_rewrites_the_expert_shards_from_the_w4a4_statistics(w4a4_pair, calibrated_pair, tmp_path):
    src, out = w4a4_pair
    before = _digests(out)
    result = requantize_checkpoint(out, src, method="gptq-w4a4", device="cpu", recalibrate=False, progress=False)
    after = _digests(out)
    rewritten = set(result.shards_rewritten)
    assert rewritten and {f for f in before if before[f] != after[f]} == rewritten
    manifest = load_manifest(out)
    record = RequantizeRecord.model_validate(manifest.stages[REQUANTIZE_STAGE].outputs)
    assert record.method == "gptq-w4a4" and record.statistics_mode == "w4a4"
    files = manifest.stages["calibrate"].outputs["expert_stats"]["files"]
    for f in rewritten:
        entry = record.shards[f]
        assert entry.method == "gptq-w4a4" and entry.sha256 == after[f]
        assert entry.statistics and all(files[p.rsplit("/", 1)[1]] == d for p, d in entry.statistics.items())
    assert record.counts()["expert-dense"] > 0

    # other bytes than gptq's on the W4A16 statistics of the same calibration
    gptq = copy_of(calibrated_pair, tmp_path / "gptq")
    requantize_checkpoint(gptq, src, method="gptq", device="cpu", recalibrate=False, progress=False)
    assert any(_digests(gptq)[f] != after[f] for f in rewritten)

    again = requantize_checkpoint(out, src, method="gptq-w4a4", device="cpu", recalibrate=False, progress=False)
    assert sorted(again.shards_skipped) == sorted(rewritten) and not again.shards_rewritten


def test_a_rewrite_from_scratch_gives_the_same_bytes(w4a4_pair, tmp_path):
    src, out = w4a4_pair
    other = copy_of((src, out), tmp_path / "other")
    for folder in (out, other):
        requantize_checkpoint(folder, src, method="gptq-w4a4", device="cpu", recalibrate=False, progress=False)
    assert _digests(out) == _digests(other)


def test_each_method_refuses_the_other_kind_of_statistics(w4a4_pair, calibrated_pair):
    src, w4a4 = w4a4_pair
    _, hessian = calibrated_pair
    with pytest.raises(CheckpointError, match="needs calibrate --expert-stats w4a4; calibrate recorded hessian"):
        requantize_checkpoint(hessian, src, method="gptq-w4a4", device="cpu", progress=False)
    with pytest.raises(CheckpointError, match="needs calibrate --expert-stats hessian; calibrate recorded w4a4"):
        requantize_checkpoint(w4a4, src, method="gptq", device="cpu", progress=False)


def test_the_cli_runs_gptq_w4a4(w4a4_pair):
    src, out = w4a4_pair
    result = CliRunner().invoke(cli, ["requantize", str(out), "--source", str(src), "--method", "gptq-w4a4",
                                      "--device", "cpu", "--no-recalibrate", "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "requantized (gptq-w4a4): 2 shards rewritten" in result.output
    calibrate_help = CliRunner().invoke(cli, ["calibrate", "--help"]).output
    assert "w4a4" in calibrate_help
