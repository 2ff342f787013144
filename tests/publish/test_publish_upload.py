"""The real upload path against a loopback stand-in for the Hub API (tests/publish/fake_hub.py)."""

from __future__ import annotations

import json
import logging

import pytest

from kimi_nvfp4.checkpoint.manifest import MANIFEST_NAME, load_manifest
from kimi_nvfp4.cli import main
from kimi_nvfp4.errors import OutputError
from kimi_nvfp4.publish import HubAuthError, publish_checkpoint
from kimi_nvfp4.publish.files import SOURCE_CARD_NAME

# huggingface_hub's HTTP client (httpx2) warns about its own upload call; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:httpx2")

FAKE_TOKEN = "hf_FAKEtoken0123456789abcdefSECRET"  # = conftest.FAKE_TOKEN, which the `hub` fixture sets


def run_cli(argv: list[str]) -> int:
    """The console entry point's exit status (main() returns on success, sys.exit()s on errors)."""
    try:
        main(argv)
    except SystemExit as e:
        return int(e.code or 0)
    return 0


def test_upload_sends_every_file_and_records_the_publish(publishable, hub):
    source_card = (publishable / "README.md").read_bytes()
    result = publish_checkpoint(publishable, "me/Kimi-K2.6-NVFP4", endpoint=hub.url, private=True, progress=False)
    remote = hub.files("me/Kimi-K2.6-NVFP4")
    assert sorted(remote) == [f.path for f in result.files]
    for f in result.files:
        if f.path != MANIFEST_NAME:  # recorded `stages.publish` after the upload
            assert hub.file_bytes("me/Kimi-K2.6-NVFP4", f.path) == (publishable / f.path).read_bytes(), f.path
    uploaded_manifest = json.loads(hub.file_bytes("me/Kimi-K2.6-NVFP4", MANIFEST_NAME))
    assert "publish" not in uploaded_manifest["stages"] and uploaded_manifest["complete"] is True
    assert hub.file_bytes("me/Kimi-K2.6-NVFP4", "README.md").decode() == result.card
    assert hub.file_bytes("me/Kimi-K2.6-NVFP4", SOURCE_CARD_NAME) == source_card
    assert remote["model-00001-of-000002.safetensors"]["lfs"] is True  # shards go through LFS, not inline
    assert hub.state.repos["me/Kimi-K2.6-NVFP4"].private is True
    record = load_manifest(publishable).stages["publish"]
    assert record.complete and record.settings["repo_id"] == "me/Kimi-K2.6-NVFP4"
    assert record.outputs["commit_url"].startswith(hub.url)
    assert result.upload.commit_url == record.outputs["commit_url"]


def test_upload_to_a_branch(publishable, hub):
    publish_checkpoint(publishable, "me/x", revision="nvfp4-v1", endpoint=hub.url, progress=False)
    assert "nvfp4-v1" in hub.state.repos["me/x"].branches
    assert "config.json" in hub.files("me/x", "nvfp4-v1") and not hub.files("me/x", "main")


def test_rerun_resumes_without_resending_shards(publishable, hub):
    hub.state.fail_commits = 1  # the first attempt dies after the shards were uploaded, before the commit
    with pytest.raises(OutputError, match="Hub upload"):
        publish_checkpoint(publishable, "me/x", endpoint=hub.url, progress=False)
    uploaded = list(hub.state.lfs_puts)
    assert len(uploaded) >= 2 and not hub.files("me/x")
    publish_checkpoint(publishable, "me/x", endpoint=hub.url, progress=False)
    assert hub.state.lfs_puts == uploaded  # the LFS batch API said they exist: nothing re-sent
    assert "model-00002-of-000002.safetensors" in hub.files("me/x")


def test_token_is_sent_but_never_printed_or_written(publishable, hub, tmp_path, capfd, caplog):
    caplog.set_level(logging.DEBUG)
    assert run_cli(["publish", str(publishable), "me/x", "--endpoint", hub.url, "--no-progress",
              "--json", str(tmp_path / "result.json")]) == 0
    auth = {a for _, path, a in hub.state.requests if path != "/lfs-storage" and a}
    assert auth == {f"Bearer {FAKE_TOKEN}"}  # it did authenticate with the token...
    captured = capfd.readouterr()
    assert "published" in captured.out
    assert FAKE_TOKEN not in captured.out + captured.err + caplog.text  # ...and never showed it
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert FAKE_TOKEN.encode() not in path.read_bytes(), path  # ...nor wrote it (folder, .cache, json)


def test_missing_token_is_a_clear_error(publishable, hub, monkeypatch):
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    with pytest.raises(HubAuthError, match="HF_TOKEN") as e:
        publish_checkpoint(publishable, "me/x", endpoint=hub.url, progress=False)
    assert e.value.exit_code == 7
    assert not hub.state.requests  # refused before any request


def test_invalid_repo_id_is_refused_before_any_work(publishable, hub, capsys):
    assert run_cli(["publish", str(publishable), "me/bad/extra", "--endpoint", hub.url, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: invalid Hub repo id") and len(err.strip().splitlines()) == 1
    assert not hub.state.requests


def test_hub_http_error_is_one_line_without_the_token(publishable, hub, capsys):
    hub.state.fail_commits = 99
    assert run_cli(["publish", str(publishable), "me/x", "--endpoint", hub.url, "--no-progress"]) == 4
    err = capsys.readouterr().err
    assert err.startswith("error: Hub upload") and "500" in err and FAKE_TOKEN not in err
