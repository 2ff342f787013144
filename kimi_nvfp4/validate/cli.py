"""`kimi-nvfp4 validate`: a thin click layer over `validate_checkpoint`; exit 1 when a gate fails."""

from __future__ import annotations

import click

from ..errors import GateFailure


@click.command("validate")
@click.argument("output", type=click.Path(exists=True, file_okay=False))
@click.option(
    "--source",
    required=True,
    type=click.Path(exists=True, file_okay=False),
    help="The INT4 checkpoint OUTPUT was converted from.",
)
@click.option(
    "--data",
    required=True,
    help="Sessions (same spec as calibrate: jsonl:PATH, hf:NAME[:SPLIT], tree:PATH, builtin, sample); "
    "only the held-out part is used.",
)
@click.option(
    "--report",
    "report_dir",
    required=True,
    type=click.Path(file_okay=False),
    help="Folder for validate_report.{json,md} and the PNG plots.",
)
@click.option(
    "--gates",
    "gates_file",
    default=None,
    type=click.Path(exists=True, dir_okay=False),
    help="TOML or JSON file overriding some default thresholds.",
)
@click.option(
    "--gate",
    "overrides",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override one threshold, e.g. --gate w4a4.kl_mean_max=0.02 (repeatable; wins over --gates). "
    "Keys: weight_rel_mse_max, weight_rel_mse_mean_max, weight_exact_fraction_min, and per mode "
    "(w4a4./w4a16.) kl_mean_max, kl_p99_max, top1_min, ppl_ratio_max, drift_max, "
    "expert_output_rel_mse_max.",
)
@click.option(
    "--mode",
    "modes",
    multiple=True,
    type=click.Choice(["w4a4", "w4a16"]),
    help="Emulation modes to compare (default both): w4a4 = Blackwell kernels, w4a16 = Hopper Marlin.",
)
@click.option(
    "--input-scale-reduction",
    default="layer_max",
    show_default=True,
    type=click.Choice(["layer_max", "per_expert"]),
    help="How SGLang combines expert input scales: layer_max (flashinfer backends) or per_expert (cutlass).",
)
@click.option("--samples", default=512, show_default=True, type=click.IntRange(min=1), help="Held-out sequences.")
@click.option("--seq-len", default=2048, show_default=True, type=click.IntRange(min=2), help="Tokens per sequence.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed for picking sequences.")
@click.option(
    "--sessions",
    "generated_sessions",
    default=None,
    type=click.IntRange(min=1),
    help="Sessions to generate for builtin/tree: data (default: enough for --samples; ~0.3 s each).",
)
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:N.")
@click.option(
    "--dtype",
    default="auto",
    show_default=True,
    type=click.Choice(["auto", "float32", "bfloat16"]),
    help="Compute dtype of every stream. auto: bfloat16 on CUDA (what SGLang serves: bf16 hidden states, "
    "matmuls and logits), float32 on CPU.",
)
@click.option("--max-chunk-tokens", default=None, type=click.IntRange(min=1), help="Tokens per MLP/MoE chunk.")
@click.option("--states-device", default=None, help="Keep hidden states here (e.g. cpu) when they do not fit the GPU.")
@click.option("--no-progress", is_flag=True, help="Hide progress bars.")
def validate_command(
    output,
    source,
    data,
    report_dir,
    gates_file,
    overrides,
    modes,
    input_scale_reduction,
    samples,
    seq_len,
    seed,
    device,
    dtype,
    max_chunk_tokens,
    states_device,
    no_progress,
    generated_sessions,
) -> None:
    """Run the INT4 SOURCE and the NVFP4 OUTPUT side by side on held-out sessions; exit 0 only if every gate passes.

    Exit codes: 0 all gates pass, 1 a gate failed (the report says which and by how much), 2-5 bad input
    (see kimi-nvfp4 --help).
    """
    from .api import DEFAULT_MODES, validate_checkpoint
    from .gates import load_gates

    thresholds = load_gates(gates_file, list(overrides))
    report = validate_checkpoint(
        output,
        source,
        data,
        report_dir=report_dir,
        gates=thresholds,
        modes=list(modes) or list(DEFAULT_MODES),
        device=device,
        samples=samples,
        seq_len=seq_len,
        seed=seed,
        input_scale_reduction=input_scale_reduction,
        progress=not no_progress,
        max_chunk_tokens=max_chunk_tokens,
        states_device=states_device,
        generated_sessions=generated_sessions,
        dtype=dtype,
    )
    for g in report.gates:
        if not g.passed:
            click.echo(
                f"FAIL {g.name}: {g.value if g.value is not None else ''} {g.comparison} "
                f"{'' if g.threshold is None else g.threshold} {g.detail}".rstrip(),
                err=True,
            )
    click.echo(f"report: {report_dir}/validate_report.md")
    if not report.passed:
        failed = [g.name for g in report.failed_gates()]
        raise GateFailure(f"{len(failed)} of {len(report.gates)} gates failed: {', '.join(failed[:8])}")
    click.echo(f"all {len(report.gates)} gates passed")
