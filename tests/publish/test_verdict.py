"""The validate verdict is bound to the bytes it judged: publish refuses a stale, unsealed or forged one.

Real stages on a tiny checkpoint (convert -> calibrate -> validate -> calibrate again), then the same rules on the
`publishable` fixture with one thing changed at a time.
"""

from __future__ import annotations

import json
import shutil

import pytest

from kimi_nvfp4.calibrate import calibrate_checkpoint
from kimi_nvfp4.calibrate.shard import INPUT_SCALES_SHARD
from kimi_nvfp4.checkpoint.manifest import ShardRecord, load_manifest, save_manifest
from kimi_nvfp4.checkpoint.verdict import VERDICT_KEY, ValidateVerdict, tokens_sha256
from kimi_nvfp4.convert import convert_checkpoint
from kimi_nvfp4.errors import CheckpointError, GateFailure
from kimi_nvfp4.publish import check_publishable
from kimi_nvfp4.synth import create_synthetic_checkpoint
from kimi_nvfp4.validate import DEFAULT_GATES, validate_checkpoint


def _gates():
    g = DEFAULT_GATES.model_copy(deep=True)
    g.w4a4.top1_min = g.w4a16.top1_min = 0.5  # an untrained model's top-1 is a coin toss (tests/validate)
    return g


@pytest.fixture(scope="module")
def _validated_master(tmp_path_factory):
    root = tmp_path_factory.mktemp("verdict")
    src = create_synthetic_checkpoint(root / "src", preset="tiny", shards=2)
    out = root / "out"
    convert_checkpoint(src, out, device="cpu", progress=False)
    calibrate_checkpoint(out, src, "sample", samples=4, seq_len=48, device="cpu", progress=False)
    report = validate_checkpoint(out, src, "sample", report_dir=out / "reports", gates=_gates(), samples=2,
                                 seq_len=32, device="cpu", progress=False)
    assert report.passed, report.failed_gates()
    return src, out


@pytest.fixture
def validated(tmp_path, _validated_master):
    src, out = _validated_master
    dst = tmp_path / "out"
    shutil.copytree(out, dst)
    return src, dst


def test_validate_seals_shard_digests_thresholds_and_data(validated):
    _, out = validated
    manifest = load_manifest(out)
    sealed = ValidateVerdict.model_validate(manifest.stages["validate"].outputs[VERDICT_KEY])
    assert INPUT_SCALES_SHARD in sealed.shards
    assert sealed.shards == {f: r.sha256 for f, r in manifest.shards.items()}
    assert sealed.passed is True and sealed.failed_gates == []
    assert sealed.thresholds == _gates().model_dump(mode="json")
    assert sealed.data.spec == "sample" and sealed.data.sequences == 2 and len(sealed.data.tokens_sha256) == 64
    # every uploaded file but the shards (sealed on their own), the card, the manifest and the reports
    assert {"config.json", "hf_quant_config.json", "model.safetensors.index.json"} <= set(sealed.load_files)
    assert "tokenizer_config.json" in sealed.load_files
    assert not set(sealed.load_files) & (set(sealed.shards) | {"README.md", "kimi_nvfp4_manifest.json"})
    assert not any(f.startswith("reports/") for f in sealed.load_files)
    in_report = json.loads((out / "reports" / "validate_report.json").read_text())[VERDICT_KEY]
    assert ValidateVerdict.model_validate(in_report) == sealed
    readiness = check_publishable(out, progress=False)
    assert readiness.validation_passed is True


def test_recalibrating_makes_the_verdict_stale_and_report_files_do_not_count(validated):
    """The reproduced bug: calibrate drops stages.validate and publish used to accept reports/validate_report.json."""
    src, out = validated
    sealed = load_manifest(out).stages["validate"]
    calibrate_checkpoint(out, src, "sample", samples=2, seq_len=24, device="cpu", progress=False)
    assert json.loads((out / "reports" / "validate_report.json").read_text())["passed"] is True
    shutil.copy(out / "reports" / "validate_report.json", out / "validate_report.json")
    with pytest.raises(GateFailure, match="validate has not run"):
        check_publishable(out, progress=False)
    # Putting the old record back (by hand, or a tool that keeps stale records) does not help either.
    manifest = load_manifest(out)
    manifest.stages["validate"] = sealed
    save_manifest(out, manifest)
    with pytest.raises(GateFailure, match=f"stale: shard\\(s\\) changed since validate judged them: {INPUT_SCALES_SHARD}"):
        check_publishable(out, progress=False)


def test_tokens_fingerprint_depends_on_every_token_and_the_split():
    import torch

    a, b = torch.tensor([1, 2, 3]), torch.tensor([4])
    assert tokens_sha256([a, b]) != tokens_sha256([torch.tensor([1, 2]), torch.tensor([3, 4])])
    assert tokens_sha256([a, b]) != tokens_sha256([a, torch.tensor([5])])
    assert tokens_sha256([a, b]) == tokens_sha256([a.to(torch.int32), b])


def _record(folder):
    manifest = load_manifest(folder)
    return manifest, manifest.stages["validate"].outputs[VERDICT_KEY]


def test_shard_rewritten_and_recorded_after_validate_is_refused(publishable):
    manifest, _ = _record(publishable)
    shard = sorted(publishable.glob("model-*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01
    shard.write_bytes(bytes(data))
    import hashlib

    manifest.shards[shard.name].sha256 = hashlib.sha256(data).hexdigest()  # intact by the manifest's account
    save_manifest(publishable, manifest)
    with pytest.raises(GateFailure, match=f"stale.*{shard.name}"):
        check_publishable(publishable, progress=False)
    readiness = check_publishable(publishable, force_unvalidated=True, progress=False)
    assert readiness.forced_unvalidated and any("stale" in n for n in readiness.notes)


def test_a_shard_the_verdict_never_saw_is_refused(publishable):
    manifest, _ = _record(publishable)
    extra = publishable / INPUT_SCALES_SHARD
    shutil.copy(sorted(publishable.glob("model-*.safetensors"))[0], extra)
    index = json.loads((publishable / "model.safetensors.index.json").read_text())
    import hashlib

    data = extra.read_bytes()
    manifest.shards[INPUT_SCALES_SHARD] = ShardRecord(file=INPUT_SCALES_SHARD, sha256=hashlib.sha256(data).hexdigest(),
                                                      bytes=len(data), tensors=1)
    save_manifest(publishable, manifest)
    (publishable / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(GateFailure, match=f"new shards \\['{INPUT_SCALES_SHARD}'\\]"):
        check_publishable(publishable, progress=False)


def test_config_edited_after_validate_is_refused(publishable):
    config = json.loads((publishable / "config.json").read_text())
    config["torch_dtype"] = "float16"
    (publishable / "config.json").write_text(json.dumps(config))
    with pytest.raises(GateFailure, match="stale: file\\(s\\) changed since validate judged them: config.json"):
        check_publishable(publishable, progress=False)


def test_a_forged_passing_verdict_over_other_bytes_is_refused(publishable):
    """A verdict copied from another checkpoint (or typed in) names digests that are not these shards'."""
    manifest, raw = _record(publishable)
    raw["shards"] = {f: "0" * 64 for f in raw["shards"]}
    save_manifest(publishable, manifest)
    with pytest.raises(GateFailure, match="stale"):
        check_publishable(publishable, progress=False)


def test_a_failed_sealed_verdict_is_refused(publishable, write_manifest):
    write_manifest(publishable, validate={"settings": {}, "complete": True, "outputs": {}}, verdict=False)
    with pytest.raises(GateFailure, match="validate did not pass \\(failed gates: w4a4.kl_mean\\)"):
        check_publishable(publishable, progress=False)


@pytest.mark.parametrize(("name", "content"), [
    ("chat_template.jinja", "{{ 'replaced' }}"),
    ("tokenizer.json", "{not json"),
    ("evil.py", "import os\n"),
    ("generation_config.json", '{"temperature": 5.0}'),
    ("extra/model-00009-of-00009.safetensors", "x"),
], ids=["chat-template", "tokenizer", "remote-code", "generation-config", "shard-in-subfolder"])
def test_an_uploaded_file_validate_did_not_seal_is_refused(publishable, name, content):
    """Publish uploads every file of the folder: each must be one validate sealed, unchanged."""
    path = publishable / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content)
    with pytest.raises(GateFailure, match=f"stale: file\\(s\\) changed since validate judged them: .*{name}"):
        check_publishable(publishable, progress=False)


def test_a_passing_verdict_with_failed_gates_is_rejected(publishable):
    manifest, raw = _record(publishable)
    raw["failed_gates"] = ["w4a4.kl_mean"]
    save_manifest(publishable, manifest)
    with pytest.raises(CheckpointError, match="contradicts itself"):
        check_publishable(publishable, progress=False)
