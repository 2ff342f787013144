"""Where the batched GPTQ solver spends its time at K2.6 shapes (issue 16: gptq costs ~232 s per 384-expert layer
on the H200, 78% of it in gate/up's 7,168-wide Hessians).

Times `gptq_solver.gptq_quantize` on `--experts` experts of one input kind with synthetic INT4-grid weights and a
well-conditioned Hessian (random, not calibration statistics: timing only), split into the Hessian's Cholesky factor
and the column loop, with torch.profiler's top CUDA kernels by count and time for the column loop.

    python -m bench.profile.gptq --device cuda --experts 16 --kind gate_up --json bench/results/profile_gptq_h200.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch


from kimi_nvfp4.numerics.constants import NVFP4_BLOCK_SIZE
from kimi_nvfp4.numerics.e4m3 import e4m3_bits, round_block_scale_to_e4m3
from kimi_nvfp4.numerics.methods.output_aware import gptq_solver
from kimi_nvfp4.numerics.nvfp4 import tensor_scale_from_amax

from bench.harness.provenance import provenance

K26_SHAPES = {"gate_up": (2 * 2048, 7168), "down": (7168, 2048)}  # rows (gate and up stacked), input width


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def problem(experts: int, rows: int, width: int, device: torch.device, seed: int = 0):
    gen = torch.Generator(device=device).manual_seed(seed)
    weight = (torch.randint(-8, 8, (experts, rows, width), generator=gen, device=device).double()
              * 0.01 * torch.rand(experts, rows, width // 32, 1, generator=gen, device=device, dtype=torch.float64)
              .expand(-1, -1, -1, 32).reshape(experts, rows, width))
    tokens = 2 * width
    x = torch.randn(experts, tokens, width, generator=gen, device=device, dtype=torch.float64)
    hessian = x.transpose(1, 2) @ x / tokens
    del x
    scale_2 = torch.stack([tensor_scale_from_amax(w.abs().amax().float()) for w in weight]).to(device)
    blocks = weight.abs().reshape(experts, rows, width // NVFP4_BLOCK_SIZE, NVFP4_BLOCK_SIZE).amax(-1)
    search_bits = e4m3_bits(round_block_scale_to_e4m3((blocks / (6.0 * scale_2.view(-1, 1, 1))).float())).to(torch.uint8)
    return weight, hessian, scale_2, search_bits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--kind", choices=tuple(K26_SHAPES), default="gate_up")
    ap.add_argument("--rows", type=int, default=None, help="keep this many rows (default: K2.6's)")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    rows, width = K26_SHAPES[args.kind]
    rows = args.rows or rows
    weight, hessian, scale_2, search_bits = problem(args.experts, rows, width, device)
    gptq_solver.gptq_quantize(weight[:1, :64], hessian[:1], scale_2[:1], search_bits[:1, :64])  # warm-up
    _sync(device)
    t0 = time.perf_counter()
    gptq_solver.hessian_factor(hessian)
    _sync(device)
    factor_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    codes, bits, ok = gptq_solver.gptq_quantize(weight, hessian, scale_2, search_bits)
    _sync(device)
    total_s = time.perf_counter() - t0
    record = {
        **provenance(device=device),
        "machine": platform.platform(), "kind": args.kind, "experts": args.experts, "rows": rows, "width": width,
        "factor_s": factor_s, "gptq_quantize_s": total_s, "column_loop_s": total_s - factor_s,
        "s_per_expert": total_s / args.experts, "projected_s_per_384_experts": total_s / args.experts * 384,
        "factorised": int(ok.sum()),
    }
    if not args.no_profile:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        sub = max(1, args.experts // 4)
        with profile(activities=activities) as prof:
            gptq_solver.gptq_quantize(weight[:sub], hessian[:sub], scale_2[:sub], search_bits[:sub])
            _sync(device)
        key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
        events = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)[:15]
        record["profile_experts"] = sub
        record["top_ops"] = [{"name": e.key, "count": e.count, "self_ms": getattr(e, key) / 1e3} for e in events]
    print(json.dumps(record, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
