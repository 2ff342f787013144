"""Every refusal: publish only complete, intact, validated conversions (and the override's limits)."""

from __future__ import annotations

import json

import pytest

from kimi_nvfp4.checkpoint.manifest import MANIFEST_NAME, load_manifest, save_manifest
from kimi_nvfp4.errors import CheckpointError, GateFailure
from kimi_nvfp4.publish import check_publishable


def _first_shard(folder):
    return sorted(folder.glob("model-*.safetensors"))[0]


def test_complete_validated_folder_passes(publishable):
    readiness = check_publishable(publishable, progress=False)
    assert readiness.shards_verified == 2
    assert readiness.shard_bytes == sum(p.stat().st_size for p in publishable.glob("model-*.safetensors"))
    assert readiness.validation_passed is True
    assert readiness.forced_unvalidated is False


def test_refuses_without_manifest(tiny_int4_checkpoint):
    with pytest.raises(CheckpointError, match="manifest is missing") as e:
        check_publishable(tiny_int4_checkpoint, progress=False)
    assert e.value.exit_code == 3


def test_refuses_malformed_manifest(publishable):
    (publishable / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(CheckpointError, match="manifest is malformed"):
        check_publishable(publishable, progress=False)


def test_refuses_incomplete_conversion(publishable):
    manifest = load_manifest(publishable)
    manifest.complete = False
    save_manifest(publishable, manifest)
    with pytest.raises(CheckpointError, match="not complete"):
        check_publishable(publishable, progress=False)


def test_refuses_sha256_mismatch_with_same_size(publishable):
    shard = _first_shard(publishable)
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # same size, different content: only the recomputed hash can tell
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="sha256") as e:
        check_publishable(publishable, progress=False)
    assert shard.name in str(e.value)


def test_refuses_size_mismatch(publishable):
    shard = _first_shard(publishable)
    shard.write_bytes(shard.read_bytes()[:-8])
    with pytest.raises(CheckpointError, match="bytes, the manifest records"):
        check_publishable(publishable, progress=False)


def test_refuses_missing_shard(publishable):
    shard = _first_shard(publishable)
    shard.unlink()
    with pytest.raises(CheckpointError, match="missing") as e:
        check_publishable(publishable, progress=False)
    assert shard.name in str(e.value)


def test_refuses_shard_the_manifest_does_not_know(publishable):
    manifest = load_manifest(publishable)
    dropped = sorted(manifest.shards)[0]
    del manifest.shards[dropped]
    save_manifest(publishable, manifest)
    with pytest.raises(CheckpointError, match="no record of it") as e:
        check_publishable(publishable, progress=False)
    assert dropped in str(e.value)


def test_refuses_stray_safetensors(publishable):
    (publishable / "extra.safetensors").write_bytes(b"\0" * 16)
    with pytest.raises(CheckpointError, match="stray"):
        check_publishable(publishable, progress=False)


def test_refuses_half_written_file(publishable):
    (publishable / ".model-00003-of-00003.safetensors.partial").write_bytes(b"\0")
    with pytest.raises(CheckpointError, match="half-written"):
        check_publishable(publishable, progress=False)


@pytest.mark.parametrize(
    "validate, verdict, reason",
    [
        (None, None, "validate has not run"),
        ({"settings": {}, "complete": True, "outputs": {"passed": False}}, False, "validate did not pass"),
        ({"settings": {}, "complete": True, "outputs": {"passed": True}}, None, "no sealed verdict"),
        ({"settings": {}, "complete": False, "outputs": {}}, None, "validate did not finish"),
    ],
    ids=["missing", "failed", "unsealed", "incomplete"],
)
def test_refuses_unvalidated_unless_forced(publishable, write_manifest, validate, verdict, reason):
    for report in publishable.glob("reports/validate_report.json"):
        report.unlink()
    write_manifest(publishable, validate=validate, verdict=verdict)
    with pytest.raises(GateFailure, match=reason) as e:
        check_publishable(publishable, progress=False)
    assert e.value.exit_code == 1
    assert "--force-unvalidated" in str(e.value)
    readiness = check_publishable(publishable, force_unvalidated=True, progress=False)
    assert readiness.forced_unvalidated is True
    assert any(reason in note for note in readiness.notes)


def test_a_validate_report_file_without_stage_record_is_never_read(publishable, write_manifest):
    write_manifest(publishable, validate=None)
    for where in (publishable / "reports", publishable):
        (where / "validate_report.json").write_text(json.dumps({"passed": True}))
    with pytest.raises(GateFailure, match="validate has not run"):
        check_publishable(publishable, progress=False)


def test_force_never_overrides_a_corrupt_shard(publishable):
    shard = _first_shard(publishable)
    data = bytearray(shard.read_bytes())
    data[100] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="sha256"):
        check_publishable(publishable, force_unvalidated=True, progress=False)


def test_uncalibrated_checkpoint_is_refused_even_when_forced(publishable):
    """SGLang would serve uninitialised input scales, so --force-unvalidated does not cover this."""
    manifest = load_manifest(publishable)
    del manifest.stages["calibrate"]
    save_manifest(publishable, manifest)
    with pytest.raises(GateFailure, match="not calibrated"):
        check_publishable(publishable, force_unvalidated=True, progress=False)
