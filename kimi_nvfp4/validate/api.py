"""`validate_checkpoint`: the INT4 source and the NVFP4 checkpoint side by side, layer by layer.

Streams: one INT4 hidden-state stream plus one NVFP4 stream per emulation mode (W4A4 as Blackwell
kernels compute it, W4A16 as Hopper's Marlin path does), stepped through the layer-streamed
reference model together on held-out coding-agent sessions. Per layer: the weight check of the
layer's experts, per-expert output error on the routed tokens, hidden-state drift. At the end:
per-token KL, top-1 agreement and perplexity. Then every gate; the report is written either way.
"""

from __future__ import annotations

import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from ..stage_kit.device import dtype_name, resolve_device, resolve_dtype
from ..stage_kit.disk_space import warn_if_snapshots_cannot_fit
from ..stage_kit.memory_plan import announce, apply_gpu_cap, out_of_memory
from .memory import validation_plan
from ..stage_kit.output_paths import require_writable_dir
from ..stage_kit.pairing import require_converted, require_matching_source
from ..stage_kit.samples import DataPart, load_sample_set
from ..checkpoint.output_lock import holds_output_lock
from ..checkpoint.reader import CheckpointReader
from ..checkpoint.verdict import VERDICT_KEY, seal_verdict
from ..distributed import rank_context
from .baseline import baseline_enabled
from .evaluate import evaluate_gates
from .experts import WORST_EXPERTS
from .gates import DEFAULT_GATES, GateThresholds
from .options import ValidateOptions
from .resume import ValidationResume, validation_fingerprint
from ..stage_kit.resume import ResumeStore
from .report import ValidationReport, ValidationSettings, write_validation_report
from .streams import compare_streams
from .structure import check_structure

VALIDATE_STAGE = "validate"


def writes_into_checkpoint(arguments: dict) -> bool:
    """Whether a validate call writes into the checkpoint folder (its manifest, or reports inside it)."""
    output, report_dir = Path(arguments["output"]).resolve(), Path(arguments["report_dir"]).resolve()
    return bool(arguments["record_in_manifest"]) or report_dir.is_relative_to(output)


def _record_stage(output: Path, report: ValidationReport, report_dir: Path) -> None:
    from ..checkpoint.manifest import StageRecord, load_manifest, save_manifest

    manifest = load_manifest(output)
    manifest.stages[VALIDATE_STAGE] = StageRecord(
        settings=report.settings.model_dump(),
        complete=True,
        finished_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        outputs={
            "passed": report.passed,
            "report": str(report_dir),
            "failed_gates": [g.name for g in report.failed_gates()],
            VERDICT_KEY: report.verdict.model_dump(mode="json") if report.verdict is not None else None,
        },
    )
    save_manifest(output, manifest)


@holds_output_lock("validate", "output", when=writes_into_checkpoint)  # checkpoint/output_lock.py
def validate_checkpoint(
    output: str | Path,
    source: str | Path,
    data: str,
    options: ValidateOptions | None = None,
    *,
    report_dir: str | Path,
    gates: GateThresholds | None = None,
    progress: bool = True,
    record_in_manifest: bool = True,
    **overrides: Any,
) -> ValidationReport:
    """Compare OUTPUT (NVFP4) with SOURCE (INT4) and evaluate every gate; writes the report to `report_dir`.

    Returns the report; `report.passed` is False when any gate failed (the CLI then exits 1).
    Raises (nothing written) when OUTPUT is not a converted checkpoint, SOURCE does not match it,
    or the data holds no usable held-out session.

    :param data: a data spec (as calibrate's); only its held-out part is used.
    :param options: a `ValidateOptions` (validate/options.py); its fields may also be given as keywords.
    :param gates: thresholds to use instead of the options' (`gates_file`, `gate_overrides` over the defaults).
    :param record_in_manifest: record the run in OUTPUT's manifest (`stages["validate"]`).
    """
    opts = ValidateOptions.build(options, overrides, "validate_checkpoint")
    device, samples, seq_len, seed = opts.device, opts.samples, opts.seq_len, opts.seed
    started = time.perf_counter()
    thresholds = gates or (opts.thresholds() if opts.sets_thresholds else DEFAULT_GATES)
    mode_list = opts.modes
    reduction = opts.input_scale_reduction
    output, source, report_dir = Path(output), Path(source), Path(report_dir)
    require_writable_dir(report_dir, what="the validate report folder")  # before the first layer, not after the run
    out_reader, src_reader = CheckpointReader(output), CheckpointReader(source)
    require_converted(out_reader)
    require_matching_source(src_reader, out_reader)
    dev = resolve_device(device)
    ctx = rank_context(dev)
    dev = ctx.device(dev)
    compute_dtype = resolve_dtype(opts.dtype, dev)
    sample_set = load_sample_set(
        output,
        data,
        part=DataPart.HELDOUT,
        samples=samples,
        seq_len=seq_len,
        seed=seed,
        generated_sessions=opts.generated_sessions,
    )

    mine = ctx.shard(sample_set.sequences)
    baseline = baseline_enabled(opts.baseline, sample_set.tokens)
    plan = validation_plan(out_reader.layout.text, opts, dev, compute_dtype, sum(int(s.numel()) for s in mine),
                           baseline)
    apply_gpu_cap(dev, opts.gpu_memory)
    announce(plan, progress and ctx.is_main)
    warn_if_snapshots_cannot_fit(plan.snapshot_bytes, report_dir, opts.resume_every, "validate")
    resume = ValidationResume(ResumeStore(report_dir, VALIDATE_STAGE, ctx, validation_fingerprint(
        out_reader, src_reader, ctx, data, mine, opts, device=dev, dtype=compute_dtype, baseline=baseline, flag_rel_mse=thresholds.weight_rel_mse_max,
    ), every=opts.resume_every, max_overhead=opts.resume_max_overhead))
    resume.snapshot = resume.store.load()
    # the structural scan reads every tensor once: rank 0's job (kept in its snapshots), shared at the end
    structure = resume.saved_structure()
    if structure is None and ctx.is_main:
        structure = check_structure(out_reader, src_reader, progress=progress)
    resume.structure = structure
    progress = progress and ctx.is_main
    try:
        run = compare_streams(
            src_reader,
            out_reader,
            mine,
            modes=mode_list,
            reduction=reduction,
            device=dev,
            flag_rel_mse=thresholds.weight_rel_mse_max,
            max_chunk_tokens=plan.chunk_tokens,
            states_device=plan.states_device,
            progress=progress,
            dtype=compute_dtype,
            prefetch=plan.prefetch,
            materialize=plan.materialize,
            ctx=ctx,
            baseline=baseline,
            expert_check_tokens=opts.expert_check_tokens,
            resume=resume,
        )
    except torch.OutOfMemoryError as e:
        raise out_of_memory(plan, e) from e
    structure = ctx.broadcast_object(structure)
    gate_results = evaluate_gates(
        thresholds, structure, run.weights, run.layers, run.end_to_end, run.mode_errors, mode_list, run.baseline
    )
    report = ValidationReport(
        checkpoint=str(output),
        source=str(source),
        settings=ValidationSettings(
            data=data,
            samples=samples,
            seq_len=seq_len,
            seed=seed,
            modes=[m.value for m in mode_list],
            input_scale_reduction=reduction.value,
            dtype=dtype_name(compute_dtype),
            expert_check_tokens=opts.expert_check_tokens,
        ),
        thresholds=thresholds,
        device=str(dev),
        sequences=len(sample_set.sequences),
        tokens=sample_set.tokens,
        conversations=sample_set.conversations,
        seconds=time.perf_counter() - started,
        structure=structure,
        weights=run.weights,
        layers=run.layers,
        layer_seconds=run.layer_seconds, layer_memory=run.memory,
        worst_experts=sorted(run.expert_errors, key=lambda x: -x.rel_mse)[: WORST_EXPERTS * len(mode_list)],
        end_to_end=run.end_to_end,
        baseline=run.baseline,
        mode_errors=run.mode_errors,
        memory_plan=plan,
        gates=gate_results,
        passed=all(g.passed for g in gate_results),
    )
    # the whole held-out set (every rank's share): the verdict is the same for any number of ranks
    report.verdict = seal_verdict(output, report, sample_set.sequences)
    if ctx.is_main:
        write_validation_report(report, report_dir)
        if record_in_manifest:
            _record_stage(output, report, report_dir)
        resume.store.finish()  # the report is written: the snapshots are no longer needed
    ctx.barrier()
    return report
