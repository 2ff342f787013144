"""Hand-written safetensors shards load everywhere, are written atomically, and read back exactly."""

from __future__ import annotations

import errno
import hashlib
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kimi_nvfp4.checkpoint.reader import INDEX_NAME
from kimi_nvfp4.checkpoint.tensor_io import ShardFile
from kimi_nvfp4.checkpoint.writer import ShardWriter, is_partial_name, partial_path, write_index
from kimi_nvfp4.errors import CheckpointError, OutputError

TENSORS = {
    "b.weight": torch.randn(5, 7).to(torch.bfloat16),
    "a.packed": torch.randint(-(2**31), 2**31 - 1, (3, 4), dtype=torch.int32),
    "a.scale": torch.rand(3, 2).to(torch.float8_e4m3fn),
    "a.scale_2": torch.tensor(0.125, dtype=torch.float32),
    "c.codes": torch.randint(0, 256, (2, 8), dtype=torch.uint8),
    "d.empty": torch.empty(0, 4, dtype=torch.float32),
}


def _bytes(t):
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_shard_loads_with_safetensors_and_hashes_its_bytes(tmp_path):
    w = ShardWriter(tmp_path / "s.safetensors")
    for name, t in TENSORS.items():
        w.add(name, t)
    assert w.nbytes == sum(t.numel() * t.element_size() for t in TENSORS.values())
    written = w.commit()
    path = tmp_path / "s.safetensors"
    assert written.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert written.bytes == path.stat().st_size and written.tensors == len(TENSORS)
    with safe_open(str(path), "pt") as f:
        assert sorted(f.keys()) == sorted(TENSORS)
        for name, t in TENSORS.items():
            got = f.get_tensor(name)
            assert got.dtype == t.dtype and got.shape == t.shape and _bytes(got) == _bytes(t)
    assert [p.name for p in tmp_path.iterdir()] == ["s.safetensors"]


def test_same_tensors_any_order_same_bytes(tmp_path):
    a, b = ShardWriter(tmp_path / "a.safetensors"), ShardWriter(tmp_path / "b.safetensors")
    for name, tensor in TENSORS.items():
        a.add(name, tensor)
    for name in reversed(list(TENSORS)):
        b.add(name, TENSORS[name])
    assert a.commit().sha256 == b.commit().sha256


def test_duplicate_name_is_a_bug(tmp_path):
    w = ShardWriter(tmp_path / "s.safetensors")
    w.add("x", torch.zeros(1))
    with pytest.raises(ValueError, match="twice"):
        w.add("x", torch.zeros(1))


def test_failed_write_removes_the_partial_file(tmp_path, monkeypatch):
    import kimi_nvfp4.checkpoint.writer as writer_module

    def no_space(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writer_module.os, "fsync", no_space)
    w = ShardWriter(tmp_path / "s.safetensors")
    w.add("x", torch.zeros(4))
    with pytest.raises(OutputError, match=r"s\.safetensors: disk full"):
        w.commit()
    assert list(tmp_path.iterdir()) == []


def test_partial_names_are_hidden():
    from pathlib import Path

    p = partial_path(Path("/x/model-00001-of-000064.safetensors"))
    assert p.name == ".model-00001-of-000064.safetensors.partial" and is_partial_name(p.name)
    assert not is_partial_name("model-00001-of-000064.safetensors")


def test_index_is_sorted_with_total_size(tmp_path):
    write_index(tmp_path, {"b": "s2", "a": "s1"}, 123)
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert index == {"metadata": {"total_size": 123}, "weight_map": {"a": "s1", "b": "s2"}}


def test_shard_file_reads_what_safetensors_wrote(tmp_path):
    path = tmp_path / "s.safetensors"
    save_file({k: v for k, v in TENSORS.items()}, str(path))
    with ShardFile(path) as shard:
        for name, t in TENSORS.items():
            got = shard.read(name)
            assert got.dtype == t.dtype and got.shape == t.shape and _bytes(got) == _bytes(t)
        with pytest.raises(CheckpointError, match="not in this shard"):
            shard.read("nope")


def test_shard_file_detects_truncation(tmp_path):
    path = tmp_path / "s.safetensors"
    save_file({"x": torch.arange(100, dtype=torch.float32)}, str(path))
    path.write_bytes(path.read_bytes()[:-8])
    with ShardFile(path) as shard, pytest.raises(CheckpointError, match="truncated"):
        shard.read("x")


def _specs(tensors):
    from kimi_nvfp4.checkpoint.writer import TensorSpec

    return [TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]


@pytest.mark.parametrize("background", [True, False], ids=["background", "inline"])
def test_streaming_copy_through_small_buffers_gives_the_same_bytes(tmp_path, monkeypatch, background):
    """write_from copies a tensor file to file in chunks (reused buffers); bytes and hash equal write()."""
    import kimi_nvfp4.checkpoint.writer as writer_module
    from kimi_nvfp4.checkpoint.writer import StreamingShardWriter

    monkeypatch.setattr(writer_module, "COPY_CHUNK_BYTES", 24)  # many chunks, a partial tail
    src = tmp_path / "src.safetensors"
    save_file(TENSORS, str(src))
    names = sorted(TENSORS)
    with StreamingShardWriter(tmp_path / "a.safetensors", _specs({n: TENSORS[n] for n in names})) as w:
        for n in names:
            w.write(n, TENSORS[n])
        expected = w.commit()
    with ShardFile(src) as shard, StreamingShardWriter(
        tmp_path / "b.safetensors", _specs({n: TENSORS[n] for n in names}), background=background, max_pending_bytes=48
    ) as w:
        for n in names:
            t = TENSORS[n]
            w.write_from(n, t.dtype, tuple(t.shape), lambda offset, view, n=n: shard.read_range(n, offset, view))
            assert w.pending_bytes <= 48 + 24
        got = w.commit()
    assert got.sha256 == expected.sha256 == hashlib.sha256((tmp_path / "b.safetensors").read_bytes()).hexdigest()


@pytest.mark.parametrize("background", [True, False], ids=["background", "inline"])
def test_without_checksum_the_same_bytes_and_no_sha256(tmp_path, background):
    """checksum=False (resume snapshots): the same file, only the hash is skipped."""
    from kimi_nvfp4.checkpoint.writer import StreamingShardWriter

    names = sorted(TENSORS)
    written = {}
    for checksum in (True, False):
        path = tmp_path / f"{checksum}.safetensors"
        with StreamingShardWriter(path, _specs({n: TENSORS[n] for n in names}), background=background,
                                  checksum=checksum) as w:
            for n in names:
                w.write(n, TENSORS[n])
            written[checksum] = w.commit()
    assert written[False].sha256 == "" and written[True].sha256
    assert (tmp_path / "True.safetensors").read_bytes() == (tmp_path / "False.safetensors").read_bytes()
    assert written[False].bytes == written[True].bytes


def test_background_write_failure_surfaces_and_removes_the_partial_file(tmp_path, monkeypatch):
    import kimi_nvfp4.checkpoint.writer as writer_module
    from kimi_nvfp4.checkpoint.writer import StreamingShardWriter

    tensors = {"a": torch.zeros(1000), "b": torch.ones(1000)}
    w = StreamingShardWriter(tmp_path / "s.safetensors", _specs(tensors), max_pending_bytes=16)

    def no_space(self, chunk):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writer_module.StreamingShardWriter, "_sink", no_space)
    with pytest.raises(OutputError, match="disk full"):
        w.write("a", tensors["a"])
        w.write("b", tensors["b"])
        w.commit()
    assert list(tmp_path.iterdir()) == []


def test_read_range_rejects_bytes_outside_the_tensor(tmp_path):
    path = tmp_path / "s.safetensors"
    save_file({"x": torch.arange(4, dtype=torch.float32)}, str(path))
    with ShardFile(path) as shard:
        view = memoryview(bytearray(8))
        shard.read_range("x", 8, view)
        assert bytes(view) == torch.tensor([2.0, 3.0]).numpy().tobytes()
        with pytest.raises(ValueError, match="outside"):
            shard.read_range("x", 12, view)
