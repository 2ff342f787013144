"""Benchmark the layer-streamed reference model.

Two cases:
- `--preset k2.6` (default): ONE K2.6-shaped MoE decoder layer (hidden 7168, MLA ranks 1536/512,
  64 heads, `--experts` routed experts of width 2048, top-8, 1 shared expert), weights synthesised
  in memory on the device (random INT4 codes + bf16 group scales; random NVFP4 codes + E4M3 block
  scales), forward over `--tokens` tokens in sequences of `--seq-len`, per mode:
  `int4` (the exact INT4 reference), `nvfp4-w4a4` (Blackwell emulation), `nvfp4-w4a16` (Marlin).
- `--preset tiny`: the whole tiny model (3 layers, 8 experts) from a synthetic checkpoint on disk,
  embeddings to logits, through `LayerStreamRunner.run`.

Reports tokens/s and peak memory (CUDA: `torch.cuda.max_memory_allocated`; CPU: process peak RSS),
as a table on stdout and optionally JSON (`--json`).

    python -m bench.speed.model_layer --device cuda --tokens 16384 --experts 384
    python -m bench.speed.model_layer --device cpu --preset tiny --tokens 4096
    python -m bench.speed.model_layer --device cpu --tokens 256 --experts 16 --seq-len 256
"""

from __future__ import annotations

import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import click
import torch

from kimi_nvfp4.checkpoint.k2_config import K2Config
from kimi_nvfp4.model import LayerStreamRunner, open_weights
from kimi_nvfp4.synth import create_synthetic_checkpoint
from kimi_nvfp4.synth.configs import deepseek_v3_text_config

from bench.harness.synthetic_layer import MODES, MOE_LAYER, TINY_VOCAB, InMemoryLayerSource, layer_bytes, synthetic_moe_layer

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _sequences(tokens: int, seq_len: int, vocab: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = [seq_len] * (tokens // seq_len) + ([tokens % seq_len] if tokens % seq_len else [])
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths]


def bench_k26_layer(device, tokens, seq_len, experts, mode, max_chunk_tokens, materialize=False) -> dict:
    cfg = K2Config.from_dict(deepseek_v3_text_config("k2.6", layers=2, experts=experts))
    layer = synthetic_moe_layer(cfg, mode, device)
    stored_bytes = layer_bytes(layer)  # as stored (4-bit experts), before any materialization
    runner = LayerStreamRunner(
        InMemoryLayerSource(cfg, layer), device=device, max_chunk_tokens=max_chunk_tokens, progress=False,
        materialize_layers=materialize,  # timed too: materialize() re-dequantizes on every load
    )
    g = torch.Generator().manual_seed(1)

    def states_for(n_tokens):
        lengths = [seq_len] * (n_tokens // seq_len) + ([n_tokens % seq_len] if n_tokens % seq_len else [])
        from kimi_nvfp4.model.runner import HiddenStates

        return HiddenStates([torch.randn(n, cfg.hidden_size, generator=g).to(device) for n in lengths])

    with torch.no_grad():
        runner.apply_layer(MOE_LAYER, states_for(min(tokens, 64)))  # warm-up: kernels, allocator
        states = states_for(tokens)
        _sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        out = runner.apply_layer(MOE_LAYER, states)
        _sync(device)
        seconds = time.perf_counter() - start
    assert all(torch.isfinite(s).all() for s in out.sequences)
    return {
        "case": "k2.6-moe-layer", "mode": mode, "device": str(device), "tokens": tokens, "seq_len": seq_len,
        "experts": experts, "max_chunk_tokens": max_chunk_tokens, "materialize": materialize, "seconds": seconds,
        "tokens_per_s": tokens / seconds, "peak_memory_bytes": _peak_bytes(device), "layer_weight_bytes": stored_bytes,
    }


def bench_tiny_model(device, tokens, seq_len, max_chunk_tokens) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = create_synthetic_checkpoint(Path(tmp) / "tiny", vocab_size=TINY_VOCAB)
        runner = LayerStreamRunner(open_weights(ckpt), device=device, max_chunk_tokens=max_chunk_tokens, progress=False)
        with torch.no_grad():
            list(runner.run(_sequences(min(tokens, 64), seq_len, TINY_VOCAB, seed=1)))  # warm-up
            seqs = _sequences(tokens, seq_len, TINY_VOCAB)
            _sync(device)
            start = time.perf_counter()
            n = sum(l.shape[0] for l in runner.run(seqs))
            _sync(device)
            seconds = time.perf_counter() - start
    assert n == tokens
    return {
        "case": "tiny-whole-model", "mode": "int4", "device": str(device), "tokens": tokens, "seq_len": seq_len,
        "experts": 8, "max_chunk_tokens": max_chunk_tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
        "peak_memory_bytes": _peak_bytes(device), "layer_weight_bytes": None,
    }


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--preset", type=click.Choice(["k2.6", "tiny"]), default="k2.6", show_default=True,
              help="k2.6: one real-shaped MoE layer; tiny: the whole tiny model from a checkpoint.")
@click.option("--tokens", type=int, default=16384, show_default=True)
@click.option("--seq-len", type=int, default=4096, show_default=True, help="Tokens per sequence.")
@click.option("--experts", type=int, default=384, show_default=True, help="Routed experts (k2.6 preset).")
@click.option("--mode", "modes", type=click.Choice(MODES), multiple=True, default=("int4", "nvfp4-w4a4"),
              show_default=True, help="Repeatable.")
@click.option("--max-chunk-tokens", type=int, default=16384, show_default=True)
@click.option("--materialize/--no-materialize", default=False, show_default=True,
              help="Dequantize the layer once (LayerStreamRunner materialize_layers) instead of per expert per chunk.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the results here.")
def main(device, preset, tokens, seq_len, experts, modes, max_chunk_tokens, materialize, json_path):
    """Tokens/s and peak memory of the reference model (see the module docstring)."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise click.ClickException("--device cuda but no CUDA device is available")
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference computes in true fp32
    if preset == "tiny":
        results = [bench_tiny_model(dev, tokens, seq_len, max_chunk_tokens)]
    else:
        results = []
        for mode in modes:
            results.append(bench_k26_layer(dev, tokens, seq_len, experts, mode, max_chunk_tokens, materialize))
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    header = f"{'case':18} {'mode':12} {'device':6} {'tokens':>7} {'experts':>7} {'s':>8} {'tok/s':>10} {'peak GiB':>9}"
    click.echo(header)
    for r in results:
        click.echo(
            f"{r['case']:18} {r['mode']:12} {r['device']:6} {r['tokens']:>7} {r['experts']:>7} {r['seconds']:>8.2f} "
            f"{r['tokens_per_s']:>10.1f} {r['peak_memory_bytes'] / 2**30:>9.2f}"
        )
    if json_path:
        from bench.harness.provenance import provenance

        device_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
        record = {"argv": sys.argv[1:], "device": device_name, "results": results, **provenance()}
        json_path.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
