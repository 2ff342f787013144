"""What batch invariance costs, and whether it holds, on one K2.6-shaped MoE decoder layer.

For each mode (`int4`: the INT4 stream calibrate and validate run; `nvfp4-w4a4`: the served emulation validate
runs), the layer's forward over `--tokens` tokens is timed with `batch_invariant.BATCH_INVARIANT` on and off, and
the same states are run again (median of `--repeats`) and once at a second chunk size (`--other-chunk`, which cuts sequences unevenly) to check
that every output row is bit-identical (on) -- and to measure how far apart the two cuts land without it (off).
Calibrate's layer step is two such passes (observe, advance), validate's one per stream, so the ratio is the
stages' cost ratio per layer up to their statistics.

    python -m bench.quality.batch_invariance --device cuda --experts 384 --tokens 65536 --json bench/results/batch_invariance_h200.json
    python -m bench.quality.batch_invariance --device cpu --experts 16 --tokens 1024 --json bench/results/batch_invariance_cpu.json
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import click
import torch

from bench.harness.synthetic_layer import MOE_LAYER, InMemoryLayerSource, synthetic_moe_layer
from bench.harness.provenance import provenance
from kimi_nvfp4.checkpoint.k2_config import K2Config
from kimi_nvfp4.model import batch_invariant
from kimi_nvfp4.model.runner import HiddenStates, LayerStreamRunner
from kimi_nvfp4.synth.configs import deepseek_v3_text_config

MODES = ("int4", "nvfp4-w4a4")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _states(cfg: K2Config, tokens: int, seq_len: int, device, dtype) -> HiddenStates:
    g = torch.Generator().manual_seed(1)
    lengths = [seq_len] * (tokens // seq_len) + ([tokens % seq_len] if tokens % seq_len else [])
    return HiddenStates([torch.randn(n, cfg.hidden_size, generator=g).to(device=device, dtype=dtype) for n in lengths])


def _forward(runner: LayerStreamRunner, states: HiddenStates, device) -> tuple[float, HiddenStates]:
    copy = HiddenStates([s.clone() for s in states.sequences])
    w = runner.load_layer(MOE_LAYER)
    _sync(device)
    start = time.perf_counter()
    out = runner.feed_forward(runner.attend(MOE_LAYER, copy, w), w)
    _sync(device)
    return time.perf_counter() - start, out


def measure(device: torch.device, mode: str, experts: int, tokens: int, seq_len: int, chunk: int,
            other_chunk: int, invariant: bool, repeats: int) -> dict:
    batch_invariant.BATCH_INVARIANT = invariant
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = K2Config.from_dict(deepseek_v3_text_config("k2.6", layers=2, experts=experts))
    source = InMemoryLayerSource(cfg, synthetic_moe_layer(cfg, mode, device, dtype=dtype))
    runners = {c: LayerStreamRunner(source, device=device, dtype=dtype, max_chunk_tokens=c, progress=False)
               for c in (chunk, other_chunk)}
    states = _states(cfg, tokens, seq_len, device, dtype)
    with torch.no_grad():
        _forward(runners[chunk], _states(cfg, min(tokens, 512), seq_len, device, dtype), device)  # warm-up
        times = []
        for _ in range(repeats):
            seconds, out = _forward(runners[chunk], states, device)
            times.append(seconds)
        seconds = sorted(times)[len(times) // 2]
        _, other = _forward(runners[other_chunk], states, device)
    a, b = torch.cat(out.sequences).float(), torch.cat(other.sequences).float()
    rows_differ = int((a != b).any(dim=-1).sum())
    # how far apart the two cuts land, relative to the output's scale (single values near 0 say nothing)
    rel = float((a - b).norm() / a.norm().clamp_min(1e-30))
    return {
        "mode": mode, "invariant": invariant, "device": str(device), "dtype": str(dtype).removeprefix("torch."),
        "experts": experts, "tokens": tokens, "seq_len": seq_len, "chunk_tokens": chunk, "other_chunk_tokens": other_chunk,
        "seconds": seconds, "seconds_each": times, "tokens_per_s": tokens / seconds, "rows_differing_between_cuts": rows_differ,
        "max_abs_difference_between_cuts": float((a - b).abs().max()),
        "rel_norm_difference_between_cuts": rel,
    }


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--experts", type=int, default=16, show_default=True)
@click.option("--tokens", type=int, default=1024, show_default=True)
@click.option("--seq-len", type=int, default=2048, show_default=True)
@click.option("--chunk", type=int, default=None, help="MLP/MoE chunk tokens (default: the stages' for the device).")
@click.option("--other-chunk", type=int, default=None, help="Second cut (default: chunk * 3 // 7, uneven).")
@click.option("--mode", "modes", type=click.Choice(MODES), multiple=True, default=MODES, show_default=True)
@click.option("--repeats", type=int, default=3, show_default=True, help="Timed forwards per setting (median).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None)
def main(device, experts, tokens, seq_len, chunk, other_chunk, modes, repeats, json_path):
    from kimi_nvfp4.model.runner import CUDA_MAX_CHUNK_TOKENS, DEFAULT_MAX_CHUNK_TOKENS

    dev = torch.device(device)
    chunk = chunk or (CUDA_MAX_CHUNK_TOKENS if dev.type == "cuda" else DEFAULT_MAX_CHUNK_TOKENS)
    other_chunk = other_chunk or max(1, min(chunk, tokens) * 3 // 7)
    rows = []
    for mode in modes:
        for invariant in (False, True):
            row = measure(dev, mode, experts, tokens, seq_len, chunk, other_chunk, invariant, repeats)
            rows.append(row)
            print(f"{mode:11s} invariant={str(invariant):5s} {row['seconds']:8.3f} s  {row['tokens_per_s']:10.0f} tok/s"
                  f"  rows differing between cuts: {row['rows_differing_between_cuts']}"
                  f" (|a-b|/|a| {row['rel_norm_difference_between_cuts']:.2e})", flush=True)
    for mode in modes:
        off, on = (r for r in rows if r["mode"] == mode)
        print(f"{mode}: invariant / plain time = {on['seconds'] / off['seconds']:.2f}x")
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        device_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
        json_path.write_text(json.dumps({**provenance(), "device": device_name, "results": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
