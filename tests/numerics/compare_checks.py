"""Checks of the fused weight-check kernel against `stats.error_sums`, shared by the GPU test and the CPU interpreter.

Not a test module itself: `test_compare_kernel.py` calls `check_compare_kernel` on CUDA, and runs this file as a
script under `TRITON_INTERPRET=1` (Triton's CPU interpreter) where Triton is installed.
"""

from __future__ import annotations

import math
import sys

import torch

from kimi_nvfp4.numerics.int4 import pack_int4
from kimi_nvfp4.numerics.methods import Int4Matrix, quantize_int4_matrices
from kimi_nvfp4.numerics.methods.stats import error_sums
from kimi_nvfp4.numerics.nvfp4 import NVFP4Tensor


def cases(device: str) -> list[tuple[str, torch.Tensor, torch.Tensor, NVFP4Tensor]]:
    """(name, packed INT4, bf16 group scales, NVFP4) -- converted, exact, corrupted and odd-sized matrices."""
    gen = torch.Generator().manual_seed(5)
    out = []
    for rows, cols in ((3, 64), (40, 512), (130, 1024)):
        codes = torch.randint(-8, 8, (rows, cols), generator=gen, dtype=torch.int8)
        scale = (torch.rand(rows, cols // 32, generator=gen) * 0.02 + 1e-4).to(torch.bfloat16)
        packed = pack_int4(codes)
        m = Int4Matrix.from_packed(packed, scale, cols)
        q = quantize_int4_matrices([m])[0]
        out.append((f"converted {rows}x{cols}", packed, scale, q))
        # another scale group's NVFP4: large errors everywhere
        other = NVFP4Tensor(q.weight.flip(0), q.weight_scale.flip(0), q.weight_scale_2 * 1.5)
        out.append((f"mismatched {rows}x{cols}", packed, scale, other))
    codes = torch.zeros(16, 64, dtype=torch.int8)
    zero = quantize_int4_matrices([Int4Matrix.from_packed(pack_int4(codes), torch.ones(16, 2).to(torch.bfloat16), 64)])[0]
    out.append(("all zero", pack_int4(codes), torch.ones(16, 2).to(torch.bfloat16), zero))
    name, packed, scale, q = out[2]
    bits = q.weight_scale.view(torch.uint8).clone()
    bits[0, 0] = 0x7F  # NaN block scale
    out.append(("nan scale", packed, scale, NVFP4Tensor(q.weight, bits.view(torch.float8_e4m3fn), q.weight_scale_2)))
    bits = q.weight_scale.view(torch.uint8).clone()
    bits[1, :] |= 0x80  # negative block scales
    out.append(("negative scales", packed, scale, NVFP4Tensor(q.weight, bits.view(torch.float8_e4m3fn), q.weight_scale_2)))
    return [(n, p.to(device), s.to(device), NVFP4Tensor(q.weight.to(device), q.weight_scale.to(device),
                                                          q.weight_scale_2.to(device))) for n, p, s, q in out]


def check_compare_kernel(device: str) -> int:
    from kimi_nvfp4.numerics.compare_kernel import compare_partials, reduce_partials

    items = cases(device)
    partials = [compare_partials(p, s, q.weight, q.weight_scale, q.weight_scale_2) for _, p, s, q in items]
    got = reduce_partials(partials).cpu().tolist()
    for (name, packed, scale, q), sums in zip(items, got):
        cols = packed.shape[1] * 8
        want = error_sums(Int4Matrix.from_packed(packed, scale, cols), q).cpu().tolist()
        for k, (a, b) in enumerate(zip(sums, want)):
            if math.isnan(b):
                assert math.isnan(a), (name, k, a, b)
            elif k in (2, 3):  # counts and the largest error: exact
                assert a == b, (name, k, a, b)
            else:
                assert math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0), (name, k, a, b)
    assert reduce_partials([]).shape == (0, 4)
    return len(items)


if __name__ == "__main__":  # under TRITON_INTERPRET=1, from test_compare_kernel.py
    print(check_compare_kernel(sys.argv[1] if len(sys.argv) > 1 else "cpu"))
