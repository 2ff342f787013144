"""Source resolution (folder or Hub repo id) and device selection."""

from __future__ import annotations

import pytest
import torch

from kimi_nvfp4.convert.api import resolve_device
from kimi_nvfp4.convert.source import HUB_ALLOW_PATTERNS, resolve_source
from kimi_nvfp4.errors import CheckpointError, DeviceError


def test_local_folder_is_used_as_is(source):
    resolved = resolve_source(source)
    assert resolved.path == source.resolve() and resolved.repo_id is None


def test_repo_id_is_downloaded_with_snapshot_download(source, monkeypatch):
    import huggingface_hub

    calls = []

    def fake_snapshot_download(repo_id, revision=None, allow_patterns=None):
        calls.append((repo_id, revision, allow_patterns))
        return str(source)

    # The Hub client is the boundary; tests never reach the network.
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    resolved = resolve_source("moonshotai/Kimi-K2.6", revision="main")
    assert calls == [("moonshotai/Kimi-K2.6", "main", HUB_ALLOW_PATTERNS)]
    assert (resolved.path, resolved.repo_id, resolved.revision) == (source, "moonshotai/Kimi-K2.6", "main")


def test_neither_folder_nor_repo_id(tmp_path):
    with pytest.raises(CheckpointError, match="neither a checkpoint folder nor a Hub repo id"):
        resolve_source(str(tmp_path / "no" / "such" / "dir"))


def test_device_choice():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(DeviceError):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(DeviceError, match="no CUDA"):
            resolve_device("cuda")
