"""publish refuses a folder holding users' traffic: request dumps, request logs, session or window exports."""

from __future__ import annotations

import socket

import pytest

from kimi_nvfp4.data.errors import DataError
from kimi_nvfp4.publish import publish_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:httpx2")


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("dry run opened a network connection")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.mark.parametrize("name", ["dumps/2026-01-01_12-00-00.pkl", "host-a_0.log", "logs/h_0.log.2026-01-01_11",
                                  "sessions.jsonl", "windows.jsonl"])
def test_a_data_file_in_the_folder_is_refused(publishable, no_network, name):
    path = publishable / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"user prompts")
    with pytest.raises(DataError, match=r"publish refuses to upload data \(.*" + name.split("/")[-1][:8]) as e:
        publish_checkpoint(publishable, "me/x", dry_run=True, progress=False)
    assert e.value.exit_code == 9
    path.unlink()
    publish_checkpoint(publishable, "me/x", dry_run=True, progress=False)  # without it: accepted
