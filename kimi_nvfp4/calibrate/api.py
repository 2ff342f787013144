"""`calibrate_checkpoint`: static activation scales (`input_scale`) for every NVFP4 linear.

Per decoder layer L (the served model is emulated throughout: earlier layers already W4A4 with the
scales just computed, SGLang's input-scale reduction applied), with the layer loaded ONCE:
1. attention once (BF16 in K2.6, identical in both passes; recomputed in step 4 only when the layer
   has NVFP4 linears outside its MLP);
2. observe: the MLP with its NVFP4 weights and UNquantized activations (W4A16), statistics only,
   recording the input amax / per-channel mean square of every linear, routed-token counts per
   expert, and for `route-all` also every token through every expert;
3. choose: per expert one amax for gate/up (shared) and one for down, applying the policy for
   experts with fewer than `min_expert_tokens` tokens; scale = amax / (6 * 448);
4. advance: the same loaded weights switched to W4A4 with those scales (`set_activations`), the MLP
   again from the post-attention residual, giving layer L+1's input.
Memory: one layer's weights (dequantized once if `materialize` decides so) plus the hidden states.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from ..checkpoint.output_lock import holds_output_lock
from ..checkpoint.reader import CheckpointReader
from ..errors import CheckpointError
from ..distributed import RankContext, rank_context
from ..stage_kit.device import dtype_name, resolve_device, resolve_dtype
from ..stage_kit.disk_space import warn_if_snapshots_cannot_fit
from ..stage_kit.memory_plan import announce, apply_gpu_cap, out_of_memory
from .layer_loop import CalibrationRun, quantized_modules, run_calibration
from .memory import calibration_plan, method_solve_plan
from .options import DEFAULT_SAMPLES, DEFAULT_SEQ_LEN, CalibrateOptions
from ..stage_kit.output_paths import require_writable_dir
from ..stage_kit.pairing import require_converted, require_matching_source
from .report import REPORT_JSON, CalibrationReport, CalibrationSettings, write_calibration_report
from ..stage_kit.samples import HELDOUT_FRACTION, DataPart, load_sample_set
from ..data.window_pick import CALIBRATION_WINDOWS_RECORD, calibration_window_hashes
from .shard import (
    CALIBRATE_STAGE,
    install_input_scales,
    require_no_misplaced_input_scales,
)
from .resume import calibration_fingerprint
from ..stage_kit.resume import ResumeStore
from .kv_cache import FP8_KV_CACHE_ALGO, declared_kv_cache_algo, kv_cache_scales
from .expert_stats import ExpertStatsMode
from .expert_stats_file import EXPERT_STATS_DIR
from .expert_stats_hook import EXPERT_STATS_RECORD, ExpertStatsHook
from .fused_finalize import PendingFinalize
from .fused_method import FUSED_RECORD, FusedMethodHook, finalize, pending_finalize

# Reports and per-layer statistics go here, inside the output folder.
CALIBRATION_DIR = "calibration"
ACTIVATION_STATS_DIR = "activation_stats"


def _settings(data: str, opts: CalibrateOptions, dtype: str) -> CalibrationSettings:
    return CalibrationSettings(data=data, samples=opts.samples, seq_len=opts.seq_len, seed=opts.seed,
                               min_expert_tokens=opts.min_expert_tokens, policy=opts.policy.value,
                               heldout_fraction=HELDOUT_FRACTION, dtype=dtype)


def _stage_settings(data: str, opts: CalibrateOptions, dtype: str) -> dict[str, Any]:
    """What the calibrate stage records as its settings (`dtype`: the compute dtype's name)."""
    return {**_settings(data, opts, dtype).model_dump(), **opts.recorded_expert_stats(), **opts.recorded_method()}


def _finish_pending(output: Path, pending: PendingFinalize, ctx: RankContext,
                    resume: ResumeStore) -> CalibrationReport:
    """A fused run killed during finalize: its input scales and report were written before finalize started, so only
    the expert shards are left (rank 0 writes them); returns the report that run wrote."""
    ctx.barrier()  # every rank has read the manifest before rank 0 changes it
    if not ctx.is_main:
        ctx.barrier()
        return ctx.broadcast_object(None)
    from ..checkpoint.manifest import load_manifest

    pending.finish(output)
    where = Path(load_manifest(output).stages[CALIBRATE_STAGE].outputs["report"])
    path = (where if where.is_absolute() else output / where) / REPORT_JSON
    try:
        report = CalibrationReport.model_validate_json(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"the calibration report of the finished run cannot be read ({e})", file=path) from None
    resume.finish()
    if ctx.distributed:
        ctx.barrier()
        ctx.broadcast_object(report)
    return report


@holds_output_lock("calibrate", "output")  # one writer per checkpoint folder (checkpoint/output_lock.py)
def calibrate_checkpoint(
    output: str | Path,
    source: str | Path,
    data: str,
    options: CalibrateOptions | None = None,
    *,
    progress: bool = True,
    report_dir: str | Path | None = None,
    save_activation_stats: bool = True,
    **overrides: Any,
) -> CalibrationReport:
    """Compute and install `input_scale` for every NVFP4 linear of the converted checkpoint `output`.

    Checks everything (converted output, matching source, usable data) before computing, and
    writes nothing unless the whole calibration succeeded.

    :param output: the converted NVFP4 checkpoint folder (gets the input-scale shard, index and manifest entry).
    :param source: the INT4 checkpoint it was converted from (checked against it).
    :param data: a data spec (jsonl:PATH, hf:NAME[:SPLIT], tree:PATH, builtin, sample; comma-separated to mix).
    :param options: a `CalibrateOptions` (calibrate/options.py); its fields may also be given as keywords.
    :param report_dir: where the report goes (default `output/calibration`).
    :param save_activation_stats: also write per-layer activation statistics beside the report.
    :returns: the `CalibrationReport` (also written to `report_dir`).
    """
    opts = CalibrateOptions.build(options, overrides, "calibrate_checkpoint")
    samples, seq_len, seed, min_expert_tokens = opts.samples, opts.seq_len, opts.seed, opts.min_expert_tokens
    device, dtype, generated_sessions = opts.device, opts.dtype, opts.generated_sessions
    started = time.perf_counter()
    policy = opts.policy
    output, source = Path(output), Path(source)
    for folder in (output, report_dir) if report_dir is not None else (output,):  # before the first layer
        require_writable_dir(folder, what="calibrate's output folder")
    out_reader = CheckpointReader(output)
    require_converted(out_reader)
    require_matching_source(CheckpointReader(source), out_reader)
    require_no_misplaced_input_scales(out_reader)
    dev = resolve_device(device)
    ctx = rank_context(dev)
    dev = ctx.device(dev)
    compute_dtype = resolve_dtype(dtype, dev)  # a bad name fails before the data is loaded
    kv_fp8 = declared_kv_cache_algo(output) == FP8_KV_CACHE_ALGO  # `convert --kv-cache none`: no KV scales
    sample_set = load_sample_set(output, data, part=DataPart.CALIBRATION, samples=samples, seq_len=seq_len,
                                 seed=seed, generated_sessions=generated_sessions)
    calib_dir = Path(report_dir) if report_dir is not None else output / CALIBRATION_DIR
    # always inside the output (requantize reads them there), wherever the report goes
    if opts.method is not None and opts.expert_stats is not ExpertStatsMode.NONE:
        raise ValueError("calibrate: --method keeps the expert statistics in memory; --expert-stats writes them for "
                         "requantize (use --keep-expert-stats with --method to keep them too)")
    expert_hook = None if opts.expert_stats is ExpertStatsMode.NONE else ExpertStatsHook(
        opts.expert_stats, output / CALIBRATION_DIR / EXPERT_STATS_DIR)
    mine = ctx.shard(sample_set.sequences)
    stats_dir = calib_dir / ACTIVATION_STATS_DIR if save_activation_stats else None
    plan = calibration_plan(out_reader.layout.text, opts, dev, compute_dtype, sum(int(s.numel()) for s in mine))
    pending = None  # a fused run killed during finalize, which this same command finishes (fused_finalize.py)
    if opts.method is not None:
        pending = pending_finalize(output, opts.method.value, opts.method_config().model_dump(mode="json"),
                                   _stage_settings(data, opts, dtype_name(compute_dtype)))
    if opts.method is not None and pending is None:
        solve = method_solve_plan(out_reader.layout.text, opts, plan, dev)
        expert_hook = FusedMethodHook(
            opts.method.value, opts.method_config().model_dump(mode="json"), output, CheckpointReader(source),
            out_reader, batch_experts=solve.batch_experts,
            group_experts=min(ctx.all_gather_object(solve.group_experts)),  # every rank runs the same passes
            keep_stats_dir=output / CALIBRATION_DIR / EXPERT_STATS_DIR if opts.keep_expert_stats else None,
            propagation=opts.propagation.value)
    apply_gpu_cap(dev, opts.gpu_memory)
    announce(plan, progress and ctx.is_main)
    warn_if_snapshots_cannot_fit(plan.snapshot_bytes, output, opts.resume_every, "calibrate")
    resume = ResumeStore(output, CALIBRATE_STAGE, ctx, calibration_fingerprint(
        out_reader, ctx, data, mine, opts, device=dev, dtype=compute_dtype, stats_dir=stats_dir, kv_cache=kv_fp8), every=opts.resume_every,
        max_overhead=opts.resume_max_overhead)
    if pending is not None:
        return _finish_pending(output, pending, ctx, resume)
    try:
        run = run_calibration(
            out_reader, mine, policy=policy, min_expert_tokens=min_expert_tokens, device=dev,
            max_chunk_tokens=plan.chunk_tokens, states_device=plan.states_device, stats_dir=stats_dir,
            progress=progress and ctx.is_main, dtype=dtype, ctx=ctx, kv_cache=kv_fp8, expert_stats=expert_hook,
            resume=resume, snapshot=resume.load(), materialize=plan.materialize, prefetch=plan.prefetch,
        )
    except torch.OutOfMemoryError as e:
        raise out_of_memory(plan, e) from e
    if not ctx.is_main:  # rank 0 writes; the others return what it wrote
        ctx.barrier()
        return ctx.broadcast_object(None)
    fused = isinstance(expert_hook, FusedMethodHook)
    settings = _settings(data, opts, run.dtype)
    kv_scales, kv_report = kv_cache_scales(out_reader.layout, run.kv_ranges) if kv_fp8 else ({}, None)
    written = install_input_scales(
        output,
        {**run.scales, **kv_scales},
        stage_settings=_stage_settings(data, opts, run.dtype),
        stage_outputs={
            "report": str(calib_dir.relative_to(output)) if calib_dir.is_relative_to(output) else str(calib_dir),
            **({} if expert_hook is None else {FUSED_RECORD: expert_hook.record()} if fused
               else {EXPERT_STATS_RECORD: expert_hook.record(output)}),
            # hashes (never ids) of the windows used: validate's held-out part leaves them out (data/window_pick.py)
            CALIBRATION_WINDOWS_RECORD: calibration_window_hashes(sample_set.sequences),
        },
    )
    report = CalibrationReport(
        checkpoint=str(output),
        source=str(source),
        settings=settings,
        device=str(dev),
        sequences=len(sample_set.sequences),
        tokens=sample_set.tokens,
        conversations=sample_set.conversations,
        records_skipped=sample_set.skipped,
        skip_reasons=sample_set.skip_reasons,
        input_scales=len(run.scales),
        shard=written.file,
        shard_sha256=written.sha256,
        seconds=time.perf_counter() - started,
        layers=run.layers,
        layer_seconds=run.layer_seconds, layer_memory=run.memory,
        kv_cache=kv_report,
        memory_plan=plan,
    )
    write_calibration_report(report, calib_dir)
    if fused:  # the input scales are recorded: now the expert shards (fused_method.py says why only now)
        finalize(output, expert_hook.directory, expert_hook.files, expert_hook.method, expert_hook.method_options)
    resume.finish()  # everything is written: the snapshots are no longer needed
    if ctx.distributed:
        ctx.barrier()
        ctx.broadcast_object(report)
    return report


__all__ = [
    "CALIBRATE_STAGE",
    "DEFAULT_SAMPLES",
    "DEFAULT_SEQ_LEN",
    "CalibrationRun",
    "calibrate_checkpoint",
    "quantized_modules",
    "run_calibration",
]
