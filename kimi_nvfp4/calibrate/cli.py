"""`kimi-nvfp4 calibrate`: a thin click layer over `calibrate_checkpoint`."""

from __future__ import annotations

import click

from .policy import DEFAULT_EXPERT_POLICY, DEFAULT_MIN_EXPERT_TOKENS, ExpertPolicy


@click.command("calibrate")
@click.argument("output", type=click.Path(exists=True, file_okay=False))
@click.option(
    "--source",
    required=True,
    type=click.Path(exists=True, file_okay=False),
    help="The INT4 checkpoint OUTPUT was converted from (checked against it).",
)
@click.option(
    "--data",
    required=True,
    help="Calibration sessions: jsonl:PATH, hf:NAME[:SPLIT], tree:PATH, builtin or sample "
    "(comma-separated to mix). The held-out part is never used here.",
)
@click.option(
    "--samples", default=512, show_default=True, type=click.IntRange(min=1), help="Number of token sequences."
)
@click.option(
    "--seq-len",
    default=2048,
    show_default=True,
    type=click.IntRange(min=2),
    help="Tokens per sequence; longer sessions are split or truncated.",
)
@click.option("--seed", default=0, show_default=True, type=int, help="Seed for picking sequences.")
@click.option(
    "--min-expert-tokens",
    default=DEFAULT_MIN_EXPERT_TOKENS,
    show_default=True,
    type=click.IntRange(min=0),
    help="Experts with fewer routed tokens get the --expert-policy.",
)
@click.option(
    "--expert-policy",
    "policy",
    default=DEFAULT_EXPERT_POLICY.value,
    show_default=True,
    type=click.Choice([p.value for p in ExpertPolicy]),
    help="peer-max: the layer's max over covered experts; route-all: every token through every "
    "expert for statistics only.",
)
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
    help="Compute dtype of the reference model. auto: bfloat16 on CUDA (what SGLang serves: bf16 hidden "
    "states and matmuls), float32 on CPU.",
)
@click.option(
    "--max-chunk-tokens",
    default=None,
    type=click.IntRange(min=1),
    help="Tokens per MLP/MoE chunk (memory/speed trade-off).",
)
@click.option("--states-device", default=None, help="Keep hidden states here (e.g. cpu) when they do not fit the GPU.")
@click.option(
    "--report-dir",
    default=None,
    type=click.Path(file_okay=False),
    help="Where the report goes (default OUTPUT/calibration).",
)
@click.option("--no-progress", is_flag=True, help="Hide progress bars.")
def calibrate_command(
    output,
    source,
    data,
    samples,
    seq_len,
    seed,
    min_expert_tokens,
    policy,
    device,
    dtype,
    max_chunk_tokens,
    states_device,
    report_dir,
    no_progress,
    generated_sessions,
) -> None:
    """Write input_scale for every NVFP4 linear of OUTPUT from coding-agent sessions.

    Adds model-input-scales.safetensors, updates the index and the manifest; the main shards are not
    rewritten. Writes a calibration report (JSON, Markdown, PNG) to OUTPUT/calibration.
    """
    from .api import calibrate_checkpoint

    report = calibrate_checkpoint(
        output,
        source,
        data,
        samples=samples,
        seq_len=seq_len,
        seed=seed,
        min_expert_tokens=min_expert_tokens,
        policy=policy,
        device=device,
        dtype=dtype,
        progress=not no_progress,
        max_chunk_tokens=max_chunk_tokens,
        states_device=states_device,
        report_dir=report_dir,
        generated_sessions=generated_sessions,
    )
    click.echo(
        f"calibrated {report.input_scales} input scales from {report.sequences} sequences "
        f"({report.tokens} tokens, {report.settings.dtype}) in {report.seconds:.1f} s -> {report.shard}"
    )
