"""Atomic safetensors shard and index writing.

A shard is serialised by hand (8-byte header length, JSON header, raw tensor bytes) so that:
- the bytes stream straight from each tensor's storage to the file: no second in-memory copy of
  the shard (`safetensors.torch.save` builds the whole file as one `bytes` object first);
- the sha256 is computed while writing, without reading the file back;
- the file is written as `.NAME.partial`, fsynced, then renamed: a crash or a full disk never
  leaves a file that looks finished.
The format follows the safetensors spec (https://github.com/huggingface/safetensors#format):
little-endian u64 header size, JSON header padded with spaces to a multiple of 8, data offsets
relative to the end of the header and contiguous.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import OutputError
from .reader import INDEX_NAME, SAFETENSORS_DTYPES

PARTIAL_PREFIX = "."
PARTIAL_SUFFIX = ".partial"
# safetensors requires the header (and so the data start) aligned to 8 bytes.
_HEADER_ALIGNMENT = 8
_TORCH_TO_SAFETENSORS = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
# Write tensors in slices of this many bytes so a huge tensor never needs a second full copy.
_WRITE_CHUNK_BYTES = 64 * 1024 * 1024


def partial_path(final: Path) -> Path:
    """`dir/NAME` -> `dir/.NAME.partial` (hidden, so nothing mistakes it for a finished file)."""
    return final.with_name(f"{PARTIAL_PREFIX}{final.name}{PARTIAL_SUFFIX}")


def is_partial_name(name: str) -> bool:
    return name.startswith(PARTIAL_PREFIX) and name.endswith(PARTIAL_SUFFIX)


@dataclass(frozen=True)
class WrittenShard:
    file: str  # file name relative to the output folder
    sha256: str
    bytes: int
    tensors: int


def _tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a CPU tensor's bytes (copies only if not contiguous)."""
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


def _write_failure(e: OSError, path: Path) -> OutputError:
    if e.errno == errno.ENOSPC:
        return OutputError(f"file {path}: disk full while writing; the partial file was removed")
    return OutputError(f"file {path}: cannot write ({e.strerror or e}); the partial file was removed")


class ShardWriter:
    """Collects the tensors of one output shard, then writes it atomically.

    Tensors are written in name order, so the same tensors always give the same bytes.
    """

    def __init__(self, path: str | Path, metadata: dict[str, str] | None = None):
        self.path = Path(path)
        self.metadata = {"format": "pt", **(metadata or {})}
        self._tensors: dict[str, torch.Tensor] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._tensors:
            raise ValueError(f"tensor {name} added twice to {self.path.name}")
        if tensor.dtype not in _TORCH_TO_SAFETENSORS:
            raise ValueError(f"tensor {name}: dtype {tensor.dtype} has no safetensors encoding")
        self._tensors[name] = tensor if tensor.device.type == "cpu" else tensor.cpu()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors.values())

    def __len__(self) -> int:
        return len(self._tensors)

    def _header(self) -> bytes:
        header: dict[str, Any] = {"__metadata__": self.metadata}
        offset = 0
        for name in sorted(self._tensors):
            t = self._tensors[name]
            n = t.numel() * t.element_size()
            header[name] = {
                "dtype": _TORCH_TO_SAFETENSORS[t.dtype],
                "shape": list(t.shape),
                "data_offsets": [offset, offset + n],
            }
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * ((-len(raw)) % _HEADER_ALIGNMENT)
        return struct.pack("<Q", len(raw)) + raw

    def commit(self) -> WrittenShard:
        """Write `.NAME.partial`, fsync, rename to NAME. Returns its sha256 and size."""
        tmp = partial_path(self.path)
        digest = hashlib.sha256()
        total = 0
        try:
            with tmp.open("wb") as f:
                head = self._header()
                f.write(head)
                digest.update(head)
                total += len(head)
                for name in sorted(self._tensors):
                    data = _tensor_bytes(self._tensors[name])
                    for start in range(0, data.numel(), _WRITE_CHUNK_BYTES):
                        chunk = memoryview(data[start : start + _WRITE_CHUNK_BYTES].numpy())
                        f.write(chunk)
                        digest.update(chunk)
                        total += len(chunk)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise _write_failure(e, self.path) from None
        count = len(self._tensors)
        self._tensors.clear()
        return WrittenShard(self.path.name, digest.hexdigest(), total, count)


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    """Write a small file under a temporary name, fsync, rename."""
    path = Path(path)
    tmp = partial_path(path)
    try:
        with tmp.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise _write_failure(e, path) from None


def write_json_atomic(path: str | Path, obj: Any) -> None:
    write_bytes_atomic(path, (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode())


def write_index(root: str | Path, weight_map: dict[str, str], total_size: int) -> Path:
    """Write `model.safetensors.index.json` (HF format: metadata.total_size = tensor bytes, no headers)."""
    path = Path(root) / INDEX_NAME
    index = {"metadata": {"total_size": int(total_size)}, "weight_map": dict(sorted(weight_map.items()))}
    write_json_atomic(path, index)
    return path


def sha256_file(path: str | Path, chunk: int = 16 * 1024 * 1024) -> str:
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()
