"""Convert one source shard into one output shard.

The output layout is fixed by the plan, so the header is written first and every tensor streams to
disk as soon as it exists: pass-through tensors are copied file to file in chunks through reusable
buffers, and a job holds one scale group's INT4 inputs and NVFP4 outputs, never the shard. Writing and
hashing run on the writer's background thread, overlapping the next group's compute (bounded queue).
Source tensors are read with plain `readinto` (no mmap) and files close when the job ends. `peak_tensor_bytes` reports the most tensor bytes the job held at once
(numerics temporaries aside), so tests and benchmarks can check the bound.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..checkpoint.tensor_io import ShardFiles
from ..checkpoint.writer import (
    COPY_CHUNK_BYTES,
    WRITE_QUEUE_BYTES,
    StreamingShardWriter,
    WrittenShard,
)
from ..errors import CheckpointError
from ..numerics.methods import (
    Int4Matrix,
    ScaleMethod,
    error_stats,
    quantize_int4_matrices,
)
from .plan import ExpertMatrix, ShardJob

_QUEUE_SHARD_FRACTION = 4


@dataclass
class ShardResult:
    written: WrittenShard
    tensor_stats: dict[str, dict[str, Any]] = field(default_factory=dict)
    matrices: int = 0
    input_bytes: int = 0
    int4_input_bytes: int = 0
    peak_tensor_bytes: int = 0
    seconds: float = 0.0


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def check_group_scale(scale: torch.Tensor, m: ExpertMatrix) -> None:
    """INT4 group scales must be positive and finite (a zero scale erases a group; NaN poisons it)."""
    finite = torch.isfinite(scale)
    if not bool(finite.all()):
        bad = int((~finite).sum())
        raise CheckpointError(f"{bad} NaN/Inf group scales; expected positive finite bf16 scales", file=m.scale.file, tensor=m.scale.name)
    nonpos = int((scale <= 0).sum())
    if nonpos:
        raise CheckpointError(
            f"{nonpos} zero or negative group scales; expected positive finite bf16 scales", file=m.scale.file, tensor=m.scale.name
        )


class _PeakCounter:
    def __init__(self) -> None:
        self.peak = 0

    def observe(self, held: int) -> None:
        self.peak = max(self.peak, held)


def run_shard_job(
    job: ShardJob,
    source_root: Path,
    output_dir: Path,
    *,
    method: ScaleMethod,
    device: torch.device,
    record_stats: bool = True,
    on_progress: Callable[[int], None] | None = None,
) -> ShardResult:
    """Write `output_dir/job.file` (atomically). `on_progress(bytes)` is called as input is consumed.

    `record_stats`: compare every converted matrix with its exact INT4 values (`error_stats`); it does
    not change the output bytes (it reads the outputs after they are final).
    """
    # One CUDA stream per job so concurrent workers' kernels and copies overlap instead of queueing on the
    # default stream; `_to_host` waits on the job's own stream once per scale group before bytes are written.
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        return _run(
            job, source_root, output_dir, method=method, device=device, record_stats=record_stats, on_progress=on_progress
        )


def _to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """CPU copies of `tensors`: asynchronous copies into page-locked buffers, then ONE wait on the job's
    stream (instead of a synchronising `.cpu()` per tensor)."""
    if all(t.device.type == "cpu" for t in tensors):
        return tensors
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    for dst, src in zip(host, tensors):
        dst.copy_(src, non_blocking=True)
    torch.cuda.current_stream(tensors[0].device).synchronize()
    return host


def _run(
    job: ShardJob,
    source_root: Path,
    output_dir: Path,
    *,
    method: ScaleMethod,
    device: torch.device,
    record_stats: bool,
    on_progress: Callable[[int], None] | None,
) -> ShardResult:
    start = time.perf_counter()
    peak = _PeakCounter()
    stats: dict[str, dict[str, Any]] = {}
    matrices = 0
    # INT4 inputs are read into page-locked memory on CUDA so their copies to the device are asynchronous.
    pin = device.type == "cuda"
    # The write queue never holds more than a quarter of the shard (16 MB for real shards).
    queue_bytes = min(WRITE_QUEUE_BYTES, job.output_bytes // _QUEUE_SHARD_FRACTION)
    with (
        ShardFiles(source_root) as files,
        StreamingShardWriter(output_dir / job.file, job.output_specs(), max_pending_bytes=queue_bytes) as writer,
    ):
        for info in job.passthrough:
            # Copied file to file through the writer's reusable buffers: bytes only, never a whole tensor.
            shard = files.shard(info.file)
            writer.write_from(info.name, info.dtype, tuple(info.shape), functools.partial(shard.read_range, info.name))
            peak.observe(writer.pending_bytes + min(info.nbytes, COPY_CHUNK_BYTES))
            if on_progress:
                on_progress(info.nbytes)
        for group in job.groups:
            inputs = []
            held = writer.pending_bytes
            for m in group.matrices:
                packed = files.read(m.packed.file, m.packed.name, pin_memory=pin)
                scale = files.read(m.scale.file, m.scale.name, pin_memory=pin)
                check_group_scale(scale, m)
                held += _nbytes(packed) + _nbytes(scale)
                # The packed int32 words travel, not unpacked codes; unpacking runs on the device.
                inputs.append(
                    Int4Matrix.from_packed(
                        packed.to(device, non_blocking=True), scale.to(device, non_blocking=True), m.in_features
                    )
                )
            outputs = quantize_int4_matrices(inputs, method)
            held += sum(_nbytes(q.weight) + _nbytes(q.weight_scale) for q in outputs)
            peak.observe(held)
            mine = [(m, source, q) for m, source, q in zip(group.matrices, inputs, outputs) if job.writes(m)]
            # (a partner from another shard is converted here only for the shared scale)
            host = iter(_to_host([t for _, _, q in mine for t in (q.weight, q.weight_scale, q.weight_scale_2)]))
            for m, source, q in mine:
                if record_stats:
                    stats[m.module] = error_stats(source, q).to_dict()
                for suffix in ("weight", "weight_scale", "weight_scale_2"):
                    writer.write(f"{m.module}.{suffix}", next(host))
                matrices += 1
                if on_progress:
                    on_progress(m.int4_bytes)
            del inputs, outputs, mine, host
        written = writer.commit()
    return ShardResult(
        written=written,
        tensor_stats=stats,
        matrices=matrices,
        input_bytes=job.input_bytes,
        int4_input_bytes=job.int4_input_bytes,
        peak_tensor_bytes=peak.peak,
        seconds=time.perf_counter() - start,
    )
