"""The uploaded manifest and reports carry no absolute local path and no boot id; the local files keep them."""

from __future__ import annotations

import json

import pytest

from kimi_nvfp4.checkpoint.manifest import MANIFEST_NAME, current_boot_id, load_manifest, save_manifest
from kimi_nvfp4.publish import publish_checkpoint
from kimi_nvfp4.publish.public_copy import LocalFacts

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:httpx2")
BOOT = "0f6c9a52-3d41-4c39-9d7e-5b1a2f0e8c11"


@pytest.fixture
def local_facts_everywhere(publishable, tmp_path):
    """What `run` leaves: a manifest with the local source path, the boot id, absolute report folders in stage
    records, and a pipeline summary full of local paths."""
    source = tmp_path / "models" / "Kimi-K2.6"
    source.mkdir(parents=True)
    manifest = load_manifest(publishable)
    manifest.source.path = str(source)
    manifest.boot_id = BOOT
    manifest.stages["calibrate"].outputs["report"] = str(publishable / "reports")
    save_manifest(publishable, manifest)
    summary = {
        "source": str(source), "output": str(publishable), "report_dir": str(publishable / "reports"),
        "stages": [{"name": "convert", "status": "ran", "summary": f"output: {publishable}", "details": {
            "output": str(publishable), "source": str(source), "boot": BOOT}},
                   {"name": "validate", "status": "ran", "summary": f"report in {tmp_path}/elsewhere/r"}],
    }
    (tmp_path / "elsewhere" / "r").mkdir(parents=True)
    (publishable / "reports" / "pipeline_summary.json").write_text(json.dumps(summary))
    (publishable / "reports" / "pipeline_summary.md").write_text(f"source `{source}` -> output `{publishable}`\n")
    return source


def _leaks(data: bytes, *secrets: str) -> list[str]:
    text = data.decode()
    return [s for s in secrets if s in text]


def test_uploaded_manifest_and_summary_carry_no_local_paths_or_boot_id(publishable, hub, local_facts_everywhere,
                                                                        tmp_path, monkeypatch):
    import kimi_nvfp4.publish.public_copy as public_copy

    monkeypatch.setattr(public_copy, "current_boot_id", lambda: BOOT)
    source = local_facts_everywhere
    result = publish_checkpoint(publishable, "me/x", endpoint=hub.url, progress=False)
    secrets = (str(tmp_path), str(publishable), str(source), BOOT)
    for path in (MANIFEST_NAME, "reports/pipeline_summary.json", "reports/pipeline_summary.md"):
        uploaded = hub.file_bytes("me/x", path)
        assert _leaks(uploaded, *secrets) == [], path
    manifest = json.loads(hub.file_bytes("me/x", MANIFEST_NAME))
    assert manifest["source"]["path"] == "moonshotai/Kimi-K2.6" and manifest["boot_id"] is None
    assert manifest["stages"]["calibrate"]["outputs"]["report"] == "./reports"
    summary = json.loads(hub.file_bytes("me/x", "reports/pipeline_summary.json"))
    assert summary["output"] == "." and summary["source"] == "<source>"
    assert summary["stages"][0]["details"]["boot"] == "<boot id>"
    assert summary["stages"][1]["summary"] == "report in <local>/r"
    # The dry-run listing showed the sizes of what was sent.
    sizes = {f.path: f.bytes for f in result.files}
    assert sizes["reports/pipeline_summary.json"] == len(hub.file_bytes("me/x", "reports/pipeline_summary.json"))
    # Local files keep what a resume needs.
    local = load_manifest(publishable)
    assert local.boot_id == BOOT and local.source.path == str(source)
    assert str(publishable) in (publishable / "reports" / "pipeline_summary.json").read_text()


def test_dry_run_lists_the_public_sizes_and_writes_nothing(publishable, local_facts_everywhere):
    before = sorted(p.name for p in publishable.iterdir())
    result = publish_checkpoint(publishable, "me/x", dry_run=True, progress=False)
    local_size = (publishable / MANIFEST_NAME).stat().st_size
    listed = next(f.bytes for f in result.files if f.path == MANIFEST_NAME)
    assert listed != local_size
    assert sorted(p.name for p in publishable.iterdir()) == before


def test_path_rules(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    facts = LocalFacts.of(out, None)
    assert facts.text(f"{out}/model.safetensors") == "./model.safetensors"
    assert facts.text(f"{out}2/x") == f"{out}2/x"  # not below the output; and it does not exist
    assert facts.text("see /v1/chat/completions") == "see /v1/chat/completions"  # not a local path
    assert facts.text(f"file {tmp_path}: disk full") == f"file <local>/{tmp_path.name}: disk full"
    if current_boot_id():
        assert facts.text(f"boot {current_boot_id()}") == "boot <boot id>"
