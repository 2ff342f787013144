"""`publish --dry-run`: every file with its size and the card, no network, nothing written."""

from __future__ import annotations

import socket

import pytest

from kimi_nvfp4.checkpoint.manifest import load_manifest
from kimi_nvfp4.cli import main
from kimi_nvfp4.publish import list_publish_files, publish_checkpoint
from kimi_nvfp4.publish.files import format_size
from kimi_nvfp4.publish.public_copy import public_sizes


def run_cli(argv: list[str]) -> int:
    """The console entry point's exit status (main() returns on success, sys.exit()s on errors)."""
    try:
        main(argv)
    except SystemExit as e:
        return int(e.code or 0)
    return 0


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("dry run opened a network connection")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def _snapshot(folder):
    return {p.relative_to(folder).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in folder.rglob("*") if p.is_file()}


def test_dry_run_lists_every_file_and_the_card(publishable, no_network, capsys):
    before = _snapshot(publishable)
    assert run_cli(["publish", str(publishable), "me/Kimi-K2.6-NVFP4", "--dry-run", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "(no network used)" in out
    # Sizes are those of what is sent: the public copy of the manifest (no local paths, publish/public_copy.py).
    for f in public_sizes(publishable, list_publish_files(publishable), load_manifest(publishable)):
        if f.path != "README.md":  # the card replaces the source card, which is kept as README.source.md
            assert f"  {f.path} " in out and format_size(f.bytes) in out, f.path
    assert "README.source.md" in out  # where the source's card will go
    assert "----- README.md -----" in out and "base_model:" in out and "## Usage" in out
    assert "kimi_nvfp4_manifest.json" in out
    assert _snapshot(publishable) == before  # nothing written, nothing moved


def test_dry_run_result_matches_what_upload_would_send(publishable, no_network):
    result = publish_checkpoint(publishable, "me/x", dry_run=True, progress=False)
    paths = [f.path for f in result.files]
    assert paths == sorted(paths)
    assert {"README.md", "README.source.md", "config.json", "kimi_nvfp4_manifest.json"} <= set(paths)
    assert result.total_bytes == sum(f.bytes for f in result.files)
    card_entry = next(f for f in result.files if f.path == "README.md")
    assert card_entry.bytes == len(result.card.encode())
    assert result.upload is None


def test_hidden_and_partial_files_are_never_listed(publishable):
    (publishable / ".cache" / "huggingface").mkdir(parents=True)
    (publishable / ".cache" / "huggingface" / "state").write_text("x")
    (publishable / "reports" / ".chart.png.partial").write_text("x")
    paths = [f.path for f in list_publish_files(publishable)]
    assert not any(p.startswith(".") or "/." in p or p.endswith(".partial") for p in paths)


def test_dry_run_still_refuses(publishable, no_network, capsys):
    shard = sorted(publishable.glob("model-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-1] + b"\x01")
    assert run_cli(["publish", str(publishable), "me/x", "--dry-run", "--no-progress"]) == 3
    err = capsys.readouterr().err
    assert err.startswith("error: ") and shard.name in err and len(err.strip().splitlines()) == 1
