"""Tables of the model stages' benchmarks: bench.speed.calibrate, bench.speed.validate, bench.profile.model_stages."""

from __future__ import annotations

from .common import (
    MISSING,
    BenchmarkRenderError,
    BlockContext,
    ResultFile,
    num,
    percent,
    projection_note,
    provenance,
    renderer,
    table,
    thousands,
)

# The sequence count bench.speed.calibrate and bench.speed.validate scale their projections to (issue #13's goal).
PROJECTED_SEQUENCES = 512
PROFILE_TOP_OPS = 6
PROFILE_OP_NAME_CHARS = 60


def _projection_source(result: ResultFile) -> str:
    """What the file's projection extrapolates from, as recorded; older calibrate files lack the field, so it
    is read off the figures they do record (layers measured, sequences, tokens per sequence)."""
    data = result.data
    if data.get("projection_from"):
        return str(data["projection_from"])
    layers = len(data.get("layer_seconds") or [])
    return f"{layers} synthetic layers x {data.get('samples')} sequences x {data.get('seq_len')} tokens"


def _model_tflops(data: dict) -> str:
    """Model TFLOP/s with the fraction of the bf16 peak the run compared against (recorded, or implied by
    the two figures the file records)."""
    tflops, fraction = data.get("moe_layer_model_tflops_per_s"), data.get("fraction_of_bf16_peak")
    if tflops is None:
        return num(None)
    if not fraction:
        return f"{tflops:.0f}"
    peak = data.get("bf16_peak_tflops") or tflops / fraction
    return f"{tflops:.0f} ({percent(fraction, 0)} of {peak:.0f})"


def _samples(data: dict) -> str:
    return f"{data['samples']} x {data['seq_len']}"


@renderer("calibrate_stage_timings")
def calibrate_stage_timings(ctx: BlockContext) -> str:
    """Calibrate's per-layer times on K2.6-shaped layers and the whole-model projection (bench.speed.calibrate)."""
    rows = []
    for r in ctx.results:
        r.require("samples", "seq_len", "moe_layer_seconds", "dense_layer_seconds",
                  "projected_k26_61_layers_512x2048_minutes")
        d = r.data
        rows.append([
            f"`{r.label}`", _samples(d), d.get("dtype") or num(None), num(d["moe_layer_seconds"]),
            num(d["dense_layer_seconds"]), thousands(d.get("moe_layer_tokens_per_second")), _model_tflops(d),
            num(d.get("peak_gpu_memory_gib"), 1),
            f"{d['projected_k26_61_layers_512x2048_minutes']:.1f} (goal {d.get('goal_minutes', num(None))})",
        ])
    headers = ["run", "sequences x tokens", "dtype", "per MoE layer s", "per dense layer s", "MoE tokens/s",
               "MoE model TFLOP/s (of bf16 peak)", "peak GPU GiB",
               f"**projected** whole K2.6, {PROJECTED_SEQUENCES} x 2048, min"]
    note = projection_note(
        ctx.results, f"1 dense + 60 MoE layers at the measured per-layer times, scaled linearly to "
        f"{PROJECTED_SEQUENCES} sequences", _projection_source,
    )
    return "\n\n".join([provenance(ctx), table(headers, rows), note])


def _validate_streams(d: dict) -> str:
    """The NVFP4 streams a validate run stepped (older result files predate the baseline stream and the
    per-expert check's token cap: they ran neither, and checked every routed token)."""
    streams = ", ".join(d.get("modes") or [])
    if d.get("baseline_stream"):
        streams += " + amax baseline"
    cap = d.get("expert_check_tokens")
    return f"{streams} ({f'{cap} tokens/expert' if cap else 'all tokens'})"


@renderer("validate_stage_timings")
def validate_stage_timings(ctx: BlockContext) -> str:
    """Validate's per-layer, logits and structure-scan times and the projection (bench.speed.validate)."""
    rows = []
    for r in ctx.results:
        r.require("samples", "seq_len", "tokens", "moe_layer_seconds", "dense_layer_seconds", "logits_seconds",
                  "structure_seconds", "projected_k26_61_layers_512_sessions_minutes")
        d = r.data
        per_moe = d["moe_layer_seconds"]
        rows.append([
            f"`{r.label}`", _samples(d), _validate_streams(d), num(per_moe), num(d["dense_layer_seconds"]),
            num(d["logits_seconds"]), num(d["structure_seconds"]),
            thousands(d["tokens"] / per_moe if per_moe else None), _model_tflops(d),
            num(d.get("peak_gpu_memory_gib"), 1),
            f"{d['projected_k26_61_layers_512_sessions_minutes']:.1f} (goal {d.get('goal_minutes', num(None))})",
        ])
    headers = ["run", "sequences x tokens", "streams (expert check)", "per MoE layer s", "per dense layer s", "logits s",
               "structure scan s", "MoE tokens/s", "MoE model TFLOP/s (of bf16 peak)", "peak GPU GiB",
               f"**projected** whole K2.6, {PROJECTED_SEQUENCES} sessions, min"]
    note = projection_note(
        ctx.results, f"1 dense + 60 MoE layers at the measured per-layer times and logits scaled linearly to "
        f"{PROJECTED_SEQUENCES} sessions, plus the structure scan scaled by checkpoint bytes to 595 GB",
        _projection_source,
    )
    return "\n\n".join([provenance(ctx), table(headers, rows), note])


@renderer("validate_end_to_end_quality")
def validate_end_to_end_quality(ctx: BlockContext) -> str:
    """KL, top-1 and perplexity ratio of each NVFP4 mode against the INT4 stream, per validate run."""
    rows = []
    for r in ctx.results:
        r.require("end_to_end")
        for e in r.data["end_to_end"]:
            rows.append([
                f"`{r.label}`", e["mode"], str(e["positions"]), num(e["kl_mean"], 4), num(e["kl_p99"], 4),
                num(e["kl_max"], 4), num(e["top1"], 3), num(e["ppl_ratio"], 4),
            ])
    headers = ["run", "mode", "positions", "KL mean", "KL p99", "KL max", "top-1 agreement",
               "perplexity ratio NVFP4/INT4"]
    return "\n\n".join([provenance(ctx), table(headers, rows)])


def _short_op(name: str) -> str:
    name = name.replace("|", "/")  # a kernel's template arguments may hold a pipe, which would split the cell
    return name if len(name) <= PROFILE_OP_NAME_CHARS else name[: PROFILE_OP_NAME_CHARS - 1] + "…"


@renderer("profile_top_device_ops")
def profile_top_device_ops(ctx: BlockContext) -> str:
    """The ops that took the most device time in each profiled stage (bench.profile.model_stages)."""
    rows = []
    for r in ctx.results:
        stages = [s for s in ("calibrate", "validate") if isinstance(r.data, dict) and s in r.data]
        if not stages:
            raise BenchmarkRenderError(f"{r.path}: result file lacks calibrate and validate profiles")
        for stage in stages:
            profile = r.data[stage]
            if "by_device_time" not in profile:
                raise BenchmarkRenderError(f"{r.path}: {stage} profile lacks by_device_time")
            ops = sorted(profile["by_device_time"], key=lambda op: op["self_device_ms"], reverse=True)
            for op in ops[:PROFILE_TOP_OPS]:
                rows.append([
                    stage, f"{r.data['samples']} x {r.data['seq_len']}", f"`{_short_op(op['op'])}`",
                    str(op["calls"]), num(op["self_device_ms"] / 1000),
                ])
    headers = ["stage", "sequences x tokens", "op (torch.profiler, by self device time)", "calls", "device s"]
    return "\n\n".join([provenance(ctx), table(headers, rows)])


@renderer("stage_phase_seconds")
def stage_phase_seconds(ctx: BlockContext) -> str:
    """Where the last (MoE) layer's time goes, phase by phase (`phase_seconds` of bench.speed.calibrate / bench.speed.validate:
    each phase ends with a wait for the compute stream)."""
    rows = []
    for r in ctx.results:
        r.require("phase_seconds", "layer_seconds")
        d = r.data
        if len(d["phase_seconds"]) < 2:
            raise BenchmarkRenderError(f"{r.path}: needs the phases of a dense and a MoE layer")
        i = len(d["phase_seconds"]) - 1  # the bench checkpoints' layers: 0 dense, then MoE
        phases = d["phase_seconds"][i]
        rows.append([f"`{r.label}`", str(i), num(d["layer_seconds"][i]),
                     ", ".join(f"{name} {value:.2f}" for name, value in phases.items())])
    headers = ["run", "layer", "layer s", "phases, s (in order)"]
    return "\n\n".join([provenance(ctx), table(headers, rows)])


@renderer("resume_snapshot")
def resume_snapshot(ctx: BlockContext) -> str:
    """Write and read rates of one resume snapshot (bench.speed.resume_snapshot) and the K2.6 snapshot times they
    project (labelled as projections)."""
    rows = []
    for r in ctx.results:
        r.require("snapshot_bytes", "write_gb_per_s", "read_gb_per_s", "read_back_identical",
                  "projected_k26_validate_snapshot_seconds", "projected_k26_calibrate_snapshot_seconds")
        d = r.data
        rows.append([
            f"`{r.label}`", str(d.get("device", MISSING)), num(d["snapshot_bytes"] / 1e9), num(d["write_gb_per_s"]),
            num(d["read_gb_per_s"]), "yes" if d["read_back_identical"] else "**no**",
            num(d["projected_k26_validate_snapshot_seconds"]), num(d["projected_k26_calibrate_snapshot_seconds"]),
        ])
    headers = ["run", "device", "snapshot GB", "write GB/s (fsync'd)", "read GB/s (page cache)", "read back identical",
               "*projected* K2.6 validate snapshot s (4 streams)", "*projected* K2.6 calibrate snapshot s"]
    return "\n\n".join([provenance(ctx), table(headers, rows)])
