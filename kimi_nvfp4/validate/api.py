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
from tqdm.auto import tqdm

from ..calibrate.device import resolve_device, synchronize
from ..calibrate.pairing import require_converted, require_matching_source
from ..calibrate.samples import DataPart, load_sample_set
from ..checkpoint.reader import CheckpointReader
from ..errors import CheckpointError
from ..model import Int4SourceWeights, LayerStreamRunner, NVFP4Weights
from ..model.linear import ActivationMode
from ..model.nvfp4_linears import InputScaleReduction
from .experts import WORST_EXPERTS, ExpertError, ExpertErrorObserver
from .gates import DEFAULT_GATES, GateResult, GateThresholds, gate_check, gate_max, gate_min
from .metrics import RelativeError, TokenComparison
from .options import ValidateOptions
from .report import EndToEnd, LayerValidation, ValidationReport, ValidationSettings, write_validation_report
from .structure import StructureReport, check_structure
from .weights import WeightComparer, WeightSummary

VALIDATE_STAGE = "validate"


def _runner_kwargs(dev, max_chunk_tokens, states_device) -> dict:
    kw = {"device": dev, "progress": False, "states_device": states_device}
    if max_chunk_tokens is not None:
        kw["max_chunk_tokens"] = max_chunk_tokens
    return kw


def _drift(ref, test) -> float:
    acc = RelativeError()
    for a, b in zip(ref.sequences, test.sequences):
        acc.add(a, b.to(a.device))
    return acc.rel_mse


def evaluate_gates(
    thresholds: GateThresholds,
    structure: StructureReport,
    weights: WeightSummary | None,
    layers: list[LayerValidation],
    end_to_end: list[EndToEnd],
    mode_errors: dict[str, str],
    modes: Sequence[ActivationMode],
) -> list[GateResult]:
    gates = [
        gate_check(
            f"structure.{c.name}",
            c.issues + ([f"... {c.issue_count - len(c.issues)} more"] if c.issue_count > len(c.issues) else []),
        )
        for c in structure.checks
    ]
    if weights is not None:
        if weights.flagged_count:
            more = weights.flagged_count - len(weights.flagged)
            worst = f"{weights.flagged_count} matrices above: " + ", ".join(weights.flagged[:10])
            worst += f" ... {more} more" if more > 0 else ""
        else:
            worst = f"worst: {weights.worst[0].module}" if weights.worst else ""
        gates += [
            gate_check("weights.readable", weights.unreadable),
            gate_max("weights.rel_mse_max", weights.rel_mse_max, thresholds.weight_rel_mse_max, worst),
            gate_max("weights.rel_mse_mean", weights.rel_mse_mean, thresholds.weight_rel_mse_mean_max),
            gate_min("weights.exact_fraction", weights.exact_fraction, thresholds.weight_exact_fraction_min),
        ]
    e2e = {e.mode: e for e in end_to_end}
    for mode in modes:
        m, t = mode.value, thresholds.for_mode(mode)
        if m in mode_errors:
            gates.append(gate_check(f"{m}.ran", [mode_errors[m]]))
            continue
        drifts = [(l.drift[m], l.layer) for l in layers if m in l.drift]
        if drifts:
            d, at = max(drifts)
            gates.append(gate_max(f"{m}.drift_max", d, t.drift_max, f"layer {at}"))
        experts = [(l.expert_rel_mse_max[m], l.layer, l.worst_expert[m]) for l in layers if m in l.expert_rel_mse_max]
        if experts:
            v, layer, e = max(experts)
            gates.append(
                gate_max(f"{m}.expert_output_rel_mse_max", v, t.expert_output_rel_mse_max, f"layer {layer} expert {e}")
            )
        if m in e2e:
            r = e2e[m]
            gates += [
                gate_max(f"{m}.kl_mean", r.kl_mean, t.kl_mean_max),
                gate_max(f"{m}.kl_p99", r.kl_p99, t.kl_p99_max),
                gate_min(f"{m}.top1", r.top1, t.top1_min),
                gate_max(
                    f"{m}.ppl_ratio",
                    r.ppl_ratio,
                    t.ppl_ratio_max,
                    f"ppl INT4 {r.ppl_int4:.4g}, NVFP4 {r.ppl_nvfp4:.4g}",
                ),
            ]
    return gates


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
    logits_seconds: float = 0.0


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
) -> StreamComparison:
    """Step the INT4 stream and one NVFP4 stream per mode through every layer, then compare logits."""
    kw = _runner_kwargs(device, max_chunk_tokens, states_device)
    ref_runner = LayerStreamRunner(Int4SourceWeights(src_reader), **kw)
    runners = {
        mode: LayerStreamRunner(
            NVFP4Weights(out_reader, activations=mode.value, input_scale_reduction=reduction.value), **kw
        )
        for mode in modes
    }
    ref_states = ref_runner.embed(sequences)
    states = {mode: r.embed(sequences) for mode, r in runners.items()}
    comparer = WeightComparer(src_reader, out_reader, device, flag_rel_mse=flag_rel_mse)
    cfg = out_reader.layout.text
    result = StreamComparison([], [], [], None, {})

    for layer in tqdm(range(cfg.num_hidden_layers), desc="validate: layers", disable=not progress):
        t0 = time.perf_counter()
        observer = None
        if cfg.is_moe_layer(layer):
            comparer.add_layer(layer)
            observer = _expert_observer(out_reader, layer, device, list(runners), reduction, result.mode_errors)
        new_ref = ref_runner.apply_layer(layer, ref_states, observer=observer)
        entry = LayerValidation(layer=layer, drift={})
        if observer is not None:
            found = observer.results()
            del observer  # frees the NVFP4 layer before the NVFP4 streams load theirs
            result.expert_errors += found
            for mode in runners:
                mine = [x for x in found if x.mode == mode.value]
                if mine:
                    worst = max(mine, key=lambda x: x.rel_mse)
                    entry.expert_rel_mse_max[mode.value] = worst.rel_mse
                    entry.worst_expert[mode.value] = worst.expert
        for mode in list(runners):
            try:
                states[mode] = runners[mode].apply_layer(layer, states[mode])
            except CheckpointError as e:  # e.g. an input_scale missing: this mode cannot be emulated
                result.mode_errors[mode.value] = f"layer {layer}: {e}"
                del runners[mode], states[mode]
                continue
            entry.drift[mode.value] = _drift(new_ref, states[mode])
        ref_states = new_ref
        result.layers.append(entry)
        synchronize(device)
        result.layer_seconds.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    comparisons = {mode: TokenComparison() for mode in runners}
    streams = {mode: runners[mode].logits(states[mode]) for mode in runners}
    for seq, ref_logits in zip(sequences, ref_runner.logits(ref_states)):
        for mode, it in streams.items():
            comparisons[mode].add(ref_logits, next(it), seq)
    synchronize(device)
    result.logits_seconds = time.perf_counter() - t0
    for mode, c in comparisons.items():
        edges, counts = c.kl_histogram()
        result.end_to_end.append(
            EndToEnd(
                mode=mode.value,
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
    max_chunk_tokens, states_device = opts.max_chunk_tokens, opts.states_device
    started = time.perf_counter()
    thresholds = gates or (opts.thresholds() if opts.sets_thresholds else DEFAULT_GATES)
    mode_list = opts.modes
    reduction = opts.input_scale_reduction
    output, source, report_dir = Path(output), Path(source), Path(report_dir)
    out_reader, src_reader = CheckpointReader(output), CheckpointReader(source)
    require_converted(out_reader)
    require_matching_source(src_reader, out_reader)
    dev = resolve_device(device)
    sample_set = load_sample_set(
        output,
        data,
        part=DataPart.HELDOUT,
        samples=samples,
        seq_len=seq_len,
        seed=seed,
        generated_sessions=opts.generated_sessions,
    )

    structure = check_structure(out_reader, src_reader, progress=progress)
    run = compare_streams(
        src_reader,
        out_reader,
        sample_set.sequences,
        modes=mode_list,
        reduction=reduction,
        device=dev,
        flag_rel_mse=thresholds.weight_rel_mse_max,
        max_chunk_tokens=max_chunk_tokens,
        states_device=states_device,
        progress=progress,
    )
    gate_results = evaluate_gates(
        thresholds, structure, run.weights, run.layers, run.end_to_end, run.mode_errors, mode_list
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
        worst_experts=sorted(run.expert_errors, key=lambda x: -x.rel_mse)[: WORST_EXPERTS * len(mode_list)],
        end_to_end=run.end_to_end,
        mode_errors=run.mode_errors,
        gates=gate_results,
        passed=all(g.passed for g in gate_results),
    )
    write_validation_report(report, report_dir)
    if record_in_manifest:
        _record_stage(output, report, report_dir)
    return report


def _expert_observer(
    reader: CheckpointReader,
    layer: int,
    dev: torch.device,
    modes: list[ActivationMode],
    reduction: InputScaleReduction,
    mode_errors: dict[str, str],
) -> ExpertErrorObserver | None:
    """The NVFP4 layer for per-expert comparisons: W4A4 scales when they load, else W4A16 only.

    A layer that does not load at all gives None here; the stream itself then records why.
    """
    usable = [m for m in modes if m.value not in mode_errors]
    attempts = []
    if ActivationMode.W4A4 in usable:
        attempts.append((ActivationMode.W4A4, usable))
    if ActivationMode.W4A16 in usable:
        attempts.append((ActivationMode.W4A16, [ActivationMode.W4A16]))
    for activations, compared in attempts:
        try:
            nvfp4 = NVFP4Weights(reader, activations=activations.value, input_scale_reduction=reduction.value)
            return ExpertErrorObserver(layer, nvfp4.layer(layer, dev), compared)
        except CheckpointError:
            continue
    return None
