"""Time the fused int4-aware Triton kernels on K2.6-shaped experts for several launch shapes (CUDA only).

    python -m bench.speed.triton_launch_shapes --experts 8 --json bench/results/triton_launch_shapes_h200.json

Prints GB/s of INT4 input for search + encode (no error stats) per (blocks per program, warps), and the same
conversion through `quantize_int4_groups` with the kernels and with the reference torch path (`path="reference"`).
"""

from __future__ import annotations

import time

import torch

from kimi_nvfp4.numerics.methods import SearchPath, quantize_int4_groups
from kimi_nvfp4.numerics.methods.search import triton_kernels as triton_search

from bench.harness.results import bench_parser, write_result
from bench.harness.synthetic_experts import expert


def _rate(fn, int4_bytes: int, repeats: int = 3) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return int4_bytes * repeats / 1e9 / (time.perf_counter() - start)


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--no-sweep", action="store_true", help="Skip the launch-shape sweep (only the rates as shipped).")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    groups = [g for _ in range(args.experts) for g in expert(gen, "cuda")]
    int4_bytes = sum(m.codes.numel() // 2 + m.group_scale.numel() * 2 for g in groups for m in g)
    sweep, rates = [], []
    original = (triton_search.BLOCKS_PER_PROGRAM, dict(triton_search._COMPILE))
    for blocks in () if args.no_sweep else (128, 256, 512):
        for warps in (4, 8):
            triton_search.BLOCKS_PER_PROGRAM = blocks
            triton_search._COMPILE["num_warps"] = warps
            rate = _rate(lambda: quantize_int4_groups(groups, "int4-aware"), int4_bytes)
            print(f"blocks={blocks:4d} warps={warps}: {rate:6.2f} GB/s INT4", flush=True)
            sweep.append({"blocks_per_program": blocks, "num_warps": warps, "gb_per_s_int4": rate})
    triton_search.BLOCKS_PER_PROGRAM, triton_search._COMPILE = original[0], original[1]
    for label, path in (("kernels", SearchPath.TRITON), ("torch path", SearchPath.REFERENCE)):
        for stats in (False, True):
            rate = _rate(lambda: quantize_int4_groups(groups, "int4-aware", record_stats=stats, path=path), int4_bytes)
            print(f"quantize_int4_groups int4-aware, {label}, stats={stats}: {rate:.2f} GB/s INT4", flush=True)
            rates.append({"method": "int4-aware", "path": label, "stats": stats, "gb_per_s_int4": rate})
    rate = _rate(lambda: quantize_int4_groups(groups, "amax"), int4_bytes)
    print(f"quantize_int4_groups amax: {rate:.2f} GB/s INT4", flush=True)
    rates.append({"method": "amax", "path": "kernels", "stats": False, "gb_per_s_int4": rate})
    write_result(args.json, {"experts": args.experts, "int4_bytes": int4_bytes, "launch_shapes": sweep, "rates": rates},
                 device="cuda")


if __name__ == "__main__":
    main()
