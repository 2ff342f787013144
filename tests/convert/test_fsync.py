"""`--no-fsync`: the same bytes without flushing, and what a resume trusts afterwards (convert/output.py)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from kimi_nvfp4.checkpoint import writer
from kimi_nvfp4.checkpoint.manifest import current_boot_id, load_manifest
from kimi_nvfp4.cli import cli
from kimi_nvfp4.convert import convert_checkpoint, output


def _count_fsyncs(monkeypatch) -> list[int]:
    calls = []
    real = writer.os.fsync
    monkeypatch.setattr(writer.os, "fsync", lambda fd: (calls.append(fd), real(fd))[1])
    return calls


def test_no_fsync_writes_the_same_bytes_without_flushing(source, tmp_path, monkeypatch):
    calls = _count_fsyncs(monkeypatch)
    convert_checkpoint(source, tmp_path / "durable", device="cpu", progress=False)
    flushed = len(calls)
    convert_checkpoint(source, tmp_path / "lazy", device="cpu", progress=False, fsync=False)
    assert flushed > 5 and len(calls) == flushed  # every shard, config and manifest flushed; then none
    durable, lazy = load_manifest(tmp_path / "durable"), load_manifest(tmp_path / "lazy")
    assert {f: r.sha256 for f, r in durable.shards.items()} == {f: r.sha256 for f, r in lazy.shards.items()}
    assert all(r.durable for r in durable.shards.values()) and not any(r.durable for r in lazy.shards.values())
    assert lazy.boot_id == current_boot_id()
    for f in durable.shards:
        assert (tmp_path / "durable" / f).read_bytes() == (tmp_path / "lazy" / f).read_bytes()


def _corrupt_keeping_size(path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("fsync", [False, True], ids=["no-fsync", "fsync"])
def test_after_a_reboot_only_unflushed_shards_are_rehashed(source, tmp_path, monkeypatch, fsync):
    out = tmp_path / "out"
    convert_checkpoint(source, out, device="cpu", progress=False, fsync=fsync)
    records = load_manifest(out).shards
    victim = sorted(records)[1]
    _corrupt_keeping_size(out / victim)
    hashed = []
    real_sha = output.sha256_file
    monkeypatch.setattr(output, "sha256_file", lambda p: (hashed.append(p.name), real_sha(p))[1])
    monkeypatch.setattr(output, "current_boot_id", lambda: "another-boot")
    again = convert_checkpoint(source, out, device="cpu", progress=False, fsync=fsync)
    if fsync:  # flushed shards survive a reboot: trusted on their stamp; the one edited in place is re-read and redone
        assert hashed == [victim] and again.shards_converted == 1
        assert writer.sha256_file(out / victim) == records[victim].sha256
    else:  # each unflushed shard is re-hashed; the damaged one is converted again
        assert sorted(hashed) == sorted(records) and again.shards_converted == 1
        assert load_manifest(out).shards[victim].sha256 == records[victim].sha256
        assert writer.sha256_file(out / victim) == records[victim].sha256


def test_same_boot_resume_trusts_unflushed_shards_on_their_stamp(source, tmp_path, monkeypatch):
    """Within one boot the page cache holds what was written, so no shard is re-read on resume."""
    out = tmp_path / "out"
    convert_checkpoint(source, out, device="cpu", progress=False, fsync=False)
    hashed = []
    monkeypatch.setattr(output, "sha256_file", lambda p: hashed.append(p) or "")
    again = convert_checkpoint(source, out, device="cpu", progress=False, fsync=False)
    assert hashed == [] and again.shards_converted == 0


def test_cli_no_fsync_flag(source, tmp_path):
    result = CliRunner().invoke(cli, ["convert", str(source), str(tmp_path / "out"), "--device", "cpu",
                                       "--no-fsync", "--no-progress"])
    assert result.exit_code == 0, result.output
    assert not any(r.durable for r in load_manifest(tmp_path / "out").shards.values())
    assert "--no-fsync" in CliRunner().invoke(cli, ["convert", "--help"]).output
