"""Atomic safetensors shard and index writing.

A shard is serialised by hand (8-byte header length, JSON header, raw tensor bytes) so that:
- the bytes stream straight from each tensor's storage to the file: no second in-memory copy of
  the shard (`safetensors.torch.save` builds the whole file as one `bytes` object first);
- the sha256 is computed while writing, without reading the file back;
- the file is written as `.NAME.partial`, fsynced, then renamed: a crash or a full disk never
  leaves a file that looks finished (`durable=False` skips the fsync: the bytes reach the disk when the
  OS writes them back; only an OS crash or power loss before that can lose them, see convert/output.py);
- file writes and hashing run on background threads (both release the GIL), so the producer
  converts the next tensor meanwhile; the bytes waiting for them are bounded. Each chunk is hashed on a
  second thread while the first writes it: sha256 (~1.4 GB/s per stream on the H200 host) would otherwise
  add its time to every write instead of overlapping it.
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
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable
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
# Bytes queued for the background writer before the producer waits (one larger item is always allowed):
# enough to overlap a scale group's outputs with the next group's compute, small next to a shard.
WRITE_QUEUE_BYTES = 16 * 1024 * 1024
# Pass-through tensors are copied file to file through reusable buffers of this size (`write_from`).
COPY_CHUNK_BYTES = 8 * 1024 * 1024


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


def spec_nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    """Bytes a tensor of `dtype` and `shape` occupies in a safetensors file (no tensor is built)."""
    n = 1
    for d in shape:
        n *= d
    return n * torch.empty((), dtype=dtype).element_size()


def _tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a CPU tensor's bytes (copies only if not contiguous)."""
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


def remove_quietly(path: Path) -> OSError | None:
    """Remove a partial file while another error is being reported; returns the error if it could not be removed
    (on a read-only file system `unlink` fails too, and must not hide the first error behind a traceback)."""
    try:
        path.unlink(missing_ok=True)
    except OSError as e:
        return e
    return None


def write_failure(e: OSError, path: Path, partial: Path, not_removed: OSError | None) -> OutputError:
    """The one-line OutputError (exit 4) for a failed write of `path` through its partial file `partial`."""
    if e.errno == errno.ENOSPC:
        what = "disk full while writing"
    elif e.errno == errno.EROFS:
        what = "the output is on a read-only file system"
    else:
        what = f"cannot write ({e.strerror or e})"
    if not_removed is None:
        left = "the partial file was removed"
    else:
        left = f"the partial file {partial.name} could not be removed ({not_removed.strerror or not_removed})"
    return OutputError(f"file {path}: {what}; {left}")


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
        return spec_nbytes(self.dtype, self.shape)


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

    With `background=True` (default) a thread does the file writes and hashing in submission order;
    `write` returns once the tensor is queued (it keeps a reference, so the caller may drop its own) and
    waits while more than `max_pending_bytes` are queued. `pending_bytes` is what the queue holds now.
    `checksum=False` skips the sha256 (`WrittenShard.sha256` is then ""): for scratch files checked by size only
    (resume snapshots, stage_kit/resume.py), which would otherwise write no faster than one core hashes (~1.3 GB/s).
    """

    def __init__(
        self,
        path: str | Path,
        specs: list[TensorSpec],
        metadata: dict[str, str] | None = None,
        *,
        background: bool = True,
        max_pending_bytes: int = WRITE_QUEUE_BYTES,
        durable: bool = True,
        checksum: bool = True,
    ):
        self.path = Path(path)
        self._checksum = checksum
        self._durable = durable
        self._specs = list(specs)
        if len({s.name for s in self._specs}) != len(self._specs):
            raise ValueError(f"duplicate tensor names in the plan of {self.path.name}")
        self._next = 0
        self._tmp = partial_path(self.path)
        self._digest = hashlib.sha256()
        self._bytes = 0
        self._committed = False
        self._max_pending = max_pending_bytes
        self._queue: deque[tuple[memoryview, object]] = deque()
        self._pending = 0
        self._error: OSError | None = None
        self._closing = False
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._pool: list[bytearray] = []  # reusable copy buffers for write_from
        self._hasher: ThreadPoolExecutor | None = None
        head = _encode_header(self._specs, {"format": "pt", **(metadata or {})})
        try:
            self._f = self._tmp.open("wb")
            self._sink(memoryview(head))
        except OSError as e:
            raise self._failure(e) from None
        if background:
            if checksum:
                self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"sha256-{self.path.name}")
            self._thread = threading.Thread(target=self._drain, name=f"write-{self.path.name}", daemon=True)
            self._thread.start()

    @property
    def pending_bytes(self) -> int:
        return self._pending

    def _sink(self, chunk: memoryview) -> None:
        if self._hasher is not None:
            hashed = self._hasher.submit(self._digest.update, chunk)  # one thread: chunks hashed in order
            try:
                self._f.write(chunk)
            finally:
                hashed.result()
        else:
            self._f.write(chunk)
            if self._checksum:
                self._digest.update(chunk)
        self._bytes += len(chunk)

    def _drain(self) -> None:
        """Background thread: write and hash queued chunks in order until closed."""
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:
                    return
                chunk, owner = self._queue[0]
            try:
                if self._error is None:
                    self._sink(chunk)
            except OSError as e:
                self._error = e
            with self._cond:
                self._queue.popleft()
                self._pending -= len(chunk)
                if isinstance(owner, bytearray) and len(owner) == COPY_CHUNK_BYTES:
                    self._pool.append(owner)
                self._cond.notify_all()

    def _failure(self, e: OSError) -> OutputError:
        """Abort (close without flushing again, remove the partial file) and describe `e` as an OutputError."""
        return write_failure(e, self.path, self._tmp, self.abort())

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._failure(self._error) from None

    def _emit(self, chunk: memoryview, owner: object) -> None:
        """Queue `chunk` (kept alive by `owner`), or write it now without a background thread."""
        if self._thread is None:
            try:
                self._sink(chunk)
            except OSError as e:
                raise self._failure(e) from None
            if isinstance(owner, bytearray) and len(owner) == COPY_CHUNK_BYTES:
                self._pool.append(owner)
            return
        with self._cond:
            while self._pending and self._pending + len(chunk) > self._max_pending and self._error is None:
                self._cond.wait()
            if self._error is None:
                self._queue.append((chunk, owner))
                self._pending += len(chunk)
                self._cond.notify_all()
        self._raise_if_failed()  # outside the lock: abort() joins the thread, which needs it

    def _take_spec(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> TensorSpec:
        if self._next >= len(self._specs):
            raise ValueError(f"tensor {name}: {self.path.name} expected no more tensors")
        spec = self._specs[self._next]
        if name != spec.name or dtype != spec.dtype or tuple(shape) != spec.shape:
            raise ValueError(
                f"tensor {name} {dtype} {list(shape)}: {self.path.name} expected "
                f"{spec.name} {spec.dtype} {list(spec.shape)} next"
            )
        return spec

    def write(self, name: str, tensor: torch.Tensor) -> None:
        self._take_spec(name, tensor.dtype, tuple(tensor.shape))
        data = _tensor_bytes(tensor if tensor.device.type == "cpu" else tensor.cpu())
        for start in range(0, data.numel(), _WRITE_CHUNK_BYTES):
            part = data[start : start + _WRITE_CHUNK_BYTES]
            self._emit(memoryview(part.numpy()), part)
        self._next += 1

    def write_from(
        self, name: str, dtype: torch.dtype, shape: tuple[int, ...], fill: Callable[[int, memoryview], None]
    ) -> None:
        """Write the next tensor from a byte source: `fill(offset, view)` fills `view` with its bytes from
        `offset` (e.g. `ShardFile.read_range`). Copies through at most a few reusable buffers, so a
        pass-through tensor of any size never exists whole in memory."""
        spec = self._take_spec(name, dtype, shape)
        total = spec.nbytes
        for offset in range(0, total, COPY_CHUNK_BYTES):
            size = min(COPY_CHUNK_BYTES, total - offset)
            if size < COPY_CHUNK_BYTES:
                buffer = bytearray(size)  # a small tensor (or the tail): no need for a full buffer
            else:
                with self._cond:
                    buffer = self._pool.pop() if self._pool else bytearray(COPY_CHUNK_BYTES)
            view = memoryview(buffer)[:size]
            fill(offset, view)
            self._emit(view, buffer)
        self._next += 1

    def _stop_thread(self) -> None:
        if self._thread is None:
            return
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None
        if self._hasher is not None:
            self._hasher.shutdown(wait=True)
            self._hasher = None

    def commit(self) -> WrittenShard:
        if self._next != len(self._specs):
            missing = self._specs[self._next].name
            self.abort()
            raise ValueError(f"{self.path.name}: tensor {missing} was never written")
        self._stop_thread()  # writes everything queued
        self._raise_if_failed()
        try:
            self._f.flush()
            if self._durable:
                os.fsync(self._f.fileno())
            self._f.close()
            os.replace(self._tmp, self.path)
        except OSError as e:
            raise self._failure(e) from None
        self._committed = True
        sha256 = self._digest.hexdigest() if self._checksum else ""
        return WrittenShard(self.path.name, sha256, self._bytes, len(self._specs))

    def abort(self) -> OSError | None:
        """Close and remove the partial file (idempotent; never raises, since it runs while an error is reported).
        Returns the error that kept the partial file from being removed, if any."""
        if getattr(self, "_thread", None) is not None:
            self._error = self._error or OSError("aborted")  # the thread drops what is still queued
            self._stop_thread()
        f = getattr(self, "_f", None)
        if f is not None and not f.closed:
            try:
                f.close()  # flushes what is buffered: on a full disk that fails again, and the file is closed anyway
            except OSError:
                pass
        return remove_quietly(self._tmp)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        if not self._committed:
            self.abort()


def write_bytes_atomic(path: str | Path, data: bytes, *, durable: bool = True) -> None:
    """Write a small file under a temporary name, fsync (unless not `durable`), rename."""
    path = Path(path)
    tmp = partial_path(path)
    try:
        with tmp.open("wb") as f:
            f.write(data)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        raise write_failure(e, path, tmp, remove_quietly(tmp)) from None


def write_text_atomic(path: str | Path, text: str, *, durable: bool = True) -> None:
    """`write_bytes_atomic` of UTF-8 text."""
    write_bytes_atomic(path, text.encode("utf-8"), durable=durable)


def write_json_atomic(path: str | Path, obj: Any, *, durable: bool = True) -> None:
    write_bytes_atomic(path, (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode(), durable=durable)


def write_index(root: str | Path, weight_map: dict[str, str], total_size: int, *, durable: bool = True) -> Path:
    """Write `model.safetensors.index.json` (HF format: metadata.total_size = tensor bytes, no headers)."""
    path = Path(root) / INDEX_NAME
    index = {"metadata": {"total_size": int(total_size)}, "weight_map": dict(sorted(weight_map.items()))}
    write_json_atomic(path, index, durable=durable)
    return path


def sha256_file(path: str | Path, bar: Any = None, chunk: int = 16 * 1024 * 1024) -> str:
    """Streaming sha256 of one file (bounded memory for 10 GB shards); `bar`: a tqdm bar advanced by the bytes
    read (convert's resume checks, publish's shard checks, validate's verdict)."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        while block := f.read(chunk):
            digest.update(block)
            if bar is not None:
                bar.update(len(block))
    return digest.hexdigest()
