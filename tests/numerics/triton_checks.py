"""Checks of the fused Triton kernels against the torch path, shared by the GPU tests and the CPU interpreter run.

Not a test module itself: `test_triton_search.py` calls these on CUDA, and runs this file as a script under
`TRITON_INTERPRET=1` (Triton's CPU interpreter, numpy arithmetic) where Triton is installed. The interpreter
checks the kernels' logic; only the CUDA run checks their compiled arithmetic (no fused multiply-add).
"""

from __future__ import annotations

import sys

import torch

from kimi_nvfp4.numerics.e4m3 import e4m3_bits, e4m3_from_bits, e4m3_positive_values, round_block_scale_to_e4m3
from kimi_nvfp4.numerics.methods import Int4Matrix, ScaleMethod
from kimi_nvfp4.numerics.methods.quantize import (
    _encode_rows,
    _quantize_amax,
    power_of_two_tensor_scale,
    search_block_bits,
)
from kimi_nvfp4.numerics.methods.stats import error_sums
from kimi_nvfp4.numerics.nvfp4 import NVFP4Tensor, tensor_scales_from_amax


def edge_matrices() -> list[Int4Matrix]:
    """Realistic codes, zero and sparse blocks, all-extreme codes, and group scales from 2**-40 to 2**20 (so
    candidates clamp at both ends of E4M3 and hit its subnormals)."""
    gen = torch.Generator().manual_seed(7)
    mats = []
    for rows, cols, spread in ((32, 256, 0.3), (48, 512, 2.0), (16, 1024, 0.0)):
        w = torch.randn(rows, cols, generator=gen) * torch.exp(torch.randn(rows, 1, generator=gen) * spread)
        groups = w.reshape(rows, -1, 32)
        scale = (groups.abs().amax(-1) / 7.5).to(torch.bfloat16).float()
        codes = torch.clamp(torch.round(groups / scale.unsqueeze(-1)), -8, 7).to(torch.int8).reshape(rows, cols)
        codes[::5, :16] = 0  # all-zero blocks
        codes[1::7, 32:48] = -8  # |q| = 8 everywhere in a block
        codes[2::7, 64:80] = 0
        codes[2::7, 64] = 1  # one small code
        mats.append(Int4Matrix(codes, scale))
    codes = torch.randint(-8, 8, (64, 256), generator=gen, dtype=torch.int8)
    log_scale = torch.rand(64, 8, generator=gen) * 60.0 - 40.0
    mats.append(Int4Matrix(codes, torch.exp2(log_scale).to(torch.bfloat16).float()))
    return mats


def check_search_and_encode(device: str) -> int:
    """Kernels == torch per-block search and row encode, for both fallback choices. Returns matrices checked."""
    from kimi_nvfp4.numerics.methods import triton_search

    checked = 0
    for m in edge_matrices():
        m = m.to(device)
        amax = m.amax()
        ws2, base2 = power_of_two_tensor_scale(amax), tensor_scales_from_amax(amax)
        for scale_2 in (ws2, base2 * 3):  # a power of two, and a tensor scale that is not one
            ref = search_block_bits(m, scale_2, ScaleMethod.INT4_AWARE, base2, per_block=True)
            got = triton_search.search_blocks(m.codes, m.group_scale, scale_2, base2)
            assert torch.equal(got[0], ref[0]), "chosen block scales differ"
            assert torch.equal(got[1], ref[1]), "Model Optimizer's block scales differ"
            for a, b in ((got[2], ref[2]), (got[3], ref[3])):
                assert abs(float(a) - float(b)) <= 1e-9 * max(1.0, abs(float(b))), "error totals differ"
            for fallback in (False, True):
                flag = torch.tensor(fallback, device=device)
                packed, bits, row = triton_search.encode_blocks(
                    m.codes, m.group_scale, got[0], got[1], scale_2, base2, flag, stats=True
                )
                want_bits = got[1] if fallback else got[0]
                final_scale_2 = base2 if fallback else scale_2
                want = _encode_rows(m, e4m3_from_bits(want_bits), final_scale_2)
                assert torch.equal(bits, want_bits), "final block scales differ"
                assert torch.equal(packed, want), "packed E2M1 codes differ"
                check_stats(row, error_sums(m, NVFP4Tensor(want, e4m3_from_bits(want_bits), final_scale_2)))
            checked += 1
        # amax: the search kernel without candidates, encoded as a fallen-back group.
        none, amax_bits, _, _ = triton_search.search_blocks(m.codes, m.group_scale, ws2, base2, search=False)
        flag = torch.tensor(True, device=device)
        packed, bits, _ = triton_search.encode_blocks(m.codes, m.group_scale, amax_bits, amax_bits, ws2, base2, flag)
        want = _quantize_amax(m, base2)
        assert none is None
        assert torch.equal(packed, want.weight) and torch.equal(bits, want.weight_scale.view(torch.uint8)), "amax differs"
    return checked


def check_stats(got: torch.Tensor, want: torch.Tensor) -> None:
    """The kernel's `error_sums` row: same counts and max, float64 sums up to their summation order."""
    sse, ss, inexact, max_abs = got.tolist()
    want_sse, want_ss, want_inexact, want_max = want.tolist()
    assert inexact == want_inexact and max_abs == want_max, (got, want)
    assert abs(sse - want_sse) <= 1e-9 * want_sse and abs(ss - want_ss) <= 1e-12 * want_ss, (got, want)


def e4m3_rounding_inputs() -> torch.Tensor:
    """Every positive E4M3 value, the exact midpoints between neighbours (ties), one fp32 ulp either side of
    both, values beyond the clamp bounds, and random ones over the whole range."""
    values = e4m3_positive_values()
    mids = (values[1:] + values[:-1]) / 2  # exact in fp32
    points = torch.cat([values, mids, torch.tensor([0.0, 1e-30, 2.0**-10, 500.0, 1e30])])
    up = torch.nextafter(points, torch.full_like(points, float("inf")))
    down = torch.nextafter(points, torch.zeros_like(points))
    rand = torch.exp2(torch.rand(20000, generator=torch.Generator().manual_seed(3)) * 22.0 - 12.0)
    return torch.cat([points, up, down, rand])


def check_e4m3_rounding(device: str) -> int:
    """The kernels' bit-level E4M3 rounding == torch's clamp + cast."""
    from kimi_nvfp4.numerics.methods import triton_search

    x = e4m3_rounding_inputs().to(device)
    want = e4m3_bits(round_block_scale_to_e4m3(x))
    got = triton_search.e4m3_bits_of(x)
    assert torch.equal(got, want), f"{int((got != want).sum())} E4M3 roundings differ"
    return x.numel()


if __name__ == "__main__":  # under TRITON_INTERPRET=1, from test_triton_search.py
    print(check_e4m3_rounding("cpu"), check_search_and_encode("cpu"))
    sys.exit(0)
