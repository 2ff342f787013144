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
from typing import Any, Self

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

    def commit(self) -> WrittenShard:
        """Write `.NAME.partial`, fsync, rename to NAME. Returns its sha256 and size."""
        names = sorted(self._tensors)
        specs = [TensorSpec(n, self._tensors[n].dtype, tuple(self._tensors[n].shape)) for n in names]
        with StreamingShardWriter(self.path, specs, self.metadata) as stream:
            for name in names:
                stream.write(name, self._tensors[name])
            written = stream.commit()
        self._tensors.clear()
        return written


@dataclass(frozen=True)
class TensorSpec:
    """What the header promises for one tensor, before its data exists."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


def _encode_header(specs: list[TensorSpec], metadata: dict[str, str]) -> bytes:
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for spec in specs:
        if spec.dtype not in _TORCH_TO_SAFETENSORS:
            raise ValueError(f"tensor {spec.name}: dtype {spec.dtype} has no safetensors encoding")
        header[spec.name] = {
            "dtype": _TORCH_TO_SAFETENSORS[spec.dtype],
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * ((-len(raw)) % _HEADER_ALIGNMENT)
    return struct.pack("<Q", len(raw)) + raw


class StreamingShardWriter:
    """Writes one shard tensor by tensor, in an order fixed up front, holding none of them.

    The header (names, dtypes, shapes, offsets) is written first from `specs`; each `write` must then
    deliver the next tensor of `specs`, whose bytes go straight to `.NAME.partial` and into the sha256.
    `commit` fsyncs and renames; leaving the `with` block without committing removes the partial file.
    """

    def __init__(self, path: str | Path, specs: list[TensorSpec], metadata: dict[str, str] | None = None):
        self.path = Path(path)
        self._specs = list(specs)
        if len({s.name for s in self._specs}) != len(self._specs):
            raise ValueError(f"duplicate tensor names in the plan of {self.path.name}")
        self._next = 0
        self._tmp = partial_path(self.path)
        self._digest = hashlib.sha256()
        self._bytes = 0
        self._committed = False
        head = _encode_header(self._specs, {"format": "pt", **(metadata or {})})
        try:
            self._f = self._tmp.open("wb")
            self._emit(memoryview(head))
        except OSError as e:
            self.abort()
            raise _write_failure(e, self.path) from None

    def _emit(self, chunk: memoryview) -> None:
        self._f.write(chunk)
        self._digest.update(chunk)
        self._bytes += len(chunk)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self._specs):
            raise ValueError(f"tensor {name}: {self.path.name} expected no more tensors")
        spec = self._specs[self._next]
        if name != spec.name or tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
            raise ValueError(
                f"tensor {name} {tensor.dtype} {list(tensor.shape)}: {self.path.name} expected "
                f"{spec.name} {spec.dtype} {list(spec.shape)} next"
            )
        data = _tensor_bytes(tensor if tensor.device.type == "cpu" else tensor.cpu())
        try:
            for start in range(0, data.numel(), _WRITE_CHUNK_BYTES):
                self._emit(memoryview(data[start : start + _WRITE_CHUNK_BYTES].numpy()))
        except OSError as e:
            self.abort()
            raise _write_failure(e, self.path) from None
        self._next += 1

    def commit(self) -> WrittenShard:
        if self._next != len(self._specs):
            missing = self._specs[self._next].name
            self.abort()
            raise ValueError(f"{self.path.name}: tensor {missing} was never written")
        try:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
            os.replace(self._tmp, self.path)
        except OSError as e:
            self.abort()
            raise _write_failure(e, self.path) from None
        self._committed = True
        return WrittenShard(self.path.name, self._digest.hexdigest(), self._bytes, len(self._specs))

    def abort(self) -> None:
        """Close and remove the partial file (idempotent)."""
        f = getattr(self, "_f", None)
        if f is not None and not f.closed:
            f.close()
        self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        if not self._committed:
            self.abort()


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
