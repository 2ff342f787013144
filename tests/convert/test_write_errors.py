"""A full disk or a read-only output: exit 4 and one line naming the file, never a traceback; no partial file left.

Injected at the write points (an OSError from the file system, as the kernel raises it), and for real where this
machine allows: a size-limited tmpfs and a read-only bind mount, each in a private mount namespace of a child
process (`unshare -m`; skipped where mounting is not allowed). chmod cannot stand in: the tests run as root.
"""

from __future__ import annotations

import errno
import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kimi_nvfp4.checkpoint import writer as writer_module
from kimi_nvfp4.checkpoint.manifest import MANIFEST_NAME, load_manifest
from kimi_nvfp4.checkpoint.writer import StreamingShardWriter, TensorSpec, is_partial_name
from kimi_nvfp4.cli import main
from kimi_nvfp4.errors import OutputError

from .conftest import weight_map

REPO = Path(__file__).resolve().parents[2]
OUTPUT_ERROR = 4
EXPERT_SHARD_TENSOR = "language_model.model.layers.2.mlp.experts.5.down_proj.weight_packed"


class _FullDisk(io.FileIO):
    """A file on a disk with `room` bytes left: later writes fail with ENOSPC, as write(2) does."""

    room = 0

    def write(self, data) -> int:
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        type(self).room -= len(data)
        return super().write(data)


def _buffered_open_failing(monkeypatch, matches, room: int) -> None:
    """`Path.open(..., "wb")` of matching partial files returns a buffered file on a disk that fills up: what is
    buffered when the disk fills is flushed again by close(), which fails again."""
    real_open = Path.open

    def open_(self, mode="r", *args, **kwargs):
        if "w" in mode and matches(self.name):
            _FullDisk.room = room
            return io.BufferedWriter(_FullDisk(self, "wb"))
        return real_open(self, mode, *args, **kwargs)

    monkeypatch.setattr(writer_module.Path, "open", open_)


def _run(capsys, *args) -> tuple[int, str]:
    with pytest.raises(SystemExit) as e:
        main([*map(str, args)])
    return e.value.code, capsys.readouterr().err.strip()


def _no_partials(out: Path) -> None:
    assert not [p for p in out.rglob("*") if is_partial_name(p.name)]


@pytest.mark.parametrize("room", [0, 3000], ids=["header", "data"])
def test_full_disk_inside_a_shard_is_exit_4_without_a_traceback(source, tmp_path, capsys, monkeypatch, room):
    target = weight_map(source)[EXPERT_SHARD_TENSOR]
    _buffered_open_failing(monkeypatch, lambda name: name == f".{target}.partial", room)
    out = tmp_path / "out"
    code, err = _run(capsys, "convert", source, out, "--method", "amax", "--no-stats", "--device", "cpu",
                     "--no-progress")
    assert code == OUTPUT_ERROR and len(err.splitlines()) == 1, err
    assert f"{target}: disk full while writing; the partial file was removed" in err
    _no_partials(out)
    assert target not in load_manifest(out).shards


def test_full_disk_during_the_first_manifest_write(source, tmp_path, capsys, monkeypatch):
    _buffered_open_failing(monkeypatch, lambda name: name == f".{MANIFEST_NAME}.partial", 10)
    out = tmp_path / "out"
    code, err = _run(capsys, "convert", source, out, "--device", "cpu", "--no-progress")
    assert code == OUTPUT_ERROR and len(err.splitlines()) == 1 and f"{MANIFEST_NAME}: disk full" in err, err
    _no_partials(out)


def test_writer_abort_never_raises_and_removes_the_partial(tmp_path, monkeypatch):
    import torch

    _buffered_open_failing(monkeypatch, lambda name: name.endswith(".partial"), 100)
    spec = TensorSpec("t", torch.float32, (1024,))
    for background in (True, False):
        with pytest.raises(OutputError, match="disk full while writing; the partial file was removed"):
            with StreamingShardWriter(tmp_path / "s.safetensors", [spec], background=background) as w:
                w.write("t", torch.zeros(1024))
                w.commit()
        assert not list(tmp_path.iterdir())


def _read_only(monkeypatch, prefix: str = "") -> None:
    """Creating or removing any partial file fails as on a read-only file system (EROFS)."""
    real_open, real_unlink = Path.open, Path.unlink

    def erofs(path):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    def open_(self, mode="r", *args, **kwargs):
        if "w" in mode and is_partial_name(self.name) and self.name.startswith(prefix):
            erofs(self)
        return real_open(self, mode, *args, **kwargs)

    def unlink(self, missing_ok=False):
        if is_partial_name(self.name):
            erofs(self)  # what unlink(2) says on a read-only mount, whether or not the file exists
        return real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(writer_module.Path, "open", open_)
    monkeypatch.setattr(writer_module.Path, "unlink", unlink)


def test_read_only_output_is_exit_4_when_even_removing_the_partial_fails(source, tmp_path, capsys, monkeypatch):
    _read_only(monkeypatch)
    out = tmp_path / "out"
    code, err = _run(capsys, "convert", source, out, "--device", "cpu", "--no-progress")
    assert code == OUTPUT_ERROR and len(err.splitlines()) == 1, err
    assert f"{MANIFEST_NAME}: the output is on a read-only file system; the partial file .{MANIFEST_NAME}.partial " \
           "could not be removed (Read-only file system)" in err


def test_read_only_while_copying_the_source_files(source, tmp_path, capsys, monkeypatch):
    _read_only(monkeypatch, prefix=".tokenizer")
    monkeypatch.setattr(shutil, "copyfile", lambda a, b: Path(b).open("wb"))
    out = tmp_path / "out"
    code, err = _run(capsys, "convert", source, out, "--method", "amax", "--no-stats", "--device", "cpu",
                     "--no-progress")
    assert code == OUTPUT_ERROR and "read-only file system" in err and len(err.splitlines()) == 1, err


# --- for real: a small tmpfs and a read-only bind mount in a private mount namespace ----------------------------


def _can_mount() -> bool:
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                            "mount -t tmpfs -o size=4k tmpfs /mnt"], capture_output=True)
    return probe.returncode == 0


real_mounts = pytest.mark.skipif(not _can_mount(), reason="needs unshare -m and mount (root in a private namespace)")


def _convert_in_namespace(setup: str, source: Path, out: Path, *flags: str) -> subprocess.CompletedProcess:
    cmd = (f"{setup} && exec {sys.executable} -m kimi_nvfp4 convert {source} {out} --method amax --no-stats "
           f"--device cpu --no-progress {' '.join(flags)}")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", cmd], capture_output=True,
                          text=True, env=env, timeout=300)


@real_mounts
@pytest.mark.parametrize("size", ["16k", "300k"], ids=["full-at-once", "full-midway"])
def test_real_full_disk(source, tmp_path, size):
    """With the up-front space check off (a filesystem whose free space says nothing), a disk that fills while
    writing stops the run with one line naming the file."""
    out = tmp_path / "out"
    out.mkdir()
    proc = _convert_in_namespace(f"mount -t tmpfs -o size={size} tmpfs {out}", source, out, "--no-space-check")
    err = proc.stderr.strip()
    assert proc.returncode == OUTPUT_ERROR and len(err.splitlines()) == 1, err
    assert err.startswith("error: file ") and "disk full" in err and "Traceback" not in err


@real_mounts
def test_real_small_disk_is_refused_before_a_shard_is_written(source, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    proc = _convert_in_namespace(f"mount -t tmpfs -o size=300k tmpfs {out}", source, out)
    err = proc.stderr.strip()
    assert proc.returncode == 10 and len(err.splitlines()) == 1, err
    assert "convert needs" in err and "free" in err and "Traceback" not in err


@real_mounts
def test_real_read_only_output(source, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    proc = _convert_in_namespace(f"mount --bind {out} {out} && mount -o remount,bind,ro {out}", source, out)
    err = proc.stderr.strip()
    assert proc.returncode == OUTPUT_ERROR and len(err.splitlines()) == 1, err
    assert "Read-only file system" in err and "Traceback" not in err
