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

    python bench/bench_model_layer.py --device cuda --tokens 16384 --experts 384
    python bench/bench_model_layer.py --device cpu --preset tiny --tokens 4096
    python bench/bench_model_layer.py --device cpu --tokens 256 --experts 16 --seq-len 256
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
from kimi_nvfp4.model.layer_weights import (
    AttentionWeights,
    LayerWeights,
    MLPWeights,
    MoEWeights,
)
from kimi_nvfp4.model.linear import (
    ActivationMode,
    DenseLinear,
    Int4Linear,
    Linear,
    NVFP4Linear,
)
from kimi_nvfp4.numerics.constants import (
    E4M3_MAX,
    INT4_GROUP_SIZE,
    INT4_PER_INT32,
    NVFP4_BLOCK_SIZE,
    NVFP4_TENSOR_SCALE_DENOMINATOR,
)
from kimi_nvfp4.numerics.nvfp4 import NVFP4Tensor
from kimi_nvfp4.synth import create_synthetic_checkpoint
from kimi_nvfp4.synth.configs import deepseek_v3_text_config

MODES = ("int4", "nvfp4-w4a4", "nvfp4-w4a16")
# Synthetic magnitudes, typical of trained K2 projections.
WEIGHT_STD = 0.02
WEIGHT_AMAX = 0.12
ACTIVATION_AMAX = 8.0
MOE_LAYER = 1  # layer 0 is the dense one (first_k_dense_replace = 1)
TINY_VOCAB = 512


class InMemoryLayerSource:
    """A WeightSource that hands out one prebuilt layer (the bench times compute, not disk)."""

    def __init__(self, config: K2Config, layer: LayerWeights):
        self.config = config
        self._layer = layer

    def layer(self, i, device, dtype=torch.float32):
        return self._layer


def _bf16_linear(name: str, out_f: int, in_f: int, device, g, dtype=torch.float32) -> Linear:
    w = (torch.randn(out_f, in_f, device=device, generator=g) * WEIGHT_STD).to(torch.bfloat16)
    return DenseLinear(name, w, dtype)


def _expert_linear(name: str, out_f: int, in_f: int, mode: str, device, g, dtype=torch.float32) -> Linear:
    if mode == "int4":
        packed = torch.randint(-(2**31), 2**31 - 1, (out_f, in_f // INT4_PER_INT32), dtype=torch.int32, device=device, generator=g)
        scale = (torch.rand(out_f, in_f // INT4_GROUP_SIZE, device=device, generator=g) + 0.5) * (WEIGHT_STD / 4)
        return Int4Linear(name, packed, scale.to(torch.bfloat16), in_f, dtype)
    codes = torch.randint(0, 256, (out_f, in_f // 2), dtype=torch.uint8, device=device, generator=g)
    block = torch.rand(out_f, in_f // NVFP4_BLOCK_SIZE, device=device, generator=g) * E4M3_MAX
    tensor = NVFP4Tensor(
        codes, block.clamp(min=1.0).to(torch.float8_e4m3fn),
        torch.tensor(WEIGHT_AMAX / NVFP4_TENSOR_SCALE_DENOMINATOR, device=device),
    )
    activations = ActivationMode.W4A4 if mode == "nvfp4-w4a4" else ActivationMode.W4A16
    input_scale = torch.tensor(ACTIVATION_AMAX / NVFP4_TENSOR_SCALE_DENOMINATOR, device=device)
    return NVFP4Linear(name, tensor, dtype, input_scale=input_scale, mode=activations)


def synthetic_moe_layer(cfg: K2Config, mode: str, device, seed: int = 0, dtype=torch.float32) -> LayerWeights:
    """One K2.6-shaped MoE layer with random weights; `dtype`: the compute dtype its linears dequantize to."""
    g = torch.Generator(device=device).manual_seed(seed)
    h, n_h = cfg.hidden_size, cfg.num_attention_heads
    a = "self_attn."
    attn = AttentionWeights(
        q_a_proj=_bf16_linear(f"{a}q_a_proj", cfg.q_lora_rank, h, device, g, dtype),
        q_a_layernorm=torch.ones(cfg.q_lora_rank, device=device),
        q_b_proj=_bf16_linear(f"{a}q_b_proj", n_h * cfg.qk_head_dim, cfg.q_lora_rank, device, g, dtype),
        kv_a_proj_with_mqa=_bf16_linear(f"{a}kv_a_proj_with_mqa", cfg.kv_lora_rank + cfg.qk_rope_head_dim, h, device, g, dtype),
        kv_a_layernorm=torch.ones(cfg.kv_lora_rank, device=device),
        kv_b_proj=_bf16_linear(f"{a}kv_b_proj", n_h * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank, device, g, dtype),
        o_proj=_bf16_linear(f"{a}o_proj", h, n_h * cfg.v_head_dim, device, g, dtype),
    )
    width = cfg.moe_intermediate_size
    experts = [
        MLPWeights(
            _expert_linear(f"mlp.experts.{e}.gate_proj", width, h, mode, device, g, dtype),
            _expert_linear(f"mlp.experts.{e}.up_proj", width, h, mode, device, g, dtype),
            _expert_linear(f"mlp.experts.{e}.down_proj", h, width, mode, device, g, dtype),
        )
        for e in range(cfg.n_routed_experts)
    ]
    shared_w = width * cfg.n_shared_experts
    shared = MLPWeights(
        _bf16_linear("mlp.shared_experts.gate_proj", shared_w, h, device, g, dtype),
        _bf16_linear("mlp.shared_experts.up_proj", shared_w, h, device, g, dtype),
        _bf16_linear("mlp.shared_experts.down_proj", h, shared_w, device, g, dtype),
    )
    moe = MoEWeights(
        router_weight=torch.randn(cfg.n_routed_experts, h, device=device, generator=g) * WEIGHT_STD,
        e_score_correction_bias=torch.rand(cfg.n_routed_experts, device=device, generator=g) * 0.01,
        experts=experts,
        shared_experts=shared,
    )
    return LayerWeights(MOE_LAYER, torch.ones(h, device=device), torch.ones(h, device=device), attn, moe)


def layer_bytes(layer: LayerWeights) -> int:
    seen = 0
    for lin in layer.linears():
        for t in vars(lin).values():
            if isinstance(t, torch.Tensor):
                seen += t.numel() * t.element_size()
            elif isinstance(t, NVFP4Tensor):
                seen += sum(x.numel() * x.element_size() for x in (t.weight, t.weight_scale, t.weight_scale_2))
    return seen


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
        from provenance import provenance

        device_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
        record = {"argv": sys.argv[1:], "device": device_name, "results": results, **provenance()}
        json_path.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
