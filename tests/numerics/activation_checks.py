"""Checks of the fused W4A4 activation kernel against the reference, shared by the GPU test and the CPU interpreter run.

Not a test module itself: `test_activation_kernel.py` calls `check_fused_activation` on CUDA, and runs this file as a
script under `TRITON_INTERPRET=1` (Triton's CPU interpreter) where Triton is installed.
"""

from __future__ import annotations

import sys

import torch

from kimi_nvfp4.numerics.nvfp4 import fake_quantize_activation_nvfp4

# Input scales from "every block saturates at 448" to "most block scales round to E4M3 subnormals or zero".
INPUT_SCALES = (1e-6, 0.001, 0.02, 0.5, 3.0, 1e4, 1e9)


def activation_inputs(dtype: torch.dtype) -> torch.Tensor:
    """Rows of 16-blocks: Gaussian, heavy-tailed, tiny and huge magnitudes, zero blocks, one-hot blocks, exact
    E2M1 grid values and their midpoints (ties), signed zeros, infinities and a NaN block."""
    gen = torch.Generator().manual_seed(11)
    parts = [
        torch.randn(64, 256, generator=gen),
        torch.randn(64, 256, generator=gen) * torch.exp(torch.randn(64, 256, generator=gen) * 3),
        torch.randn(8, 256, generator=gen) * 1e-30,
        torch.randn(8, 256, generator=gen) * 1e30,
    ]
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    special = torch.zeros(8, 256)
    special[0, :16] = grid
    special[1, :16] = -grid
    special[2, 16:32] = -0.0
    special[3, 40] = 7.0  # one-hot block
    special[4, :16] = grid * 2.0**-20
    special[5, 48] = float("inf")
    special[5, 64] = float("-inf")
    special[6, 80] = float("nan")
    parts.append(special)
    return torch.cat(parts).to(dtype)


def check_fused_activation(device: str) -> int:
    """Compare every input and scale bit for bit; returns the number of values compared."""
    from kimi_nvfp4.numerics.activation_kernel import fake_quantize_activation_fused

    compared = 0
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = activation_inputs(dtype).to(device)
        for s in INPUT_SCALES:
            scale = torch.tensor(s, dtype=torch.float32, device=device)
            want = fake_quantize_activation_nvfp4(x, scale).to(dtype)
            got = fake_quantize_activation_fused(x, scale)
            assert got.dtype == dtype and got.shape == x.shape
            same = got.view(torch.uint8 if dtype.itemsize == 1 else {2: torch.int16, 4: torch.int32}[dtype.itemsize])
            ref = want.view(same.dtype)
            nan_both = torch.isnan(got) & torch.isnan(want)
            bad = (same != ref) & ~nan_both
            if bool(bad.any()):
                i = int(bad.nonzero()[0, 0]), int(bad.nonzero()[0, 1])
                raise AssertionError(
                    f"{dtype} input_scale {s}: {int(bad.sum())} values differ, first at {i}: x={x[i].item()!r} "
                    f"kernel={got[i].item()!r} reference={want[i].item()!r}"
                )
            compared += x.numel()
    # odd shapes: 3-D input, a non-contiguous view, a single block
    x = activation_inputs(torch.bfloat16).to(device)[:12, :64].reshape(3, 4, 64)
    scale = torch.tensor(0.02, device=device)
    assert torch.equal(fake_quantize_activation_fused(x, scale), fake_quantize_activation_nvfp4(x, scale).to(x.dtype))
    view = activation_inputs(torch.bfloat16).to(device)[:144, ::2]  # no NaN (NaN != NaN for torch.equal)
    assert torch.equal(fake_quantize_activation_fused(view, scale), fake_quantize_activation_nvfp4(view, scale).to(view.dtype))
    return compared + x.numel() + view.numel()


if __name__ == "__main__":  # under TRITON_INTERPRET=1, from test_activation_kernel.py
    print(check_fused_activation(sys.argv[1] if len(sys.argv) > 1 else "cpu"))
