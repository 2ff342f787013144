"""Kernel-level profile of the batched conversion numerics on one device (torch.profiler).

    python bench/profile_numerics.py --device cuda --experts 4 --method int4-aware

Builds K2.6-shaped INT4 experts (gate/up [2048, 7168], down [7168, 2048]) on the device, converts them with
`quantize_int4_groups` (with and without error stats), prints GB/s of INT4 input and the top kernels.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from kimi_nvfp4.numerics.methods import quantize_int4_groups

from bench.harness.synthetic_experts import expert

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--method", default="int4-aware")
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    groups = [g for _ in range(args.experts) for g in expert(gen, args.device)]
    int4_bytes = sum(m.codes.numel() // 2 + m.group_scale.numel() * 2 for g in groups for m in g)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    for stats in (False, True):
        quantize_int4_groups(groups[:3], args.method, record_stats=stats)
        sync()
        start = time.perf_counter()
        quantize_int4_groups(groups, args.method, record_stats=stats)
        sync()
        seconds = time.perf_counter() - start
        print(f"{args.method} stats={stats}: {seconds * 1e3:.1f} ms, {int4_bytes / 1e9 / seconds:.2f} GB/s INT4", flush=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    with profile(activities=activities) as prof:
        quantize_int4_groups(groups, args.method, record_stats=True)
        sync()
    key = "cuda_time_total" if args.device == "cuda" else "cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=args.top, max_name_column_width=60))


if __name__ == "__main__":
    main()
