"""Checks of the fused GPTQ block kernel (`numerics.gptq_block_kernel`) against the torch block step it replaces
(`gptq_solver._block_reference`), shared by the GPU test and the CPU interpreter.

Not a test module itself: `test_gptq_block_kernel.py` calls `check_blocks` / `check_gptq_quantize` on CUDA, and runs
this file as a script under `TRITON_INTERPRET=1` (Triton's CPU interpreter) where Triton is installed.
"""

from __future__ import annotations

import sys

import torch

from kimi_nvfp4.numerics.e2m1 import _DECISION_BOUNDS
from kimi_nvfp4.numerics.e4m3 import e4m3_bits, round_block_scale_to_e4m3
from kimi_nvfp4.numerics.methods.output_aware import gptq_solver

BLOCK = 16
QUARTER_BITS = 0x28  # E4M3 0.25


def _triangles(experts: int, width: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(experts, 3 * width, width, generator=gen, dtype=torch.float64)
    x = x * torch.logspace(-2, 1, width, dtype=torch.float64)  # uneven channel energies: pivots far from 1
    factor, ok = gptq_solver.hessian_factor(x.transpose(1, 2) @ x / x.shape[1])
    assert bool(ok.all())
    return gptq_solver._diagonal_blocks(factor)


def block_cases(device: str) -> list[tuple]:
    """(name, batch [E, R, W], weight [E, R, in], inverse, restore, search_bits, scale_2, window, block_start,
    column): random weights over several decades, pushed weights that differ from the originals, rows not a
    multiple of the kernel's row tile, weights on E2M1 decision bounds (ties, in both signs) under a 0.25 scale,
    zeros and negative zeros, a block that is not the batch's first."""
    gen = torch.Generator().manual_seed(5)
    out = []
    for experts, rows, width, block_start, column in ((1, 5, 32, 0, 0), (3, 70, 64, 16, 48), (2, 130, 48, 32, 32)):
        inverse, restore = _triangles(experts, max(width, column + BLOCK), gen)
        weight = torch.randn(experts, rows, inverse.shape[1] * BLOCK, generator=gen, dtype=torch.float64) \
            * torch.logspace(-3, 1, rows, dtype=torch.float64).view(1, -1, 1)
        batch = weight[..., column - block_start : column - block_start + width].clone()
        batch += 0.1 * torch.randn(batch.shape, generator=gen, dtype=torch.float64) * batch.abs()
        scale_2 = (torch.rand(experts, generator=gen) * 0.01 + 1e-3).float()
        amax = weight.abs().reshape(experts, rows, -1, BLOCK).amax(-1)
        search = e4m3_bits(round_block_scale_to_e4m3((amax / (6.0 * scale_2.double().view(-1, 1, 1))).float()))
        search = (search.to(torch.int16) + torch.randint(-2, 3, search.shape, generator=gen)).clamp(1, 126)
        out.append((f"random E{experts} R{rows}", batch, weight, inverse, restore, search.to(torch.uint8), scale_2,
                    (-3, 7), block_start, column))
    experts, rows, width = 2, 66, 32
    inverse, restore = _triangles(experts, width, gen)
    bounds = torch.tensor(_DECISION_BOUNDS, dtype=torch.float64)
    picks = bounds[torch.randint(0, len(bounds), (experts, rows, width), generator=gen)]
    signs = torch.randint(0, 2, (experts, rows, width), generator=gen).double() * 2 - 1
    weight = picks * signs * 0.25
    weight[..., ::BLOCK] = 1.5 * signs[..., ::BLOCK]  # amax 6 x 0.25: the window's one candidate is the search's
    weight[:, ::7, 1:BLOCK] = 0.0
    weight[:, 3::7, 1:BLOCK] = -0.0
    search = torch.full((experts, rows, width // BLOCK), QUARTER_BITS, dtype=torch.uint8)
    out.append(("ties, zeros, -0", weight.clone(), weight, inverse, restore, search, torch.ones(experts),
                (0, 0), 0, 0))
    return [(n, b.to(device), w.to(device), i.to(device), r.to(device), s.to(device), s2.to(device), win, bs, c)
            for n, b, w, i, r, s, s2, win, bs, c in out]


def _run(fn, batch, weight, inverse, restore, search, scale_2, window, block_start, column):
    experts, rows, _ = batch.shape
    batch = batch.clone()
    codes = torch.full(weight.shape, 255, dtype=torch.uint8, device=batch.device)
    bits = torch.zeros_like(search)
    errors = torch.zeros_like(batch)
    fn(batch, weight, block_start, column, inverse, restore, search, scale_2, window, codes, bits, errors)
    return codes, bits, errors + 0.0  # + 0.0: a zero's sign is not part of the contract (the kernel's docstring)


def check_blocks(device: str) -> int:
    from kimi_nvfp4.numerics.gptq_block_kernel import gptq_block

    passed = 0
    for name, *case in block_cases(device):
        want = _run(gptq_solver._block_reference, *case)
        got = _run(gptq_block, *case)
        for what, a, b in zip(("codes", "bits", "errors"), got, want):
            assert torch.equal(a, b), (name, what)
        passed += 1
    return passed


def check_gptq_quantize(device: str) -> int:
    """Whole solver runs, fused vs torch path on the same device: identical codes and block scales."""
    gen = torch.Generator().manual_seed(9)
    passed = 0
    for experts, rows, width, block_columns in ((2, 40, 64, 32), (3, 100, 96, 48)):
        x = torch.randn(experts, 4 * width, width, generator=gen, dtype=torch.float64)
        hessian = (x.transpose(1, 2) @ x / x.shape[1]).to(device)
        weight = (torch.randint(-8, 8, (experts, rows, width), generator=gen).double() * 0.01).to(device)
        scale_2 = torch.full((experts,), 0.08 / 2688, dtype=torch.float32, device=device)
        search_bits = torch.full((experts, rows, width // BLOCK), 0x30, dtype=torch.uint8, device=device)
        results = [gptq_solver.gptq_quantize(weight, hessian, scale_2, search_bits, block_columns=block_columns,
                                             fused=fused) for fused in (False, True)]
        (c0, b0, _), (c1, b1, _) = results
        assert torch.equal(c0, c1) and torch.equal(b0, b1), (experts, rows, width)
        passed += 1
    return passed


if __name__ == "__main__":
    print(check_blocks(sys.argv[1] if len(sys.argv) > 1 else "cpu"))
