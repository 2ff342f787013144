"""Checks of the row-span product kernel (`numerics.grouped_matmul_kernel`), shared by the GPU test and the CPU
interpreter.

Not a test module itself: `test_grouped_matmul_kernel.py` calls `check_products` / `check_invariance` on CUDA, and runs
this file as a script under `TRITON_INTERPRET=1` (Triton's CPU interpreter) where Triton is installed. The interpreter
mis-multiplies bfloat16 (Triton 3.9's `tl.dot` reads the raw 16-bit patterns), so it checks float16; the GPU checks
both.
"""

from __future__ import annotations

import sys

import torch

from kimi_nvfp4.numerics.grouped_matmul_kernel import grouped_matmul

# (rows, outputs, reduction, spans): spans not multiples of the 128-row tile, an empty span, rows outside every span,
# outputs and a reduction that are not multiples of the 128 x 64 tiles.
CASES = [
    (300, 96, 128, [(0, 100), (100, 100), (100, 300)]),
    (129, 130, 64, [(0, 129)]),
    (260, 40, 200, [(5, 7), (7, 150), (200, 260)]),
]


def _reference(x, spans, weights, n_out):
    out = torch.full((x.shape[0], n_out), float("nan"), dtype=torch.float64)
    for (a, b), w in zip(spans, weights):
        out[a:b] = x[a:b].double().cpu() @ w.double().cpu().t()
    return out


def check_products(device: str, dtypes=(torch.float16, torch.bfloat16)) -> int:
    """Each span's rows equal the product (fp32 accumulation: within the output dtype's rounding); rows outside every
    span are left as they were."""
    gen = torch.Generator().manual_seed(3)
    passed = 0
    for dtype in dtypes:
        for rows, n_out, k_in, spans in CASES:
            x = torch.randn(rows, k_in, generator=gen).to(device=device, dtype=dtype)
            weights = [torch.randn(n_out, k_in, generator=gen).to(device=device, dtype=dtype) for _ in spans]
            out = torch.full((rows, n_out), 7.0, dtype=dtype, device=device)
            grouped_matmul(x, spans, weights, out)
            ref = _reference(x, spans, weights, n_out)
            covered = torch.zeros(rows, dtype=torch.bool)
            for a, b in spans:
                covered[a:b] = True
            got = out.double().cpu()
            torch.testing.assert_close(got[covered], ref[covered], rtol=2e-2, atol=0.25)
            assert bool((got[~covered] == 7.0).all()), "rows outside the spans were written"
            passed += 1
    return passed


def check_invariance(device: str, dtype=torch.float16) -> int:
    """A row's bits do not depend on its span's length, its place in a tile or the other spans."""
    gen = torch.Generator().manual_seed(4)
    k_in, n_out = 192, 160
    x = torch.randn(400, k_in, generator=gen).to(device=device, dtype=dtype)
    w = torch.randn(n_out, k_in, generator=gen).to(device=device, dtype=dtype)
    other = torch.randn(n_out, k_in, generator=gen).to(device=device, dtype=dtype)
    alone = torch.empty(1, n_out, dtype=dtype, device=device)
    grouped_matmul(x[:1], [(0, 1)], [w], alone)
    checked = 0
    for layout in ([(0, 400)], [(0, 37), (37, 400)], [(0, 1), (1, 300)], [(0, 200), (200, 201)]):
        for row in (0, 36, 127, 128, 199, 399):
            if not any(a <= row < b for a, b in layout):
                continue
            order = list(range(400))
            order[0], order[row] = order[row], order[0]
            out = torch.empty(400, n_out, dtype=dtype, device=device)
            spans = layout
            weights = [w if a <= row < b else other for a, b in spans]
            grouped_matmul(x[order], spans, weights, out)
            assert torch.equal(out[row], alone[0]), (layout, row)
            checked += 1
    return checked


if __name__ == "__main__":
    device = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    print(check_products(device, dtypes=(torch.float16,)) + check_invariance(device))
