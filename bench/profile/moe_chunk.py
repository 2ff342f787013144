"""Where one MoE chunk's time goes: `mlp_block` over one chunk of a K2.6-shaped MoE layer, per kernel.

Validate's and calibrate's MoE passes are chunks of `CUDA_MAX_CHUNK_TOKENS` tokens through `mlp_block` (model/
decoder.py), one after the other; at 512 x 2048 tokens a stream is 16 of them per layer. This times one chunk per
mode and weight form (the experts dequantized once -- `materialize`, what calibrate's plan picks -- or per chunk, what
validate's plan picks at 512 x 2048) and profiles it with torch.profiler: the kernels by device time (CPU: ops by
CPU time), against the chunk's matmul FLOPs at the H200's dense bf16 rate. `--also-plain` repeats each setting with
`batch_invariant.BATCH_INVARIANT` off (plain products instead of fixed-shape row tiles).

    python -m bench.profile.moe_chunk --device cuda --experts 384 --tokens 65536 --json prof.json
    python -m bench.profile.moe_chunk --device cpu --experts 8 --tokens 256 --mode int4 --json /tmp/moe_chunk.json
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import click
import torch
from torch.profiler import ProfilerActivity, profile

from bench.harness.provenance import provenance
from bench.harness.synthetic_layer import MODES, synthetic_moe_layer
from kimi_nvfp4.checkpoint.k2_config import K2Config
from kimi_nvfp4.model import batch_invariant
from kimi_nvfp4.model.decoder import mlp_block
from kimi_nvfp4.stage_kit.device import synchronize
from kimi_nvfp4.synth.configs import deepseek_v3_text_config

TOP_KERNELS = 25
# H200 SXM dense bf16 tensor-core rate (NVIDIA's datasheet: 989 TFLOP/s dense; the working figure ~790).
H200_BF16_FLOPS = 989e12


def chunk_flops(cfg: K2Config, tokens: int) -> float:
    """Matmul FLOPs of one MoE chunk: top-k routed experts and the shared experts, 3 matrices each, and the router."""
    per_expert = 3 * 2 * cfg.hidden_size * cfg.moe_intermediate_size
    shared = cfg.n_shared_experts * per_expert
    router = 2 * cfg.hidden_size * cfg.n_routed_experts
    return tokens * (cfg.num_experts_per_tok * per_expert + shared + router)


def _timed(fn, device, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        synchronize(device)
        t = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t)
    return times


def _kernels(prof, key: str) -> list[dict]:
    rows = []
    for e in sorted(prof.key_averages(), key=lambda e: -getattr(e, key))[:TOP_KERNELS]:
        if getattr(e, key) <= 0:
            continue
        rows.append({"name": e.key[:160], "calls": e.count, "ms": getattr(e, key) / 1e3})
    return rows


def _run_chunk(cfg: K2Config, w, x: torch.Tensor, device: torch.device, repeats: int):
    """(seconds of each timed call, the profiler of one more call) for `mlp_block` over the chunk `x`."""
    with torch.no_grad():
        mlp_block(cfg, w, x[: min(x.shape[0], 512)])  # warm-up: kernels, cuBLAS handles
        times = _timed(lambda: mlp_block(cfg, w, x), device, repeats)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=acts) as prof:
            mlp_block(cfg, w, x)
            synchronize(device)
    return times, prof


def measure(device: torch.device, mode: str, materialize: bool, experts: int, tokens: int, repeats: int,
            invariant: bool = True) -> dict:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = K2Config.from_dict(deepseek_v3_text_config("k2.6", layers=2, experts=experts))
    w = synthetic_moe_layer(cfg, mode, device, dtype=dtype)
    if materialize:
        w.materialize()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, cfg.hidden_size, generator=g).to(device=device, dtype=dtype)
    before, batch_invariant.BATCH_INVARIANT = batch_invariant.BATCH_INVARIANT, invariant
    try:
        times, prof = _run_chunk(cfg, w, x, device, repeats)
    finally:
        batch_invariant.BATCH_INVARIANT = before
    seconds = sorted(times)[len(times) // 2]
    flops = chunk_flops(cfg, tokens)
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    kernels = _kernels(prof, key)
    device_total = sum(getattr(e, key) for e in prof.key_averages()) / 1e6
    row = {"mode": mode, "materialized": materialize, "invariant": invariant, "experts": experts, "tokens": tokens,
           "dtype": str(dtype), "seconds": seconds, "seconds_each": times, "matmul_tflop": flops / 1e12,
           "fraction_of_bf16_peak": flops / seconds / H200_BF16_FLOPS if device.type == "cuda" else None,
           "profiled_device_seconds": device_total, "kernels": kernels}
    print(f"{mode:12s} materialized={materialize!s:5s} invariant={invariant!s:5s} {seconds:7.3f} s  "
          f"({flops / 1e12:.1f} TFLOP, {flops / seconds / 1e12:.0f} TFLOP/s)  device total {device_total:.3f} s",
          flush=True)
    for k in kernels[:12]:
        print(f"    {k['ms']:9.1f} ms  {k['calls']:6d}x  {k['name'][:110]}")
    return row


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cuda", show_default=True)
@click.option("--experts", type=int, default=384, show_default=True)
@click.option("--tokens", type=int, default=65536, show_default=True, help="Tokens in the chunk.")
@click.option("--mode", "modes", type=click.Choice(MODES), multiple=True, default=MODES, show_default=True)
@click.option("--materialize/--per-chunk", "materialize_options", default=None,
              help="Only one weight form (default: both).")
@click.option("--repeats", type=int, default=3, show_default=True)
@click.option("--also-plain", is_flag=True, help="Each setting again with BATCH_INVARIANT off.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), required=True)
def main(device, experts, tokens, modes, materialize_options, repeats, also_plain, json_path):
    dev = torch.device(device)
    forms = (True, False) if materialize_options is None else (materialize_options,)
    rows = []
    for mode in modes:
        settings = [(m, inv) for m in forms for inv in ((True, False) if also_plain else (True,))]
        for materialize, invariant in settings:
            rows.append(measure(dev, mode, materialize, experts, tokens, repeats, invariant))
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            json_path.parent.mkdir(parents=True, exist_ok=True)
            name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
            json_path.write_text(json.dumps({**provenance(), "device": name, "results": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
