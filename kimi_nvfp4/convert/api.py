"""`convert_checkpoint`: Kimi K2.x INT4 (compressed-tensors) -> NVFP4 in Model Optimizer's HF format.

Plan (headers only, fails before writing) -> per-shard jobs (serial, or a thread pool: torch
releases the GIL in its kernels and each job's bytes do not depend on scheduling) -> finish
(copy the other files byte for byte, hf_quant_config.json, config.json, index, manifest complete).
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ..stage_kit.disk_space import require_free_space
from ..checkpoint.file_stamps import FileStamp, save_stamps
from ..checkpoint.manifest import (
    ConversionManifest,
    ConversionSettings,
    ShardRecord,
    conversion_sha256,
    current_boot_id,
    save_manifest,
)
from ..checkpoint.nesting import refuse_nested
from ..distributed import RankContext, rank_context
from ..checkpoint.output_lock import output_lock
from ..checkpoint.modelopt_config import (
    HF_QUANT_CONFIG_NAME,
    ActivationScheme,
    build_modelopt_quant_config,
    declared_scheme,
    rewrite_config_for_nvfp4,
    summarize_exclude_modules,
)
from ..checkpoint.reader import CONFIG_NAME
from ..checkpoint.writer import partial_path, remove_quietly, write_failure, write_index, write_json_atomic
from ..numerics.bf16_source import Bf16ScaleRule
from ..numerics.methods import ScaleMethod
from .job import ShardResult, run_shard_job
from ..stage_kit.device import resolve_device
from .options import ConvertOptions
from .output import OutputState, prepare_output
from .plan import ConversionPlan, ShardJob, plan_conversion
from .ranks import JournalRecorder, assign_jobs, failure_of, raise_first_failure, remove_journals
from .shared_experts import SharedExperts
from .source import resolve_source, source_record
from .source_files import checked_source_path

_GB = 1e9


@dataclass
class ConversionSummary:
    output: str
    source: str
    device: str
    method: str
    workers: int  # per rank
    shards_total: int
    shards_converted: int
    shards_skipped: int
    matrices_converted: int
    tensors_passed_through: int
    bytes_in: int  # source tensor bytes read by the converted shards
    int4_bytes_in: int  # of which INT4 expert weight_packed + weight_scale
    bytes_out: int  # output shard file bytes written in this run
    seconds: float
    peak_tensor_bytes: int  # most tensor bytes one job held at once
    max_shard_bytes: int  # largest source shard (tensor bytes), the unit of the memory bound
    # seconds per phase summed over the shard jobs of this run (job threads only; see convert/job.py)
    phase_seconds: dict[str, float] = field(default_factory=dict)
    skipped_files: list[str] = field(default_factory=list)  # source files not copied, each with the reason
    # what the output declares: "w4a16" (weight-only) until calibrate installs the input scales
    activations: str = ActivationScheme.W4A16.value
    shared_experts: str = SharedExperts.BF16.value  # bf16 (copied) or nvfp4 (quantized; counted in matrices_converted)
    ranks: int = 1  # processes of a torch.distributed run (convert/ranks.py); each converted a share of the shards
    overwrite_removed: list[str] = field(default_factory=list)  # what --overwrite removed of the earlier conversion
    overwrite_kept: list[str] = field(default_factory=list)  # what it kept: not in the earlier manifest

    @property
    def gb_per_s(self) -> float:
        return self.bytes_in / _GB / self.seconds if self.seconds > 0 else 0.0

    @property
    def int4_gb_per_s(self) -> float:
        return self.int4_bytes_in / _GB / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "gb_per_s": self.gb_per_s, "int4_gb_per_s": self.int4_gb_per_s}

    def lines(self) -> list[str]:
        return [
            f"converted {self.matrices_converted} expert matrices to NVFP4, passed {self.tensors_passed_through} tensors through",
            f"shared experts: {self.shared_experts.upper()}",
            f"shards: {self.shards_converted} written, {self.shards_skipped} already finished, {self.shards_total} total",
            f"bytes: {self.bytes_in / _GB:.3f} GB in ({self.int4_bytes_in / _GB:.3f} GB INT4), {self.bytes_out / _GB:.3f} GB out",
            (
                f"time: {self.seconds:.2f} s on {self.device} x{self.workers}: {self.gb_per_s:.3f} GB/s in, "
                f"{self.int4_gb_per_s:.3f} GB/s INT4"
            ),
            self._activations_line(),
            f"output: {self.output}",
        ] + [f"not copied from the source: {f}" for f in self.skipped_files] + self._overwrite_lines()

    def _overwrite_lines(self) -> list[str]:
        out = []
        if self.overwrite_removed:
            out.append(f"--overwrite removed {len(self.overwrite_removed)} entries of the earlier conversion: "
                       + ", ".join(self.overwrite_removed))
        if self.overwrite_kept:
            out.append(f"--overwrite kept {len(self.overwrite_kept)} entries its manifest does not list: "
                       + ", ".join(self.overwrite_kept) + " (--overwrite-unlisted removes them)")
        return out

    def _activations_line(self) -> str:
        if self.activations == ActivationScheme.W4A4.value:
            return "activations: W4A4 declared (quant_algo NVFP4): every NVFP4 linear has its calibrated input_scale"
        return (
            "activations: weight-only declared (quant_algo W4A16_NVFP4, input_activations null) until "
            "`kimi-nvfp4 calibrate` writes the input scales and switches it to W4A4"
        )


def _sum_phases(results: list[ShardResult]) -> dict[str, float]:
    total: dict[str, float] = {}
    for r in results:
        for name, seconds in r.phase_seconds.items():
            total[name] = total.get(name, 0.0) + seconds
    return total


def _finish(
    plan: ConversionPlan, output: Path, manifest: ConversionManifest, kv_cache_quant_algo: str | None, durable: bool
) -> None:
    """Everything but the shards: copied files, quant configs, index, then the manifest marked complete."""
    exclude = summarize_exclude_modules(plan.bf16_linears, plan.quantized_modules)
    hf_quant_config, quantization_config = build_modelopt_quant_config(plan.layout, exclude, kv_cache_quant_algo)
    for rel in plan.other_files:
        dst = output / rel
        tmp = partial_path(dst)
        try:
            dst.parent.mkdir(parents=True, exist_ok=True)
            # Bytes only (checkpoint code is never imported), of a regular file inside the source's tree.
            shutil.copyfile(checked_source_path(plan.root, plan.trusted_root or plan.root, rel), tmp)
            os.replace(tmp, dst)
        except OSError as e:
            raise write_failure(e, dst, tmp, remove_quietly(tmp)) from None
    write_json_atomic(output / HF_QUANT_CONFIG_NAME, hf_quant_config, durable=durable)
    write_json_atomic(output / CONFIG_NAME, rewrite_config_for_nvfp4(plan.config, quantization_config), durable=durable)
    write_index(output, plan.weight_map, plan.total_size, durable=durable)
    manifest.complete = True
    save_manifest(output, manifest, durable=durable)


def convert_checkpoint(
    source: str | Path,
    output: str | Path,
    options: ConvertOptions | None = None,
    *,
    progress: bool = True,
    **overrides: Any,
) -> ConversionSummary:
    """Convert `source` (folder or Hub repo id) into `output`. Re-running resumes; see docs/convert.md.

    :param options: a `ConvertOptions` (convert/options.py: method, device, workers, kv_cache_quant_algo,
        shared_experts, shared_expert_scales, overwrite, revision, record_stats, fsync); its fields may also be given as keywords, which win.
        `record_stats=False` skips the per-matrix error statistics in the manifest (same output bytes, faster
        on CPU); `fsync=False` leaves write-back to the OS (same bytes; see convert/output.py for what a resume
        then checks).
    :param progress: show progress bars.
    :returns: the run's `ConversionSummary`.
    """
    opts = ConvertOptions.build(options, overrides, "convert_checkpoint")
    method, workers, kv_cache_quant_algo = opts.method, opts.workers, opts.kv_cache_quant_algo
    overwrite, record_stats, fsync = opts.overwrite, opts.record_stats, opts.fsync
    dev = resolve_device(opts.device)
    resolved = resolve_source(source, opts.revision)
    output = Path(output).expanduser()
    refuse_nested(resolved.path, output)  # before anything is written or deleted (--overwrite empties the output)
    output = output.resolve()
    plan = plan_conversion(resolved.path, resolved.trusted_root, opts.shared_experts)
    quantize_shared = opts.shared_experts is SharedExperts.NVFP4
    fresh = ConversionManifest(
        source=source_record(resolved, plan),
        settings=ConversionSettings(
            method=method.value, kv_cache_quant_algo=kv_cache_quant_algo, shared_experts=opts.shared_experts.value,
            # the rule changes no byte while the shared experts stay BF16
            shared_expert_scales=(opts.shared_expert_scales if quantize_shared else Bf16ScaleRule.AMAX).value,
            method_options=opts.method_config().model_dump(mode="json"),
        ),
    )
    start = time.perf_counter()
    ctx = rank_context(dev)
    dev = ctx.device(dev)
    # Under torchrun rank 0 alone owns the folder (lock, manifest, finish); see convert/ranks.py.
    with output_lock(output, "convert") if ctx.is_main else contextlib.nullcontext():
        state, record = _prepare(ctx, output, fresh, {j.file for j in plan.jobs}, overwrite=overwrite, durable=fsync,
                                 remove_unlisted=opts.overwrite_unlisted)
        todo = [job for job in plan.jobs if job.file not in state.finished]
        if opts.space_check and ctx.is_main and record is not None:  # each output shard ~ its source shard
            require_free_space(output, sum((plan.root / job.file).stat().st_size for job in todo), "convert")
        results: list[ShardResult] = []
        # A finished conversion is left untouched: calibrate may since have added input scales to its index.
        if record is not None:
            run = functools.partial(
                _run_jobs, plan=plan, record=record, method=method, device=dev, workers=workers,
                progress=progress and ctx.is_main, record_stats=record_stats,
                shared_expert_scales=opts.shared_expert_scales,
            )
            if ctx.distributed:
                results = _run_on_ranks(ctx, todo, run, record)
            else:
                results = run(todo)
            _finish_on_main(ctx, output, lambda: _finish(plan, output, state.manifest, kv_cache_quant_algo, durable=fsync))
    seconds = time.perf_counter() - start
    return ConversionSummary(
        output=str(output),
        source=str(resolved.repo_id or resolved.path),
        device=str(dev),
        method=method.value,
        workers=workers,
        ranks=ctx.world_size,
        shards_total=len(plan.jobs),
        shards_converted=len(results),
        shards_skipped=len(plan.jobs) - len(todo),
        matrices_converted=sum(r.matrices for r in results),
        tensors_passed_through=sum(len(j.passthrough) for j in todo),
        bytes_in=sum(r.input_bytes for r in results),
        int4_bytes_in=sum(r.int4_input_bytes for r in results),
        bytes_out=sum(r.written.bytes for r in results),
        seconds=seconds,
        peak_tensor_bytes=max((r.peak_tensor_bytes for r in results), default=0),
        phase_seconds=_sum_phases(results),
        max_shard_bytes=max((j.input_bytes for j in plan.jobs), default=0),
        skipped_files=[str(f) for f in plan.skipped_files],
        overwrite_removed=list(state.overwrite_removed),
        overwrite_kept=list(state.overwrite_kept),
        activations=declared_scheme(output).value,
        shared_experts=opts.shared_experts.value,
    )


def _prepare(
    ctx: RankContext, output: Path, fresh: ConversionManifest, shard_files: set[str], *, overwrite: bool, durable: bool,
    remove_unlisted: bool = False,
) -> tuple[OutputState, Any]:
    """The folder's state and this rank's shard recorder (None: nothing to do, the conversion is complete).

    Rank 0 checks and prepares the folder and starts the manifest (folding in other ranks' journals of an earlier
    run, then removing them) BEFORE any other rank starts writing; the others learn the finished shards from it.
    """
    state, record, error = None, None, None
    if ctx.is_main:
        try:
            state = prepare_output(output, fresh, overwrite=overwrite, remove_unlisted=remove_unlisted)
            if shard_files - state.finished or not state.was_complete:
                record = _ShardRecorder(output, state, durable=durable)
            remove_journals(output)  # their shards are in the manifest now (prepare_output)
        except Exception as e:  # noqa: BLE001 - every rank must hear of it before anyone raises
            if not ctx.distributed:
                raise
            error = e
    if not ctx.distributed:
        return state, record
    shared = ctx.broadcast_object(
        (failure_of(error), None if state is None else sorted(state.finished), record is not None)
    )
    failure, finished, work = shared
    raise_first_failure(ctx, [failure], error)
    if ctx.is_main:
        return state, record
    state = OutputState(fresh, set(finished), resumed=bool(finished), was_complete=not work)
    digest = conversion_sha256(fresh.settings, fresh.source.fingerprint)
    return state, (JournalRecorder(output, ctx.rank, digest, durable=durable) if work else None)


def _run_on_ranks(ctx: RankContext, todo: list[ShardJob], run, record) -> list[ShardResult]:
    """This rank's share of `todo`, then every rank's results (rank 0 records the others' in the manifest)."""
    mine = assign_jobs(todo, ctx.world_size)[ctx.rank]
    results: list[ShardResult] = []
    error = None
    try:
        results = run(mine)
    except Exception as e:  # noqa: BLE001 - reported to every rank below, then re-raised
        error = e
    outcomes = ctx.all_gather_object((results, failure_of(error)))
    raise_first_failure(ctx, [failure for _, failure in outcomes], error)
    by_file = {r.written.file: r for part, _ in outcomes for r in part}
    if ctx.is_main:
        for rank, (part, _) in enumerate(outcomes):
            if rank != ctx.rank:
                for result in part:
                    record(result)
    return [by_file[j.file] for j in todo if j.file in by_file]


def _finish_on_main(ctx: RankContext, output: Path, finish) -> None:
    """Rank 0 writes the rest of the folder; every rank returns only once it is complete (or fails as it did)."""
    error = None
    if ctx.is_main:
        try:
            finish()
            if ctx.distributed:
                remove_journals(output)  # every rank's shards are in the manifest now
        except Exception as e:  # noqa: BLE001
            if not ctx.distributed:
                raise
            error = e
    if ctx.distributed:
        raise_first_failure(ctx, [ctx.broadcast_object(failure_of(error))], error)


class _ShardRecorder:
    """Records each finished shard (manifest entry, settings digest, file stamp) as soon as it is renamed into
    place, so a killed run resumes after it. Thread-safe: jobs finish on pool threads."""

    def __init__(self, output: Path, state: OutputState, *, durable: bool):
        self.output = output
        self.manifest = state.manifest
        self.durable = durable
        self.settings_sha256 = conversion_sha256(self.manifest.settings, self.manifest.source.fingerprint)
        self.stamps = dict(state.stamps or {})
        self.lock = threading.Lock()
        self.manifest.complete = False
        self.manifest.boot_id = current_boot_id()
        save_manifest(output, self.manifest, durable=durable)

    def __call__(self, result: ShardResult) -> None:
        w = result.written
        with self.lock:
            self.manifest.shards[w.file] = ShardRecord(
                file=w.file, sha256=w.sha256, bytes=w.bytes, tensors=w.tensors, durable=self.durable,
                settings_sha256=self.settings_sha256,
            )
            self.manifest.tensor_stats.update(result.tensor_stats)
            stamp = FileStamp.of(self.output / w.file)
            if stamp is not None:
                self.stamps[w.file] = stamp
            # Stamps first: a stamp without a manifest record is ignored, a record without a stamp is re-hashed.
            save_stamps(self.output, self.stamps, durable=self.durable)
            save_manifest(self.output, self.manifest, durable=self.durable)


def _run_jobs(
    jobs: list[ShardJob],
    plan: ConversionPlan,
    record: _ShardRecorder,
    *,
    method: ScaleMethod,
    device: torch.device,
    workers: int,
    progress: bool,
    record_stats: bool,
    shared_expert_scales: Bf16ScaleRule,
) -> list[ShardResult]:
    """Run shard jobs; record each finished shard in the manifest as soon as it is renamed into place."""
    lock = threading.Lock()
    overall = tqdm(
        total=sum(j.input_bytes for j in jobs), unit="B", unit_scale=True, desc="convert", disable=not progress, position=0
    )
    free_positions = list(range(workers, 0, -1))
    results: dict[str, ShardResult] = {}

    def one(job: ShardJob) -> ShardResult:
        with lock:
            position = free_positions.pop()
        bar = tqdm(
            total=job.input_bytes, unit="B", unit_scale=True, desc=job.file, leave=False, disable=not progress, position=position
        )

        def advance(n: int) -> None:
            bar.update(n)
            with lock:
                overall.update(n)

        try:
            result = run_shard_job(
                job, plan.root, record.output, method=method, device=device, record_stats=record_stats,
                on_progress=advance, durable=record.durable, shared_expert_scales=shared_expert_scales,
            )
        finally:
            bar.close()
            with lock:
                free_positions.append(position)
        record(result)
        with lock:
            results[job.file] = result
        return result

    try:
        if workers == 1:
            for job in jobs:  # serial: simplest to debug, same bytes
                one(job)
        else:
            with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="convert") as pool:
                futures = [pool.submit(one, job) for job in jobs]
                try:
                    for future in as_completed(futures):
                        future.result()
                except BaseException:
                    for future in futures:
                        future.cancel()  # running jobs finish (and are recorded); queued ones never start
                    raise
    finally:
        overall.close()
    return [results[j.file] for j in jobs if j.file in results]
