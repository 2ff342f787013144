"""Read single tensors from a safetensors shard with plain `readinto`, no mmap.

The reader's mmap-based `safe_open` leaves every touched page of every shard mapped into the
process until the handle closes, so a streaming conversion's resident memory would grow with the
checkpoint. Here each tensor is read straight into a freshly allocated tensor and the file is
closed when the job ends: resident memory is the tensors we hold, nothing else.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import BinaryIO, Self

import torch

from ..errors import CheckpointError
from .reader import SAFETENSORS_DTYPES

_HEADER_LEN = struct.Struct("<Q")


class ShardFile:
    """One open shard: header parsed once, tensors read on demand. Use as a context manager."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self._f: BinaryIO = self.path.open("rb")
        except FileNotFoundError:
            raise CheckpointError("shard file is missing", file=self.path) from None
        raw = self._f.read(_HEADER_LEN.size)
        if len(raw) < _HEADER_LEN.size:
            self.close()
            raise CheckpointError("file is shorter than a safetensors header (truncated?)", file=self.path)
        (n,) = _HEADER_LEN.unpack(raw)
        try:
            header = json.loads(self._f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            self.close()
            raise CheckpointError(f"header is not valid JSON ({e})", file=self.path) from None
        header.pop("__metadata__", None)
        self._meta = header
        self._data_start = _HEADER_LEN.size + n

    def __contains__(self, name: str) -> bool:
        return name in self._meta

    def _entry(self, name: str) -> tuple[torch.dtype, tuple[int, ...], int, int]:
        """(dtype, shape, absolute file offset, byte count) of `name`, checked against its header entry."""
        meta = self._meta.get(name)
        if meta is None:
            raise CheckpointError("tensor is not in this shard", file=self.path, tensor=name)
        dtype = SAFETENSORS_DTYPES.get(meta["dtype"])
        if dtype is None:
            raise CheckpointError(f"unsupported dtype {meta['dtype']!r}", file=self.path, tensor=name)
        begin, end = meta["data_offsets"]
        shape = tuple(meta["shape"])
        nbytes = math.prod(shape) * dtype.itemsize
        if end - begin != nbytes:
            raise CheckpointError(
                f"header gives {end - begin} bytes for {meta['dtype']} {list(shape)} ({nbytes} expected)",
                file=self.path,
                tensor=name,
            )
        return dtype, shape, self._data_start + begin, nbytes

    def _read_exact(self, position: int, view: memoryview, name: str, expected: int) -> None:
        self._f.seek(position)
        got = self._f.readinto(view)
        if got != len(view):
            raise CheckpointError(f"read {got} of {expected} bytes (truncated shard)", file=self.path, tensor=name)

    def read(self, name: str, *, pin_memory: bool = False, into: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor, read straight into a new CPU tensor (page-locked with `pin_memory`, for
        asynchronous host-to-device copies; torch's caching host allocator reuses those buffers), or into
        the front of `into` (a flat uint8 buffer the caller reuses; the result is a view of it)."""
        dtype, shape, position, nbytes = self._entry(name)
        if into is not None:
            if into.dtype != torch.uint8 or into.ndim != 1 or into.numel() < nbytes:
                raise ValueError(f"tensor {name}: {nbytes} bytes do not fit the {into.numel()}-byte buffer")
            out = into[:nbytes]
            if nbytes:
                self._read_exact(position, memoryview(out.numpy()), name, nbytes)
            return out.view(dtype).view(shape)
        out = torch.empty(shape, dtype=dtype, pin_memory=pin_memory)
        if nbytes == 0:
            return out
        self._read_exact(position, memoryview(out.reshape(-1).view(torch.uint8).numpy()), name, nbytes)
        return out

    def read_range(self, name: str, offset: int, view: memoryview) -> None:
        """Fill `view` with the bytes of tensor `name` from byte `offset` (for chunked copies)."""
        _, _, position, nbytes = self._entry(name)
        if offset < 0 or offset + len(view) > nbytes:
            raise ValueError(f"tensor {name}: bytes [{offset}, {offset + len(view)}) outside its {nbytes} bytes")
        self._read_exact(position + offset, view, name, nbytes)

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ShardFiles:
    """Lazily opened shards of one checkpoint folder, all closed together."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self._open: dict[str, ShardFile] = {}

    def shard(self, file: str) -> ShardFile:
        shard = self._open.get(file)
        if shard is None:
            shard = self._open[file] = ShardFile(self.root / file)
        return shard

    def read(self, file: str, name: str, *, pin_memory: bool = False, into: torch.Tensor | None = None) -> torch.Tensor:
        return self.shard(file).read(name, pin_memory=pin_memory, into=into)

    def close(self) -> None:
        for shard in self._open.values():
            shard.close()
        self._open.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
