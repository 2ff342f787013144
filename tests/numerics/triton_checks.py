"""Checks of the fused Triton kernels against the reference, shared by the GPU tests and the CPU interpreter run.

Not a test module itself: `test_triton_kernels.py` calls these on CUDA, and runs this file as a script under
`TRITON_INTERPRET=1` (Triton's CPU interpreter, numpy arithmetic) where Triton is installed. The interpreter
checks the kernels' logic; only the CUDA run checks their compiled arithmetic (no fused multiply-add).
"""

from __future__ import annotations

import sys

import torch

from kimi_nvfp4.numerics.e4m3 import e4m3_bits, e4m3_from_bits, e4m3_positive_values, round_block_scale_to_e4m3
from kimi_nvfp4.numerics.methods import Int4Matrix
from kimi_nvfp4.numerics.methods.catalog.int4_aware import INT4_AWARE_RULE
from kimi_nvfp4.numerics.methods.search.encode import encode_rows
from kimi_nvfp4.numerics.methods.search.reference import model_optimizer_block_bits, search_reference
from kimi_nvfp4.numerics.methods.search.rule import (
    AlignedTarget,
    AmaxFractionTarget,
    CandidateRule,
    power_of_two_tensor_scale,
)
from kimi_nvfp4.numerics.methods.stats import error_sums
from kimi_nvfp4.numerics.nvfp4 import NVFP4Tensor, tensor_scales_from_amax

# Another rule of the kernel's shape (other divisors, offsets, aligned threshold): the kernel must follow the data.
OTHER_RULE = CandidateRule(
    fractions=(AmaxFractionTarget(divisor=6.0, lowest=-1, highest=2), AmaxFractionTarget(divisor=3.0, lowest=0, highest=0)),
    aligned=AlignedTarget(wide_from_code=6, wide_multiple=2.0, lowest=0, highest=1),
)


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


def _check_search(kernels, m: Int4Matrix, rule: CandidateRule, scale_2: torch.Tensor, base2: torch.Tensor):
    ref = search_reference(m, scale_2, base2, rule)
    got = kernels.search_blocks(m.codes, m.group_scale, scale_2, base2, rule)
    assert torch.equal(got.chosen_bits, ref.chosen_bits), "chosen block scales differ"
    assert torch.equal(got.baseline_bits, ref.baseline_bits), "Model Optimizer's block scales differ"
    for a, b in ((got.chosen_error, ref.chosen_error), (got.baseline_error, ref.baseline_error)):
        assert abs(float(a) - float(b)) <= 1e-9 * max(1.0, abs(float(b))), "error totals differ"
    return got


def check_search_and_encode(device: str) -> int:
    """Kernels == the reference search and row encode, under both tensor scales. Returns matrices checked."""
    from kimi_nvfp4.numerics.methods.search import triton_kernels as kernels

    checked = 0
    for i, m in enumerate(edge_matrices()):
        m = m.to(device)
        amax = m.amax()
        ws2 = power_of_two_tensor_scale(amax, INT4_AWARE_RULE.tensor_scale_headroom)
        base2 = tensor_scales_from_amax(amax)
        for scale_2 in (ws2, base2 * 3):  # a power of two, and a tensor scale that is not one
            got = _check_search(kernels, m, INT4_AWARE_RULE, scale_2, base2)
            for bits, final_scale_2 in ((got.chosen_bits, scale_2), (got.baseline_bits, base2)):
                packed, row = kernels.encode_blocks(m.codes, m.group_scale, bits, final_scale_2, stats=True)
                want = encode_rows(m, bits, final_scale_2)
                assert torch.equal(packed, want), "packed E2M1 codes differ"
                check_stats(row, error_sums(m, NVFP4Tensor(want, e4m3_from_bits(bits), final_scale_2)))
            checked += 1
        if i < 2:
            _check_search(kernels, m, OTHER_RULE, ws2, base2)
        # amax: the search kernel without candidates.
        bits = kernels.model_optimizer_bits(m.codes, m.group_scale, base2)
        assert torch.equal(bits, model_optimizer_block_bits(m, base2)), "amax block scales differ"
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
    from kimi_nvfp4.numerics.methods.search import triton_kernels as kernels

    x = e4m3_rounding_inputs().to(device)
    want = e4m3_bits(round_block_scale_to_e4m3(x))
    got = kernels.e4m3_bits_of(x)
    assert torch.equal(got, want), f"{int((got != want).sum())} E4M3 roundings differ"
    return x.numel()


if __name__ == "__main__":  # under TRITON_INTERPRET=1, from test_triton_kernels.py
    print(check_e4m3_rounding("cpu"), check_search_and_encode("cpu"))
    sys.exit(0)
