"""CPU timings of one K2.6 expert's conversion numerics, per step (best of several runs: the CPU is shared).

    python -m bench.profile.cpu_numerics [--repeat 5] --json bench/results/profile_cpu_numerics.json

Builds a gate/up pair ([2048, 7168] each, uniform codes) and times the CPU byte-lookup steps (docs/numerics.md:
block keys, the int4-aware search, the encode, the error statistics) and whole conversions (gate+up, with and
without stats) for `int4-aware` and `amax`.
"""

from __future__ import annotations

import time

import torch

from kimi_nvfp4.numerics.methods import ScaleMethod, quantize_int4_groups, quantize_int4_matrices
from kimi_nvfp4.numerics.methods.catalog.int4_aware import INT4_AWARE_RULE
from kimi_nvfp4.numerics.methods.search.cpu_search import KeyTable
from kimi_nvfp4.numerics.methods.search.cpu_tables import BlockKeys
from kimi_nvfp4.numerics.methods.search.encode import encode_by_lookup
from kimi_nvfp4.numerics.methods.search.reference import error_total_rows
from kimi_nvfp4.numerics.methods.search.rule import power_of_two_tensor_scale
from kimi_nvfp4.numerics.methods.stats import error_sums
from kimi_nvfp4.numerics.nvfp4 import tensor_scale_from_amax

from bench.harness.results import bench_parser, write_result
from bench.harness.synthetic_experts import expert


def best_ms(f, repeat: int) -> float:
    f()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    gate, up = expert(torch.Generator().manual_seed(0), "cpu")[0]
    aware, amax = ScaleMethod.INT4_AWARE, ScaleMethod.AMAX
    largest = torch.maximum(gate.amax(), up.amax())
    ws2 = power_of_two_tensor_scale(largest, INT4_AWARE_RULE.tensor_scale_headroom)
    b2 = tensor_scale_from_amax(largest)
    keys = BlockKeys.of(gate)
    total_rows = error_total_rows(gate, INT4_AWARE_RULE.count)

    def search():
        return KeyTable(keys.values, INT4_AWARE_RULE, ws2, b2).search(keys, total_rows)

    bits = search().chosen_bits
    q = quantize_int4_matrices([gate, up])
    rows = {
        "block keys gate (lookups)": lambda: BlockKeys.of(gate),
        "search gate (baseline)": search,
        "encode gate": lambda: encode_by_lookup(gate, keys, bits, ws2),
        "amax quantize gate": lambda: quantize_int4_matrices([gate], amax),
        "stats gate": lambda: error_sums(gate, q[0]),
        "whole gate+up int4-aware": lambda: quantize_int4_matrices([gate, up], aware),
        "whole gate+up amax": lambda: quantize_int4_matrices([gate, up], amax),
        "groups gate+up int4-aware +stats": lambda: quantize_int4_groups([[gate, up]], aware, record_stats=True),
        "groups gate+up amax +stats": lambda: quantize_int4_groups([[gate, up]], amax, record_stats=True),
    }
    timings = []
    for label, f in rows.items():
        ms = best_ms(f, args.repeat)
        print(f"{label:36s} {ms:8.1f} ms", flush=True)
        timings.append({"step": label, "best_ms": ms})
    write_result(args.json, {"repeat": args.repeat, "rows": timings}, device="cpu")


if __name__ == "__main__":
    main()
