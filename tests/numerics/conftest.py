"""Fixtures for numerics tests: synthetic INT4 matrices with a realistic code distribution."""

from __future__ import annotations

import pytest
import torch

from kimi_nvfp4.checkpoint_builder.int4 import quantize_int4
from kimi_nvfp4.numerics.methods import Int4Matrix


def realistic_int4(rows: int, cols: int, seed: int = 0, row_spread: float = 0.3) -> Int4Matrix:
    """Gaussian weights, symmetric INT4 per group of 32 with scale absmax/7.5 in bf16 (compressed-tensors, by the
    checkpoint builder's quantizer)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=gen) * torch.exp(torch.randn(rows, 1, generator=gen) * row_spread)
    codes, scale = quantize_int4(w, in_place=True)
    return Int4Matrix(codes, scale.to(torch.float32))


@pytest.fixture
def int4_pair() -> tuple[Int4Matrix, Int4Matrix]:
    """A gate/up pair with different magnitudes (so the shared weight_scale_2 matters)."""
    gate = realistic_int4(32, 256, seed=1)
    up = realistic_int4(32, 256, seed=2)
    up = Int4Matrix(up.codes, (up.group_scale * 3).to(torch.bfloat16).to(torch.float32))
    return gate, up


def heavy_tailed_rows(
    tokens: int, width: int, seed: int = 0, outliers: int = 4, outlier_gain: float = 30.0, rank: int = 8
) -> torch.Tensor:
    """Activation rows `[tokens, width]` like an MoE expert's inputs: correlated channels (a low-rank common part),
    log-normal channel scales with a few outlier channels `outlier_gain` times larger, per-token scale spread."""
    gen = torch.Generator().manual_seed(seed)
    channel = torch.exp(torch.randn(width, generator=gen) * 0.5)
    channel[torch.randperm(width, generator=gen)[:outliers]] *= outlier_gain
    mixing = torch.randn(rank, width, generator=gen) / rank**0.5
    x = torch.randn(tokens, width, generator=gen) + torch.randn(tokens, rank, generator=gen) @ mixing
    return x * channel * torch.exp(torch.randn(tokens, 1, generator=gen) * 0.3)
