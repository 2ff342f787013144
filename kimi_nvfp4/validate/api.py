"""`validate_checkpoint`: the INT4 source and the NVFP4 checkpoint side by side, layer by layer.

Streams: one INT4 hidden-state stream plus one NVFP4 stream per emulation mode (W4A4 as Blackwell
kernels compute it, W4A16 as Hopper's Marlin path does), stepped through the layer-streamed
reference model together on held-out coding-agent sessions. Per layer: the weight check of the
layer's experts, per-expert output error on the routed tokens, hidden-state drift. At the end:
per-token KL, top-1 agreement and perplexity. Then every gate; the report is written either way.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

import torch

from ..stage_kit.device import AUTO_DTYPE, PhaseClock, dtype_name, resolve_device, resolve_dtype, synchronize
from ..stage_kit.disk_space import warn_if_snapshots_cannot_fit
from ..stage_kit.layer_memory import LayerMemory
from ..stage_kit.memory_plan import announce, apply_gpu_cap, out_of_memory
from .memory import validation_plan
from ..stage_kit.output_paths import require_writable_dir
from ..stage_kit.pairing import require_converted, require_matching_source
from ..stage_kit.progress import job_tokens, layer_progress
from ..stage_kit.samples import DataPart, load_sample_set
from ..checkpoint.output_lock import holds_output_lock
from ..checkpoint.reader import CheckpointReader
from ..checkpoint.verdict import VERDICT_KEY, seal_verdict
from ..distributed import RankContext, rank_context
from ..errors import CheckpointError
from ..model import Int4SourceWeights, LayerStreamRunner, NVFP4Weights
from ..model.layer_weights import LayerWeights, MoEWeights
from ..model.linear import ActivationMode, NVFP4Linear
from ..model.runner import CUDA_MAX_CHUNK_TOKENS, DEFAULT_MAX_CHUNK_TOKENS
from ..model.nvfp4_linears import InputScaleReduction
from .baseline import BASELINE_NAME, baseline_enabled, baseline_layer
from .evaluate import evaluate_gates
from .experts import DEFAULT_EXPERT_CHECK_TOKENS, WORST_EXPERTS, ExpertError, ExpertErrorObserver
from .gates import DEFAULT_GATES, GateThresholds
from .metrics import RelativeError, TokenComparison, stream_drift
from .options import ValidateOptions
from .ranks import merge_counts, merge_relative_errors, merge_token_comparison
from .resume import ValidationResume, validation_fingerprint
from ..stage_kit.resume import ResumeStore
from .report import EndToEnd, LayerValidation, ValidationReport, ValidationSettings, write_validation_report
from .structure import check_structure
from .weights import WeightComparer, WeightSummary

VALIDATE_STAGE = "validate"


def _runner_kwargs(dev, max_chunk_tokens, states_device, dtype, prefetch, materialize) -> dict:
    if max_chunk_tokens is None:
        max_chunk_tokens = CUDA_MAX_CHUNK_TOKENS if dev.type == "cuda" else DEFAULT_MAX_CHUNK_TOKENS
    return {
        "device": dev, "progress": False, "states_device": states_device, "dtype": dtype,
        "max_chunk_tokens": max_chunk_tokens, "materialize_layers": materialize, "prefetch": prefetch,
    }


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


@dataclass
class StreamComparison:
    """Everything the side-by-side run measured (before gates)."""

    layers: list[LayerValidation]
    expert_errors: list[ExpertError]
    end_to_end: list[EndToEnd]
    weights: WeightSummary | None
    mode_errors: dict[str, str]
    layer_seconds: list[float] = field(default_factory=list)
    # per layer, seconds by phase (load wait, weight check, each stream...): where a layer's time goes
    phase_seconds: list[dict[str, float]] = field(default_factory=list)
    memory: LayerMemory = field(default_factory=LayerMemory)  # per layer, peak GPU / host memory
    logits_seconds: float = 0.0
    baseline: EndToEnd | None = None

    def set_baseline(self, e2e: EndToEnd) -> None:
        self.baseline = e2e


def compare_streams(
    src_reader: CheckpointReader,
    out_reader: CheckpointReader,
    sequences: list[torch.Tensor],
    *,
    modes: Sequence[ActivationMode],
    reduction: InputScaleReduction,
    device: torch.device,
    flag_rel_mse: float,
    max_chunk_tokens: int | None = None,
    states_device: str | torch.device | None = None,
    progress: bool = True,
    dtype: str | torch.dtype = AUTO_DTYPE,
    prefetch: bool | None = None,
    materialize: bool | str = "auto",
    ctx: RankContext | None = None,
    baseline: bool = False,
    expert_check_tokens: int | None = DEFAULT_EXPERT_CHECK_TOKENS,
    resume: ValidationResume | None = None,
) -> StreamComparison:
    """Step the INT4 stream and one NVFP4 stream per mode through every layer, then compare logits.

    Each layer is read ONCE per checkpoint: the NVFP4 layer (dequantized once when it fits) serves the
    per-expert comparison, the W4A4 stream and then, switched in place to W4A16, the W4A16 stream (the
    weights do not depend on the activation mode); the weight check reads the layers already loaded.
    `prefetch` (default: on CUDA) reads layer L+1 of both checkpoints while layer L computes.
    `ctx`: under torchrun, `sequences` is this rank's share; every figure is combined over the ranks
    (validate/ranks.py) and is the same on every rank. `baseline`: one more W4A16 stream whose experts are
    the amax (Model Optimizer rule) conversion of the same INT4 experts (validate/baseline.py). `resume`: snapshot
    the streams every `resume.store.every` layers, and continue from `resume.snapshot` if set (validate/resume.py).
    `expert_check_tokens`: tokens compared per expert and layer in the per-expert check (validate/experts.py).
    `materialize`: dequantize each layer once (True), per chunk (False), or "auto" (when it fits the free memory);
    validate_checkpoint passes its memory plan's choice.
    """
    ctx = ctx or RankContext()
    compute_dtype = resolve_dtype(dtype, device)
    if prefetch is None:
        prefetch = device.type == "cuda"
    kw = _runner_kwargs(device, max_chunk_tokens, states_device, compute_dtype, prefetch, materialize)
    ref_runner = LayerStreamRunner(Int4SourceWeights(src_reader), **kw)
    wanted = list(dict.fromkeys(modes))
    # one NVFP4 source, opened in the most demanding mode asked for; W4A16 is a switch away
    first = ActivationMode.W4A4 if ActivationMode.W4A4 in wanted else ActivationMode.W4A16
    nv_source = NVFP4Weights(out_reader, activations=first.value, input_scale_reduction=reduction.value)
    nv_runner = LayerStreamRunner(nv_source, **kw)
    fallback_source = NVFP4Weights(out_reader, activations="w4a16", input_scale_reduction=reduction.value)
    comparer = WeightComparer(src_reader, out_reader, device, flag_rel_mse=flag_rel_mse)
    cfg = out_reader.layout.text
    result = StreamComparison([], [], [], None, {})
    if resume is not None and resume.snapshot is not None:
        ref_states, states, base_states, start = resume.restore(result, comparer, ref_runner, nv_runner, wanted)
    else:
        ref_states = ref_runner.embed(sequences)
        states = {mode: nv_runner.embed(sequences) for mode in wanted}
        base_states = nv_runner.embed(sequences) if baseline else None
        start = 0

    tokens = job_tokens(ctx, sum(int(s.numel()) for s in sequences))
    n_layers = cfg.num_hidden_layers
    for layer in layer_progress(range(start, n_layers), tokens_per_layer=tokens, desc="validate: layers",
                                enabled=progress, done=start):
        t0, clock = time.perf_counter(), PhaseClock(device)
        result.memory.start(device)
        w_ref = ref_runner.load_layer(layer)
        w_nv = _load_nvfp4_layer(nv_runner, fallback_source, layer, device, compute_dtype, states, result)
        clock.mark("load")
        observer = None
        if cfg.is_moe_layer(layer):
            comparer.add_loaded_layer(layer, w_ref, w_nv, ctx)
            clock.mark("weight_check")
            if w_nv is not None:
                observer = ExpertErrorObserver(
                    layer, w_nv, [m for m in states if _usable(w_nv, m)], max_tokens=expert_check_tokens
                )
        w_base = baseline_layer(w_ref, w_nv) if base_states is not None and w_nv is not None else None
        clock.mark("baseline_weights")
        attended = ref_runner.attend(layer, ref_states, w_ref, observer)
        del ref_states
        clock.mark("int4_attention")
        new_ref = ref_runner.feed_forward(attended, w_ref, observer)
        del w_ref, attended
        clock.mark("int4_mlp_and_expert_check")
        entry = LayerValidation(layer=layer, drift={})
        drift: dict[ActivationMode, RelativeError] = {}
        if observer is not None:
            observer.errors = merge_relative_errors(ctx, observer.errors)
            observer.tokens = merge_counts(ctx, observer.tokens)
            found = observer.results()
            del observer
            result.expert_errors += found
            for mode in states:
                mine = [x for x in found if x.mode == mode.value]
                if mine:
                    worst = max(mine, key=lambda x: x.rel_mse)
                    entry.expert_rel_mse_max[mode.value] = worst.rel_mse
                    entry.worst_expert[mode.value] = worst.expert
        for mode in list(states):
            if w_nv is None:
                break
            nv_source.set_activations(w_nv, mode.value)
            attended = nv_runner.attend(layer, states[mode], w_nv)
            clock.mark(f"{mode.value}_attention")
            states[mode] = nv_runner.feed_forward(attended, w_nv)
            del attended
            drift[mode] = stream_drift(new_ref, states[mode], device)
            clock.mark(f"{mode.value}_mlp")
        for mode, err in merge_relative_errors(ctx, drift).items():
            entry.drift[mode.value] = err.rel_mse
        if w_base is not None:
            if isinstance(w_nv.mlp, MoEWeights):
                # the checkpoint's dequantized experts are done with: their room lets the baseline's materialize
                for expert in w_nv.mlp.experts:  # routed only: the baseline shares the rest
                    for lin in expert.linears():
                        lin.drop_materialized()
            base_states = nv_runner.feed_forward(nv_runner.attend(layer, base_states, w_base), w_base)
            merged = merge_relative_errors(ctx, {BASELINE_NAME: stream_drift(new_ref, base_states, device)})
            entry.baseline_drift = merged[BASELINE_NAME].rel_mse
            clock.mark("baseline_stream")
        del w_nv, w_base
        ref_states = new_ref
        result.layers.append(entry)
        synchronize(device)
        result.layer_seconds.append(time.perf_counter() - t0)
        result.phase_seconds.append(clock.seconds)
        result.memory.stop(device)
        if resume is not None and resume.store.due(layer + 1, n_layers):
            resume.save(layer, ref_states, states, base_states, result, comparer)

    runners = {mode: nv_runner for mode in states}
    t0 = time.perf_counter()
    comparisons = {mode: TokenComparison() for mode in runners}
    streams = {mode: nv_runner.logits(states[mode]) for mode in runners}
    if base_states is not None:
        comparisons[BASELINE_NAME] = TokenComparison()
        streams[BASELINE_NAME] = nv_runner.logits(base_states)
    for seq, ref_logits in zip(sequences, ref_runner.logits(ref_states)):
        for mode, it in streams.items():
            comparisons[mode].add(ref_logits, next(it), seq)
    synchronize(device)
    result.logits_seconds = time.perf_counter() - t0
    for mode, c in list(comparisons.items()):
        c = comparisons[mode] = merge_token_comparison(ctx, c)
        edges, counts = c.kl_histogram()
        (result.end_to_end.append if mode != BASELINE_NAME else result.set_baseline)(
            EndToEnd(
                mode=mode if mode == BASELINE_NAME else mode.value,
                positions=c.positions,
                kl_mean=c.kl_mean,
                kl_p99=c.kl_p99,
                kl_max=c.kl_max,
                top1=c.top1,
                ppl_int4=c.ppl_ref,
                ppl_nvfp4=c.ppl_test,
                ppl_ratio=c.ppl_ratio,
                kl_histogram_edges=edges,
                kl_histogram_counts=counts,
            )
        )
    result.weights = comparer.summary() if cfg.moe_layers else None
    return result


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


def _usable(w: LayerWeights, mode: ActivationMode) -> bool:
    """Whether the loaded NVFP4 layer can be emulated in `mode` (W4A4 needs its input scales)."""
    if mode is ActivationMode.W4A16:
        return True
    return all(lin.input_scale is not None for lin in w.linears() if isinstance(lin, NVFP4Linear))


def _load_nvfp4_layer(
    runner: LayerStreamRunner,
    fallback: NVFP4Weights,
    layer: int,
    device: torch.device,
    dtype: torch.dtype,
    states: dict,
    result: StreamComparison,
) -> LayerWeights | None:
    """The NVFP4 layer in the runner's mode; when W4A4 cannot load (an input_scale missing), the
    W4A4 stream stops with its reason and the layer is loaded for W4A16 alone. None when even that
    fails: every NVFP4 stream stops with the reason."""
    try:
        return runner.load_layer(layer)
    except CheckpointError as e:
        if ActivationMode.W4A4 in states:
            result.mode_errors[ActivationMode.W4A4.value] = f"layer {layer}: {e}"
            del states[ActivationMode.W4A4]
    if not states:
        return None
    try:
        return fallback.layer(layer, device, dtype)
    except CheckpointError as e:
        for mode in list(states):
            result.mode_errors[mode.value] = f"layer {layer}: {e}"
            del states[mode]
        return None
