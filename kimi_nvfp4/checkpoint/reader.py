"""Lazy, header-first access to a sharded safetensors checkpoint.

`CheckpointReader` parses config.json, the index and every shard *header* (a few KB each) up
front, without touching tensor data, so a plan can be checked against a 595 GB checkpoint in
seconds. Tensor data is read on demand, one tensor at a time, through safetensors' mmap.
"""

from __future__ import annotations

import json
import math
import os
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path, PurePath
from typing import Any, Iterable

import torch
from safetensors import safe_open

from ..errors import CheckpointError
from .layout import CheckpointLayout

# Shards kept open (memory-mapped) at once by one reader; more than convert's workers read at a time.
MAX_OPEN_SHARDS = 16

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


def _header_error(path: Path, message: str, tensor: str | None = None) -> CheckpointError:
    return CheckpointError(f"safetensors header: {message}", file=path, tensor=tensor)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _tensor_entry(path: Path, name: str, meta: Any, data_start: int, size: int) -> tuple[TensorInfo, int, int]:
    """One header entry checked against the safetensors format: (info, begin, end) of its data."""
    if not isinstance(meta, dict):
        raise _header_error(path, f"entry is {type(meta).__name__}, expected an object with dtype, shape, "
                                  "data_offsets", name)
    dtype = SAFETENSORS_DTYPES.get(meta.get("dtype")) if isinstance(meta.get("dtype"), str) else None
    if dtype is None:
        raise CheckpointError(f"unsupported dtype {meta.get('dtype')!r}", file=path, tensor=name)
    shape, offsets = meta.get("shape"), meta.get("data_offsets")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise _header_error(path, f"shape {shape!r} is not a list of non-negative integers", name)
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets):
        raise _header_error(path, f"data_offsets {offsets!r} is not [begin, end] (missing or malformed)", name)
    begin, end = offsets
    nbytes = math.prod(shape) * dtype.itemsize
    if end - begin != nbytes:
        raise _header_error(path, f"data_offsets [{begin}, {end}] hold {end - begin} bytes but {meta['dtype']} "
                                  f"{shape} needs {nbytes}", name)
    if data_start + end > size:
        raise CheckpointError(
            f"data ends at byte {data_start + end} but the file has {size} bytes (truncated shard)", file=path,
            tensor=name,
        )
    return TensorInfo(name, path.name, dtype, tuple(shape), nbytes), begin, end


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Parse one shard's header and check it as safetensors itself does before any data is read: every entry
    well-formed, its byte span the size its dtype and shape need, inside the file, and no two spans overlapping
    (an overlap would hand one tensor another's bytes)."""
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
    if not isinstance(header, dict):
        raise _header_error(path, f"is a JSON {type(header).__name__}, expected an object of tensors")
    data_start = _HEADER_LEN.size + n
    out: dict[str, TensorInfo] = {}
    spans: list[tuple[int, int, str]] = []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        info, begin, end = _tensor_entry(path, name, meta, data_start, size)
        out[name] = info
        if end > begin:
            spans.append((begin, end, name))
    spans.sort()
    for (_, prev_end, prev), (begin, _, name) in zip(spans, spans[1:]):
        if begin < prev_end:
            raise _header_error(path, f"data_offsets overlap those of {prev} (bytes from {begin} to {prev_end} "
                                      "would belong to both)", name)
    return out


def _read_json_object(path: Path) -> dict[str, Any]:
    """A JSON file that must hold an object (config.json, the index)."""
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise CheckpointError(f"not valid JSON ({e})", file=path) from None
    except OSError as e:
        raise CheckpointError(f"cannot read it ({e.strerror or e})", file=path) from None
    if not isinstance(data, dict):
        raise CheckpointError(f"is a JSON {type(data).__name__}, expected an object", file=path)
    return data


def _check_shard_name(index: Path, tensor: Any, file: Any) -> None:
    """Index values are shard file names in the checkpoint folder itself: no subfolders, no `..`, not absolute,
    not hidden (the reader, convert's output and every engine treat shards as files at the top of the folder)."""
    if not isinstance(tensor, str) or not isinstance(file, str):
        raise CheckpointError(f"index is malformed (weight_map entry {tensor!r}: {file!r}; expected a tensor name "
                              "and a shard file name, both strings)", file=index,
                              tensor=tensor if isinstance(tensor, str) else None)
    if not file or "/" in file or "\\" in file or file.startswith(".") or PurePath(file).is_absolute():
        raise CheckpointError(f"index names shard {file!r}; expected a plain file name in the checkpoint folder "
                              "(no subfolder, no '..', not absolute, not hidden)", file=index, tensor=tensor)


class CheckpointReader:
    """A checkpoint folder: config, layout, tensor headers, and on-demand tensor loading."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        if not self.root.is_dir():
            raise CheckpointError("checkpoint folder does not exist", file=self.root)
        from .scheme_journal import recover_scheme_switch  # scheme_journal -> writer -> reader

        recover_scheme_switch(self.root)  # config.json and hf_quant_config.json agree before either is read
        config_path = self.root / CONFIG_NAME
        if not config_path.is_file():
            raise CheckpointError("config.json is missing", file=config_path)
        self.config: dict[str, Any] = _read_json_object(config_path)
        self.weight_map: dict[str, str] = self._read_weight_map()
        self._handles: OrderedDict[str, Any] = OrderedDict()
        self._handles_lock = threading.Lock()
        self._unindexed: dict[str, list[str]] = {}

    # --- structure ----------------------------------------------------------------------
    def _read_weight_map(self) -> dict[str, str]:
        index = self.root / INDEX_NAME
        if index.is_file():
            weight_map = _read_json_object(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"index is malformed (weight_map is {type(weight_map).__name__}, expected an "
                                      "object of tensor name -> shard file)", file=index)
            for name, file in weight_map.items():
                _check_shard_name(index, name, file)
            return dict(weight_map)
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
            unindexed = sorted(set(header) - set(names))
            if unindexed:
                self._unindexed[file] = unindexed
        return infos

    @property
    def unindexed_tensors(self) -> dict[str, list[str]]:
        """Shard file -> tensors its header holds that the index does not name (engines load by the index, so a
        conversion would drop them; validate's own corruptions make such checkpoints on purpose)."""
        self.tensors  # noqa: B018 - reads the headers
        return dict(self._unindexed)

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
        # At most MAX_OPEN_SHARDS shards stay mapped: every page a mapped shard was read through counts in the
        # process's RSS (and a container's memory accounting) until it is unmapped, which over a 61-layer stage
        # read the whole source into the RSS (bench/results/rehearsal_61l_8e_64x2048_h200.json: +0.45 GiB a layer).
        with self._handles_lock:
            h = self._handles.get(file)
            if h is not None:
                self._handles.move_to_end(file)
                return h
        path = self.root / file
        try:
            h = safe_open(str(path), framework="pt", device="cpu")
        except Exception as e:  # safetensors raises its own error types
            raise CheckpointError(f"cannot open shard ({e})", file=path) from None
        with self._handles_lock:
            self._handles[file] = h
            while len(self._handles) > MAX_OPEN_SHARDS:
                self._handles.popitem(last=False)
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
        with self._handles_lock:
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
