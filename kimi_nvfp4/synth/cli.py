"""`kimi-nvfp4 synth`: a thin click layer over `create_synthetic_checkpoint`."""

from __future__ import annotations

import click

from .checkpoint import ShardLayout, create_synthetic_checkpoint
from .configs import KIMI_VOCAB_SIZE, PRESETS, QuantConfigPlacement
from .writing import SYNTH_DEVICES


@click.command("synth")
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--preset", type=click.Choice(PRESETS), default="tiny", show_default=True,
              help="tiny: small dims for tests; k2.6: Kimi K2.6's real tensor shapes.")
@click.option("--layers", type=int, default=None, help="Decoder layers (layer 0 is dense). Default: the preset's.")
@click.option("--experts", type=int, default=None, help="Routed experts per MoE layer. Default: the preset's.")
@click.option("--shards", type=int, default=1, show_default=True,
              help="Number of safetensors shards (k2.6 with more than one: the release's order, see --shard-layout).")
@click.option("--shard-layout", type=click.Choice([s.value for s in ShardLayout]), default=None,
              help="bytes: equal-sized runs; release: decoder layer L alone in shard L+1, then lm_head + embeddings, "
                   "projector, vision tower (K2.6's upload). Default: release for --preset k2.6 with --shards > 1.")
@click.option("--quant-config-placement", type=click.Choice([p.value for p in QuantConfigPlacement]), default=None,
              help="Where the INT4 block sits in config.json: both (top level and text_config) or text_config only "
                   "(as K2.6 ships it). Default: the preset's (k2.6: text_config, tiny: both).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--layout", type=click.Choice(["kimi_k25", "deepseek_v3"]), default="kimi_k25", show_default=True,
              help="kimi_k25: K2.5/K2.6 wrapper with vision tower; deepseek_v3: Kimi-K2-Thinking.")
@click.option("--codes", "code_distribution", type=click.Choice(["realistic", "uniform"]), default="realistic",
              show_default=True, help="INT4 codes from Gaussian weights (realistic) or uniformly random.")
@click.option("--vocab-size", type=int, default=KIMI_VOCAB_SIZE, show_default=True,
              help="Embedding rows; Kimi's special-token ids need the full 163840.")
@click.option("--device", type=click.Choice(SYNTH_DEVICES), default="cpu", show_default=True,
              help="Where tensors are generated and quantized. cpu: the reference contents; cuda: much faster, "
                   "different (still seed-deterministic) contents; auto: cuda if available.")
@click.option("--workers", type=click.IntRange(min=1), default=1, show_default=True,
              help="Processes generating and writing tensors in parallel (same bytes for any number).")
def synth_command(out, preset, layers, experts, shards, shard_layout, quant_config_placement, seed, layout,
                  code_distribution, vocab_size, device, workers):
    """Write a synthetic Kimi K2 INT4 checkpoint (compressed-tensors pack-quantized experts) to OUT."""
    path = create_synthetic_checkpoint(
        out, preset=preset, layers=layers, experts=experts, shards=shards, seed=seed, layout=layout,
        code_distribution=code_distribution, vocab_size=vocab_size, device=device, workers=workers, progress=True,
        shard_layout=shard_layout, quant_config_placement=quant_config_placement,
    )
    click.echo(f"wrote {path}")
