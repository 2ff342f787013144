"""Lazy, header-first access to a sharded safetensors checkpoint.

`CheckpointReader` parses config.json, the index and every shard *header* (a few KB each) up
front, without touching tensor data, so a plan can be checked against a 595 GB checkpoint in
seconds. Tensor data is read on demand, one tensor at a time, through safetensors' mmap.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Iterable

import torch
from safetensors import safe_open

from ..errors import CheckpointError
from .layout import CheckpointLayout

INDEX_NAME = "model.safetensors.index.json"
SINGLE_SHARD_NAME = "model.safetensors"
CONFIG_NAME = "config.json"

# safetensors dtype strings -> torch dtypes (https://github.com/huggingface/safetensors, format spec)
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_HEADER_LEN = struct.Struct("<Q")
_MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    """Where a tensor lives and what it is, from the shard header alone."""

    name: str
    file: str  # shard file name, relative to the checkpoint folder
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Parse one shard's header and check that every tensor's bytes lie inside the file."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            raw = f.read(_HEADER_LEN.size)
            if len(raw) < _HEADER_LEN.size:
                raise CheckpointError("file is shorter than a safetensors header (truncated?)", file=path)
            (n,) = _HEADER_LEN.unpack(raw)
            if n > _MAX_HEADER_BYTES or n + _HEADER_LEN.size > size:
                raise CheckpointError(f"header length {n} exceeds the file size {size} (truncated?)", file=path)
            header = json.loads(f.read(n))
    except FileNotFoundError:
        raise CheckpointError("shard file is missing", file=path) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"header is not valid JSON ({e})", file=path) from None
    data_start = _HEADER_LEN.size + n
    out: dict[str, TensorInfo] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        dtype = SAFETENSORS_DTYPES.get(meta.get("dtype"))
        if dtype is None:
            raise CheckpointError(f"unsupported dtype {meta.get('dtype')!r}", file=path, tensor=name)
        begin, end = meta["data_offsets"]
        if data_start + end > size:
            raise CheckpointError(
                f"data ends at byte {data_start + end} but the file has {size} bytes (truncated shard)",
                file=path,
                tensor=name,
            )
        out[name] = TensorInfo(name, path.name, dtype, tuple(meta["shape"]), end - begin)
    return out


class CheckpointReader:
    """A checkpoint folder: config, layout, tensor headers, and on-demand tensor loading."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        if not self.root.is_dir():
            raise CheckpointError("checkpoint folder does not exist", file=self.root)
        config_path = self.root / CONFIG_NAME
        if not config_path.is_file():
            raise CheckpointError("config.json is missing", file=config_path)
        try:
            self.config: dict[str, Any] = json.loads(config_path.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"not valid JSON ({e})", file=config_path) from None
        self.weight_map: dict[str, str] = self._read_weight_map()
        self._handles: dict[str, Any] = {}

    # --- structure ----------------------------------------------------------------------
    def _read_weight_map(self) -> dict[str, str]:
        index = self.root / INDEX_NAME
        if index.is_file():
            try:
                data = json.loads(index.read_text())
                return dict(data["weight_map"])
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"index is malformed ({e})", file=index) from None
        single = self.root / SINGLE_SHARD_NAME
        if single.is_file():
            return {name: SINGLE_SHARD_NAME for name in read_safetensors_header(single)}
        raise CheckpointError(f"neither {INDEX_NAME} nor {SINGLE_SHARD_NAME} found", file=self.root)

    @cached_property
    def layout(self) -> CheckpointLayout:
        return CheckpointLayout.from_config(self.config)

    @property
    def shard_files(self) -> list[str]:
        return sorted(set(self.weight_map.values()))

    @cached_property
    def tensors(self) -> dict[str, TensorInfo]:
        """Header info of every tensor the index names, checked against the shard headers."""
        by_file: dict[str, list[str]] = {}
        for name, file in self.weight_map.items():
            by_file.setdefault(file, []).append(name)
        infos: dict[str, TensorInfo] = {}
        for file, names in sorted(by_file.items()):
            header = read_safetensors_header(self.root / file)
            for name in names:
                if name not in header:
                    raise CheckpointError("the index names this tensor but the shard lacks it", file=file, tensor=name)
                infos[name] = header[name]
        return infos

    def shard_tensors(self, file: str) -> list[str]:
        return sorted(n for n, f in self.weight_map.items() if f == file)

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise CheckpointError("tensor is not in the checkpoint index", file=INDEX_NAME, tensor=name) from None

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    # --- data ---------------------------------------------------------------------------
    def _handle(self, file: str):
        h = self._handles.get(file)
        if h is None:
            path = self.root / file
            try:
                h = safe_open(str(path), framework="pt", device="cpu")
            except Exception as e:  # safetensors raises its own error types
                raise CheckpointError(f"cannot open shard ({e})", file=path) from None
            self._handles[file] = h
        return h

    def load(self, name: str) -> torch.Tensor:
        """Read one tensor (a fresh CPU tensor; the mmap is not kept referenced)."""
        file = self.weight_map.get(name)
        if file is None:
            raise CheckpointError("tensor is not in the checkpoint index", file=INDEX_NAME, tensor=name)
        try:
            return self._handle(file).get_tensor(name)
        except Exception as e:
            raise CheckpointError(f"cannot read tensor data ({e})", file=self.root / file, tensor=name) from None

    def load_many(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        return {n: self.load(n) for n in names}

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def other_files(self) -> list[Path]:
        """Every non-weight file (tokenizer, templates, remote code...), relative to the root."""
        skip = set(self.shard_files) | {INDEX_NAME}
        out = []
        for dirpath, _dirs, files in os.walk(self.root):
            for f in files:
                rel = Path(dirpath, f).relative_to(self.root)
                if str(rel) not in skip and not str(rel).startswith("."):
                    out.append(rel)
        return sorted(out)
