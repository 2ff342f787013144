"""Kernel-level profile of the batched conversion numerics on one device (torch.profiler).

    python -m bench.profile.numerics --device cuda --experts 4 --method int4-aware --json bench/results/profile_numerics_h200.json

Builds K2.6-shaped INT4 experts (gate/up [2048, 7168], down [7168, 2048]) on the device, converts them with
`quantize_int4_groups` (with and without error stats), prints GB/s of INT4 input and the top kernels.
"""

from __future__ import annotations

import time

import torch
from torch.profiler import ProfilerActivity, profile

from kimi_nvfp4.numerics.methods import quantize_int4_groups

from bench.harness.results import bench_parser, write_result
from bench.harness.synthetic_experts import expert

def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--method", default="int4-aware")
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    groups = [g for _ in range(args.experts) for g in expert(gen, args.device)]
    int4_bytes = sum(m.codes.numel() // 2 + m.group_scale.numel() * 2 for g in groups for m in g)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    rates = []
    for stats in (False, True):
        quantize_int4_groups(groups[:3], args.method, record_stats=stats)
        sync()
        start = time.perf_counter()
        quantize_int4_groups(groups, args.method, record_stats=stats)
        sync()
        seconds = time.perf_counter() - start
        print(f"{args.method} stats={stats}: {seconds * 1e3:.1f} ms, {int4_bytes / 1e9 / seconds:.2f} GB/s INT4", flush=True)
        rates.append({"stats": stats, "seconds": seconds, "gb_per_s_int4": int4_bytes / 1e9 / seconds})
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    with profile(activities=activities) as prof:
        quantize_int4_groups(groups, args.method, record_stats=True)
        sync()
    key = "cuda_time_total" if args.device == "cuda" else "cpu_time_total"
    averages = prof.key_averages()
    print(averages.table(sort_by=key, row_limit=args.top, max_name_column_width=60))
    top = sorted(averages, key=lambda e: getattr(e, key.replace("_total", "_total"), 0), reverse=True)[: args.top]
    ops = [{"name": e.key, "calls": e.count, "self_cpu_us": e.self_cpu_time_total,
            "device_us": getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0))} for e in top]
    write_result(args.json, {"method": args.method, "experts": args.experts, "int4_bytes": int4_bytes,
                             "rates": rates, "top_ops": ops}, device=args.device)


if __name__ == "__main__":
    main()
