"""Convert one source shard into one output shard.

The output layout is fixed by the plan, so the header is written first and every tensor streams to
disk as soon as it exists: pass-through tensors are copied file to file in chunks through reusable
buffers. Expert matrices are converted in batches of scale groups (`batches`): one group at a time on
CPU; on CUDA ~256 MB of INT4 input per batch with two batches in flight, so reading the next batch from
disk overlaps the device's work on the current one and the host reads results back once per batch.
Writing and hashing run on the writer's background threads (bounded queue). Source tensors are read
with plain `readinto` (no mmap) and files close when the job ends; on CUDA straight into the job's reused
page-locked buffers (`_InputRing`), so uploads are asynchronous. `peak_tensor_bytes` reports the most
tensor bytes the job held at once (numerics temporaries aside), so tests and benchmarks can check the bound.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..checkpoint.reader import TensorInfo
from ..checkpoint.tensor_io import ShardFiles
from ..checkpoint.writer import (
    COPY_CHUNK_BYTES,
    WRITE_QUEUE_BYTES,
    StreamingShardWriter,
    WrittenShard,
)
from ..errors import CheckpointError
from ..numerics.bf16_source import Bf16ScaleRule
from ..numerics.methods import Int4Matrix, ScaleMethod, quantize_int4_groups
from ..numerics.methods.stats import stats_from_sums
from .plan import ExpertMatrix, ScaleGroup, ShardJob
from .shared_experts import quantize_dense_group

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
    # Wall seconds of this job's thread per phase (see `_Phases`); background writing/hashing not included.
    phase_seconds: dict[str, float] = field(default_factory=dict)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# INT4 input bytes converted per batch. On CUDA a batch is ~10 K2.6 experts, so per-matrix kernel launches
# and the one read-back per batch amortise; two batches are in flight (one computing while the next is
# read). On CPU one scale group at a time: nothing to overlap, and the memory bound stays a group.
_BATCH_INT4_BYTES = {"cuda": 256 << 20}
_BATCHES_IN_FLIGHT = {"cuda": 2}


def batches(groups: list[ScaleGroup], device: torch.device, cap: int | None = None) -> Iterator[list[ScaleGroup]]:
    """Consecutive groups, at most `_BATCH_INT4_BYTES[device]` (and `cap`) of INT4 input per batch, at least
    one group per batch."""
    budget = _BATCH_INT4_BYTES.get(device.type, 0)
    if cap is not None:
        budget = min(budget, cap)
    batch: list[ScaleGroup] = []
    size = 0
    for group in groups:
        group_bytes = sum(m.int4_bytes for m in group.matrices)
        if batch and size + group_bytes > budget:
            yield batch
            batch, size = [], 0
        batch.append(group)
        size += group_bytes
    if batch:
        yield batch


def _raise_on_bad_scales(checks: list[list[int]], matrices: list[ExpertMatrix]) -> None:
    """INT4 group scales must be positive and finite (a zero scale erases a group; NaN poisons it)."""
    for (non_finite, non_positive), m in zip(checks, matrices):
        if non_finite:
            raise CheckpointError(
                f"{non_finite} NaN/Inf group scales; expected positive finite bf16 scales", file=m.scale.file, tensor=m.scale.name
            )
        if non_positive:
            raise CheckpointError(
                f"{non_positive} zero or negative group scales; expected positive finite bf16 scales",
                file=m.scale.file, tensor=m.scale.name,
            )


# Floating-point pass-through tensors (BF16 attention, shared experts, norms, embeddings; the float32 router bias)
# must hold finite values: a NaN/Inf there poisons every token. Checked chunk by chunk as the bytes are copied (the
# plan reads headers only; it does check the router biases' values, which are small).
FINITE_PASSTHROUGH_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def _finite_only(
    fill: Callable[[int, memoryview], None], info: TensorInfo
) -> Callable[[int, memoryview], None]:
    """`fill` that refuses NaN/Inf in the bytes it delivers (chunks start at multiples of the element size)."""

    def checked(offset: int, view: memoryview) -> None:
        fill(offset, view)
        values = torch.frombuffer(view, dtype=info.dtype)
        if not bool(torch.isfinite(values).all()):
            bad = int((~torch.isfinite(values)).sum())
            raise CheckpointError(
                f"{bad} NaN/Inf values (in bytes {offset}..{offset + len(view)} of the tensor); expected finite "
                f"{info.dtype} values", file=info.file, tensor=info.name,
            )

    return checked


class _Phases:
    """Seconds the job's own thread spends per phase: `passthrough` (copying unconverted tensors),
    `shared_experts` (reading, quantizing and writing BF16 shared experts, `--shared-experts nvfp4`),
    `read` (INT4 inputs from disk), `launch` (queueing uploads, kernels and copies), `wait` (for the
    device), `write` (handing results to the writer, including waits on its bounded queue), `commit`
    (draining the writer, fsync, rename). Summed over jobs in the conversion summary."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


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
    durable: bool = True,
    shared_expert_scales: Bf16ScaleRule = Bf16ScaleRule.AMAX,
) -> ShardResult:
    """Write `output_dir/job.file` (atomically; fsynced when `durable`). `on_progress(bytes)` is called as input
    is consumed.

    `record_stats`: compare every converted matrix with its exact INT4 values (`error_stats`); it does
    not change the output bytes (it reads the outputs after they are final).
    `shared_expert_scales`: block-scale rule of the BF16 shared experts the plan quantizes (`job.dense_groups`).
    """
    # One CUDA stream per job so concurrent workers' kernels and copies overlap instead of queueing on the
    # default stream; each batch records an event on it, waited on once before the batch's bytes are written.
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        return _run(
            job, source_root, output_dir, method=method, device=device, record_stats=record_stats,
            on_progress=on_progress, durable=durable, shared_expert_scales=shared_expert_scales,
        )


# Whether NVFP4 results travel to the host through fresh page-locked buffers (asynchronous copies, allocated
# through torch's caching host allocator) or through pageable memory (copied after the device finished the
# batch). Pageable measured 8-12 % faster end to end on the H200 with 8 workers (page-locking fresh buffers costs
# more than the blocking copies at 17 GB/s; docs/benchmarks.md). Inputs use `_PINNED_INPUT_RING` instead.
_PINNED_STAGING = {"cuda": False}
# Whether a CUDA job reads its INT4 inputs straight into a few page-locked buffers of its own, reused batch after
# batch (one per batch in flight), so each upload is an asynchronous DMA with no staging copy by the driver and
# no page-locking per batch (docs/benchmarks.md). Batch k reuses the buffer of batch k - depth, which has landed:
# its event, recorded after its uploads, was waited on.
_PINNED_INPUT_RING = {"cuda": True}
# Inputs start on this alignment inside a ring buffer (int32 and bf16 views need 4 and 2).
_RING_ALIGNMENT = 64


class _InputRing:
    """Page-locked input buffers of one job, one per batch in flight, grown to the largest batch."""

    def __init__(self, depth: int):
        self._buffers: list[torch.Tensor | None] = [None] * depth
        self._next = 0

    def take(self, nbytes: int) -> torch.Tensor:
        slot = self._next
        self._next = (self._next + 1) % len(self._buffers)
        buffer = self._buffers[slot]
        if buffer is None or buffer.numel() < nbytes:
            # Page-locked where CUDA exists (tests run this flow on CPU-only machines with plain memory).
            buffer = self._buffers[slot] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        return buffer


def _aligned(n: int) -> int:
    return -(-n // _RING_ALIGNMENT) * _RING_ALIGNMENT


@dataclass
class _Flight:
    """One batch between launch (inputs read, kernels and copies queued) and landing (bytes written)."""

    matrices: list[ExpertMatrix]  # every matrix of the batch, in order (partners from other shards too)
    results: list[torch.Tensor]  # per matrix weight, weight_scale, weight_scale_2; then checks; then stats
    ready: torch.cuda.Event | None
    held: int

    def host_results(self) -> list[torch.Tensor]:
        """`results` on the CPU, once the device has produced them."""
        if self.ready is not None:
            self.ready.synchronize()
        return [t if t.device.type == "cpu" else t.cpu() for t in self.results]


def _queue_host_copies(tensors: list[torch.Tensor], pinned: bool) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
    """Queue asynchronous copies of device `tensors` into page-locked buffers (when `pinned`) and record
    an event to wait on, instead of a synchronising `.cpu()` per tensor."""
    if all(t.device.type == "cpu" for t in tensors):
        return tensors, None
    if pinned:
        host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        for dst, src in zip(host, tensors):
            dst.copy_(src, non_blocking=True)
        tensors = host
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream())
    return tensors, event


def _launch(
    batch: list[ScaleGroup],
    files: ShardFiles,
    device: torch.device,
    method: ScaleMethod,
    record_stats: bool,
    phases: _Phases,
    ring: _InputRing | None = None,
) -> _Flight:
    """Read a batch's INT4 tensors, queue its conversion and the copies of its results to the host."""
    pinned = _PINNED_STAGING.get(device.type, False)
    matrices = [m for g in batch for m in g.matrices]
    host_inputs, held = [], 0
    with phases("read"):
        if ring is not None:
            sizes = [(t.nbytes, t) for m in matrices for t in (m.packed, m.scale)]
            buffer, offset = ring.take(sum(_aligned(n) for n, _ in sizes)), 0
            tensors = []
            for n, t in sizes:
                tensors.append(files.read(t.file, t.name, into=buffer[offset:]))
                offset += _aligned(n)
            host_inputs = list(zip(tensors[0::2], tensors[1::2]))
            held = offset
        else:  # pageable tensors of their own: each upload blocks until copied
            for m in matrices:
                packed = files.read(m.packed.file, m.packed.name)
                scale = files.read(m.scale.file, m.scale.name)
                held += _nbytes(packed) + _nbytes(scale)
                host_inputs.append((packed, scale))
    asynchronous = ring is not None
    with phases("launch"):
        # The packed int32 words travel, not unpacked codes; unpacking runs on the device.
        inputs = [
            Int4Matrix.from_packed(
                packed.to(device, non_blocking=asynchronous), scale.to(device, non_blocking=asynchronous), m.in_features
            )
            for m, (packed, scale) in zip(matrices, host_inputs)
        ]
        grouped, start = [], 0
        for g in batch:
            grouped.append(inputs[start : start + len(g.matrices)])
            start += len(g.matrices)
        outputs = quantize_int4_groups(grouped, method, record_stats=record_stats)
        if outputs.tensors is None:  # bad input found before any numerics (CPU): only the checks are meaningful
            tensors = [torch.zeros(()) for _ in range(3 * len(matrices))]
        else:
            tensors = [t for qs in outputs.tensors for q in qs for t in (q.weight, q.weight_scale, q.weight_scale_2)]
        held += sum(_nbytes(t) for t in tensors)
        extra = [outputs.checks] + ([outputs.stats] if record_stats and outputs.stats is not None else [])
        results, ready = _queue_host_copies(tensors + extra, pinned)
    return _Flight(matrices, results, ready, held)


def _run(
    job: ShardJob,
    source_root: Path,
    output_dir: Path,
    *,
    method: ScaleMethod,
    device: torch.device,
    record_stats: bool,
    on_progress: Callable[[int], None] | None,
    durable: bool,
    shared_expert_scales: Bf16ScaleRule,
) -> ShardResult:
    start = time.perf_counter()
    peak = _PeakCounter()
    phases = _Phases()
    stats: dict[str, dict[str, Any]] = {}
    matrices = 0
    # The write queue never holds more than a quarter of the shard (16 MB for real shards).
    queue_bytes = min(WRITE_QUEUE_BYTES, job.output_bytes // _QUEUE_SHARD_FRACTION)
    with (
        ShardFiles(source_root) as files,
        StreamingShardWriter(
            output_dir / job.file, job.output_specs(), max_pending_bytes=queue_bytes, durable=durable
        ) as writer,
    ):
        for info in job.passthrough:
            # Copied file to file through the writer's reusable buffers: bytes only, never a whole tensor.
            shard = files.shard(info.file)
            fill = functools.partial(shard.read_range, info.name)
            if info.dtype in FINITE_PASSTHROUGH_DTYPES:
                fill = _finite_only(fill, info)
            with phases("passthrough"):
                writer.write_from(info.name, info.dtype, tuple(info.shape), fill)
            peak.observe(writer.pending_bytes + min(info.nbytes, COPY_CHUNK_BYTES))
            if on_progress:
                on_progress(info.nbytes)
        # BF16 shared experts (`--shared-experts nvfp4`): one scale group at a time, in the plan's order.
        for dense_group in job.dense_groups:
            with phases("shared_experts"):
                quantized, held = quantize_dense_group(dense_group, files, device, shared_expert_scales)
                peak.observe(writer.pending_bytes + held)
                for m, q in zip(dense_group.matrices, quantized):
                    if not job.writes(m):
                        continue  # a partner from another shard, read here only for the shared scale
                    for suffix, tensor in (("weight", q.weight), ("weight_scale", q.weight_scale),
                                           ("weight_scale_2", q.weight_scale_2)):
                        writer.write(f"{m.module}.{suffix}", tensor)
                    matrices += 1
                    if on_progress:
                        on_progress(m.weight.nbytes)
        in_flight: deque[_Flight] = deque()
        depth = _BATCHES_IN_FLIGHT.get(device.type, 1)

        def land(flight: _Flight) -> None:
            nonlocal matrices
            with phases("wait"):
                host = flight.host_results()
            count = len(flight.matrices)
            tensors = host[: 3 * count]
            _raise_on_bad_scales(host[3 * count].tolist(), flight.matrices)
            rows = host[3 * count + 1].tolist() if record_stats else None
            for i, m in enumerate(flight.matrices):
                if not job.writes(m):
                    continue  # a partner from another shard, converted here only for the shared scale
                if rows is not None:
                    stats[m.module] = stats_from_sums(rows[i], m.out_features * m.in_features).to_dict()
                with phases("write"):
                    for j, suffix in enumerate(("weight", "weight_scale", "weight_scale_2")):
                        writer.write(f"{m.module}.{suffix}", tensors[3 * i + j])
                matrices += 1
                if on_progress:
                    on_progress(m.int4_bytes)

        # The batches in flight never hold more INT4 input than the shard has (and as much output), so small
        # shards keep the "about two shards" bound too; K2.6's shards are far larger than the batches.
        cap = max(1, job.int4_input_bytes // depth)
        ring = _InputRing(depth) if _PINNED_INPUT_RING.get(device.type, False) else None
        for batch in batches(job.groups, device, cap):
            if len(in_flight) >= depth:
                land(in_flight.popleft())  # also frees the ring buffer the next batch reuses
            in_flight.append(_launch(batch, files, device, method, record_stats, phases, ring))
            peak.observe(writer.pending_bytes + sum(f.held for f in in_flight))
        while in_flight:
            land(in_flight.popleft())
        with phases("commit"):
            written = writer.commit()
    return ShardResult(
        written=written,
        tensor_stats=stats,
        matrices=matrices,
        input_bytes=job.input_bytes,
        int4_input_bytes=job.int4_input_bytes,
        peak_tensor_bytes=peak.peak,
        seconds=time.perf_counter() - start,
        phase_seconds=phases.seconds,
    )
