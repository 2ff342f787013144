"""Checks of the fused dequantization kernels against the reference, shared by the GPU test and the CPU interpreter.

Not a test module itself: `test_dequant_kernels.py` calls `check_dequant_kernels` on CUDA, and runs this file as a
script under `TRITON_INTERPRET=1` where Triton is installed.
"""

from __future__ import annotations

import sys

import torch

from kimi_nvfp4.numerics.int4 import dequantize_int4
from kimi_nvfp4.numerics.nvfp4 import NVFP4Tensor, dequantize_nvfp4

from .compare_checks import cases


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit patterns, any NaN matching any NaN."""
    view = {2: torch.int16, 4: torch.int32}[a.element_size()]
    nan = torch.isnan(a) & torch.isnan(b)
    return a.dtype == b.dtype and a.shape == b.shape and bool(((a.view(view) == b.view(view)) | nan).all())


def check_dequant_kernels(device: str) -> int:
    from kimi_nvfp4.numerics.dequant_kernels import dequantize_int4_fused, dequantize_nvfp4_fused

    checked = 0
    for name, packed, scale, q in cases(device):
        cols = packed.shape[1] * 8
        # a sign-flipped tensor scale too: every product's sign follows the reference's arithmetic
        for t in (q, NVFP4Tensor(q.weight, q.weight_scale, -q.weight_scale_2)):
            for dtype in (torch.bfloat16, torch.float32):
                want = dequantize_nvfp4(t, dtype=torch.float32).to(dtype)
                assert _same_bits(dequantize_nvfp4_fused(t, dtype), want), (name, "nvfp4", dtype)
                checked += 1
        for dtype in (torch.bfloat16, torch.float32):
            want = dequantize_int4(packed, scale, cols).to(dtype)
            assert _same_bits(dequantize_int4_fused(packed, scale, cols, dtype), want), (name, "int4", dtype)
            checked += 1
    return checked


if __name__ == "__main__":  # under TRITON_INTERPRET=1, from test_dequant_kernels.py
    print(check_dequant_kernels(sys.argv[1] if len(sys.argv) > 1 else "cpu"))
