"""Synthetic K2.6-shaped INT4 experts (gate/up [2048, 7168], down [7168, 2048]) for the numerics benches.

`synthetic_experts`: weights ~ N(0, 1) times a per-row log-normal spread, quantized per group of 32 as
compressed-tensors does for symmetric int4 (scale = absmax / 7.5 rounded to bf16). `expert`: random codes and
scales, the shape alone (what the rate benches time).
"""

from __future__ import annotations

import torch

from kimi_nvfp4.numerics.methods import Int4Matrix

HIDDEN = 7168
MOE_INTERMEDIATE = 2048
INT4_SYMMETRIC_DIVISOR = 7.5  # compressed-tensors: scale = absmax / ((qmax - qmin) / 2)
ROW_SPREAD_SIGMA = 0.3


def synthetic_int4(rows: int, cols: int, gen: torch.Generator, device: str) -> Int4Matrix:
    w = torch.randn(rows, cols, generator=gen) * torch.exp(torch.randn(rows, 1, generator=gen) * ROW_SPREAD_SIGMA)
    groups = w.reshape(rows, -1, 32)
    scale = (groups.abs().amax(-1) / INT4_SYMMETRIC_DIVISOR).to(torch.bfloat16).to(torch.float32)
    codes = torch.clamp(torch.round(groups / scale.unsqueeze(-1)), -8, 7).to(torch.int8).reshape(rows, cols)
    return Int4Matrix(codes, scale).to(device)


def synthetic_experts(n: int, rows: int | None, seed: int, device: str) -> list[tuple[str, dict[str, Int4Matrix]]]:
    gen = torch.Generator().manual_seed(seed)
    experts = []
    for e in range(n):
        up_rows = min(rows or MOE_INTERMEDIATE, MOE_INTERMEDIATE)
        down_rows = min(rows or HIDDEN, HIDDEN)
        experts.append(
            (
                f"experts.{e}",
                {
                    "gate_proj": synthetic_int4(up_rows, HIDDEN, gen, device),
                    "up_proj": synthetic_int4(up_rows, HIDDEN, gen, device),
                    "down_proj": synthetic_int4(down_rows, MOE_INTERMEDIATE, gen, device),
                },
            )
        )
    return experts


WIDTH, GROUP = MOE_INTERMEDIATE, 32


def expert(gen: torch.Generator, device: str) -> list[list[Int4Matrix]]:
    def matrix(rows: int, cols: int) -> Int4Matrix:
        codes = torch.randint(-8, 8, (rows, cols), generator=gen, dtype=torch.int8)
        scale = (torch.rand(rows, cols // GROUP, generator=gen) * 1e-2 + 1e-3).to(torch.bfloat16).float()
        return Int4Matrix(codes.to(device), scale.to(device))

    return [[matrix(WIDTH, HIDDEN), matrix(WIDTH, HIDDEN)], [matrix(HIDDEN, WIDTH)]]
