"""Checks of the fused GPTQ block kernel (`numerics.gptq_block_kernel`) against the torch column loop it replaces,
shared by the GPU test and the CPU interpreter.

Not a test module itself: `test_gptq_block_kernel.py` calls `check_block_columns` / `check_gptq_quantize` on CUDA,
and runs this file as a script under `TRITON_INTERPRET=1` (Triton's CPU interpreter) where Triton is installed.
"""

from __future__ import annotations

import sys

import torch

from kimi_nvfp4.numerics.e2m1 import _DECISION_BOUNDS
from kimi_nvfp4.numerics.methods.output_aware import gptq_solver

BLOCK = 16


def _factor(experts: int, width: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(experts, 3 * width, width, generator=gen, dtype=torch.float64)
    x = x * torch.logspace(-2, 1, width, dtype=torch.float64)  # uneven channel energies: pivots far from 1
    upper, ok = gptq_solver.inverse_hessian_factor(x.transpose(1, 2) @ x / x.shape[1])
    assert bool(ok.all())
    return upper


def block_cases(device: str) -> list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor, int, int]]:
    """(name, batch [E, R, W], divisor [E, R] fp32, upper [E, in, in], block_start, column): random weights over
    several decades, rows not a multiple of the kernel's row tile, weights on E2M1 decision bounds (ties, in both
    signs), zeros and negative zeros, a block that is not the batch's first."""
    gen = torch.Generator().manual_seed(5)
    out = []
    for experts, rows, width, block_start, column in ((1, 5, 32, 0, 0), (3, 70, 64, 16, 48), (2, 130, 48, 32, 32)):
        upper = _factor(experts, max(width, column + BLOCK), gen)
        batch = torch.randn(experts, rows, width, generator=gen, dtype=torch.float64) * torch.logspace(
            -3, 1, rows, dtype=torch.float64).view(1, -1, 1)
        divisor = (torch.rand(experts, rows, generator=gen) * 0.5 + 0.05).float()
        out.append((f"random E{experts} R{rows}", batch, divisor, upper, block_start, column))
    experts, rows, width = 2, 66, 32
    upper = _factor(experts, width, gen)
    divisor = torch.full((experts, rows), 0.25, dtype=torch.float32)
    bounds = torch.tensor(_DECISION_BOUNDS, dtype=torch.float64)
    picks = bounds[torch.randint(0, len(bounds), (experts, rows, width), generator=gen)]
    signs = torch.randint(0, 2, (experts, rows, width), generator=gen).double() * 2 - 1
    batch = picks * signs * 0.25
    batch[:, ::7, :] = 0.0
    batch[:, 3::7, :] = -0.0
    out.append(("ties, zeros, -0", batch, divisor, upper, 0, 0))
    return [(n, b.to(device), d.to(device), u.to(device), s, c) for n, b, d, u, s, c in out]


def _run(fn, batch, divisor, upper, block_start, column, reference: bool):
    experts, rows, width = batch.shape
    batch = batch.clone()
    codes = torch.full((experts, rows, upper.shape[-1]), 255, dtype=torch.uint8, device=batch.device)
    errors = torch.zeros_like(batch)
    if reference:
        diagonal = upper.diagonal(dim1=-2, dim2=-1)
        fn(batch, block_start, divisor, upper, diagonal, column, codes, errors)
    else:
        fn(batch, block_start, divisor, upper, column, codes, errors)
    return codes, errors + 0.0  # + 0.0: a zero's sign is not part of the contract (module docstring of the kernel)


def check_block_columns(device: str) -> int:
    from kimi_nvfp4.numerics.gptq_block_kernel import gptq_block_columns

    passed = 0
    for name, batch, divisor, upper, block_start, column in block_cases(device):
        ref_codes, ref_errors = _run(gptq_solver._block_columns_reference, batch, divisor, upper, block_start,
                                     column, reference=True)
        codes, errors = _run(gptq_block_columns, batch, divisor, upper, block_start, column, reference=False)
        assert torch.equal(codes, ref_codes), name
        assert torch.equal(errors, ref_errors), name
        passed += 1
    return passed


def check_gptq_quantize(device: str) -> int:
    """Whole solver runs, fused vs torch loop on the same device: identical codes and block scales."""
    gen = torch.Generator().manual_seed(9)
    passed = 0
    for experts, rows, width, block_columns in ((2, 40, 64, 32), (3, 100, 96, 48)):
        x = torch.randn(experts, 4 * width, width, generator=gen, dtype=torch.float64)
        hessian = (x.transpose(1, 2) @ x / x.shape[1]).to(device)
        weight = (torch.randint(-8, 8, (experts, rows, width), generator=gen).double() * 0.01).to(device)
        scale_2 = torch.full((experts,), 0.08 / 2688, dtype=torch.float32, device=device)
        search_bits = torch.full((experts, rows, width // BLOCK), 0x30, dtype=torch.uint8, device=device)
        results = []
        for fused in (False, True):
            gptq_solver.USE_FUSED_GPTQ = fused
            try:
                results.append(gptq_solver.gptq_quantize(weight, hessian, scale_2, search_bits,
                                                         block_columns=block_columns))
            finally:
                gptq_solver.USE_FUSED_GPTQ = True
        (c0, b0, _), (c1, b1, _) = results
        assert torch.equal(c0, c1) and torch.equal(b0, b1), (experts, rows, width)
        passed += 1
    return passed


if __name__ == "__main__":
    print(check_block_columns(sys.argv[1] if len(sys.argv) > 1 else "cpu"))
