"""Checks of the fused per-expert statistics kernel against `segment_stats_reference`, shared by the GPU test and the
CPU interpreter.

Not a test module itself: `test_segment_stats_kernel.py` calls `check_segment_stats` on CUDA, and runs this file as a
script under `TRITON_INTERPRET=1` (Triton's CPU interpreter) where Triton is installed.
"""

from __future__ import annotations

import sys

import torch

from kimi_nvfp4.calibrate.stats import segment_stats_reference

# float64 sums of the same float32 squares, added in another order
SUM_RTOL = 1e-12


def cases(device: str) -> list[tuple[str, torch.Tensor, list[tuple[int, int]]]]:
    """(name, rows, spans): bf16 and fp32 buffers, spans of 1 row to several row tiles, widths that are not a
    multiple of the channel block, a strided buffer, huge and tiny values, NaN and inf."""
    gen = torch.Generator().manual_seed(11)
    out = []
    for dtype in (torch.bfloat16, torch.float32):
        for width in (16, 200, 384):
            x = torch.randn(300, width, generator=gen) * torch.logspace(-3, 3, width)
            spans = [(0, 1), (1, 40), (40, 41), (41, 170), (170, 300)]
            out.append((f"{dtype} width {width}", x.to(dtype), spans))
    x = torch.randn(64, 96, generator=gen) * 1e30
    x[5, 3] = float("inf")
    out.append(("huge and inf", x, [(0, 10), (10, 64)]))
    x = torch.randn(64, 96, generator=gen)
    x[20, 7] = float("nan")
    out.append(("nan in the second span", x.to(torch.bfloat16), [(0, 16), (16, 33), (33, 64)]))
    wide = torch.randn(50, 300, generator=gen)
    out.append(("strided rows", wide[:, :256], [(0, 25), (25, 50)]))
    out.append(("subset of rows", torch.randn(80, 32, generator=gen), [(3, 9), (30, 31)]))
    return [(name, rows.to(device), spans) for name, rows, spans in out]


def check_segment_stats(device: str) -> int:
    from kimi_nvfp4.numerics.segment_stats_kernel import segment_stats

    passed = 0
    for name, rows, spans in cases(device):
        amax, sums = segment_stats(rows, spans)
        ref_amax, ref_sums = segment_stats_reference(rows.cpu(), spans)
        amax, sums = amax.cpu(), sums.cpu()
        assert amax.dtype == torch.float32 and sums.dtype == torch.float64, name
        assert torch.equal(amax.isnan(), ref_amax.isnan()), f"{name}: NaN amax differs"
        assert torch.equal(amax.nan_to_num(0.0), ref_amax.nan_to_num(0.0)), f"{name}: amax {amax} vs {ref_amax}"
        assert torch.equal(sums.isnan(), ref_sums.isnan()) and torch.equal(sums.isinf(), ref_sums.isinf()), name
        finite = ref_sums.isfinite()
        torch.testing.assert_close(sums[finite], ref_sums[finite], rtol=SUM_RTOL, atol=0.0, msg=name)
        passed += 1
    return passed


if __name__ == "__main__":
    print(check_segment_stats(sys.argv[1] if len(sys.argv) > 1 else "cpu"))
