"""CPU timings of one K2.6 expert's conversion numerics, per step (best of several runs: the CPU is shared).

    python bench/profile_cpu_numerics.py [--repeat 5]

Builds a gate/up pair ([2048, 7168] each, uniform codes) and times the CPU byte-lookup steps (docs/numerics.md:
block keys, the int4-aware search, the encode, the error statistics) and whole conversions (gate+up, with and
without stats) for `int4-aware` and `amax`.
"""

from __future__ import annotations

import argparse
import time

import torch

from kimi_nvfp4.numerics.e4m3 import e4m3_from_bits
from kimi_nvfp4.numerics.methods import quantize as Q
from kimi_nvfp4.numerics.methods.batch import quantize_int4_groups
from kimi_nvfp4.numerics.methods.lut import BlockKeys
from kimi_nvfp4.numerics.methods.stats import error_sums
from kimi_nvfp4.numerics.methods.types import ScaleMethod

try:  # bench/ is not a package
    from profile_numerics import expert
except ImportError:  # pragma: no cover - run from the repository root
    import sys

    sys.path.insert(0, "bench")
    from profile_numerics import expert


def best_ms(f, repeat: int) -> float:
    f()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    gate, up = expert(torch.Generator().manual_seed(0), "cpu")[0]
    aware, amax = ScaleMethod.INT4_AWARE, ScaleMethod.AMAX
    ws2 = Q.shared_tensor_scale([gate, up], aware)
    b2 = Q.shared_tensor_scale([gate, up], amax)
    bits = Q.search_block_bits(gate, ws2, aware, b2)[0]
    q = Q.quantize_int4_matrices([gate, up])
    rows = {
        "block keys gate (lookups)": lambda: BlockKeys.of(gate),
        "search gate (baseline)": lambda: Q.search_block_bits(gate, ws2, aware, b2),
        "encode gate": lambda: Q._encode_rows(gate, e4m3_from_bits(bits), ws2),
        "amax quantize gate": lambda: Q._quantize_amax(gate, b2),
        "stats gate": lambda: error_sums(gate, q[0]),
        "whole gate+up int4-aware": lambda: Q.quantize_int4_matrices([gate, up], aware),
        "whole gate+up amax": lambda: Q.quantize_int4_matrices([gate, up], amax),
        "groups gate+up int4-aware +stats": lambda: quantize_int4_groups([[gate, up]], aware, record_stats=True),
        "groups gate+up amax +stats": lambda: quantize_int4_groups([[gate, up]], amax, record_stats=True),
    }
    for label, f in rows.items():
        print(f"{label:36s} {best_ms(f, args.repeat):8.1f} ms", flush=True)


if __name__ == "__main__":
    main()
