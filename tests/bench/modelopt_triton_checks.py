"""Model Optimizer's static Triton NVFP4 fake-quant kernel against bench/harness/modelopt_cpu/fake_quant.py, bit for bit.

(The dynamic kernel, `fp4_fake_quant_block`, addresses memory with `tl.make_block_ptr`, which the pinned Triton's
interpreter does not implement; its CPU stand-in is checked against Model Optimizer's pure-torch NVFP4QTensor in
test_modelopt_cpu_fake_quant.py instead.)

Not a test module itself: test_modelopt_cpu_fake_quant.py runs this file as a script under `TRITON_INTERPRET=1`
(Triton's CPU interpreter). The kernels' Python wrappers enter `torch.cuda.device(x.device)` around each launch,
which refuses a CPU device; here (in this process only) that context is a no-op, so the interpreter runs the
unmodified kernels on CPU tensors. The interpreter has no CUDA extern functions: `libdevice.isnan(scale)`, used once
by `nvfp4_scalar_quant` for the block scale's NaN test, is replaced (in this process) by `scale != scale`, its
IEEE definition.

bf16 outputs: the kernels compute in fp32 and round once at the store. The interpreter's fp32 -> bf16 cast
truncates (interpreter.py `cast_impl` passes no rounding mode), the compiled kernels round to nearest even (LLVM
`fptrunc`), and so does ours. So for bf16 inputs the check is that the interpreter's bf16 output is exactly our
fp32 result truncated to bf16, and (static kernel, which takes `out_dtype`) that its fp32 output equals ours.
"""

from __future__ import annotations

import contextlib
import sys
import types

import torch

from bench.harness.modelopt_cpu import fake_quant as ours

BLOCK = 16


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def _same_bits(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    diff = (_bits(a) != _bits(b)).sum().item()
    assert diff == 0, f"{what}: {diff} of {a.numel()} values differ"


def truncate_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 rounding toward zero (the interpreter's cast; see the module docstring)."""
    return (x.contiguous().view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16)


def edge_tensors() -> list[tuple[str, torch.Tensor]]:
    """Random rows plus zeros, a lone huge value, tiny values, exact E2M1 midpoints (ties) and both zeros."""
    gen = torch.Generator().manual_seed(16)
    x = torch.randn(48, 128, generator=gen) * torch.exp(torch.randn(48, 1, generator=gen) * 2.0)
    x[0] = 0.0  # all-zero rows
    x[1, :16] = -0.0
    x[2, 5] = 3.0e4  # one huge value: its block's scale saturates E4M3, the rest of the row is tiny beside it
    x[3] = torch.randn(128, generator=gen) * 1e-30  # below the E4M3 range at any global scale
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2)
    x[4, :16] = ties  # amax 6 -> block scale 1 (when representable): every value sits on a rounding boundary
    x[5, :16] = -ties
    x[6, 16:32] = ties * 2.0**-7
    return [("fp32", x), ("bf16", x.to(torch.bfloat16)), ("ragged", x[:, :120].contiguous())]


def check_static(fp4_kernel) -> int:
    n = 0
    for name, x in edge_tensors():
        if x.shape[-1] % BLOCK:
            continue
        blocks = x.reshape(-1, BLOCK).float()
        amax_choices = {
            "amax": blocks.abs().amax(-1),
            "scaled": blocks.abs().amax(-1) * torch.linspace(0.5, 1.5, blocks.shape[0]),
            "zeros_and_tiny": torch.where(torch.arange(blocks.shape[0]) % 3 == 0, 0.0, 1e-20),
        }
        for label, amax in amax_choices.items():
            for global_amax, fp8_max in ((None, 448.0), (amax.max() * 4.0, 256.0)):
                if True:
                    args = (x, amax.reshape(x.shape[0], -1), global_amax, True, fp8_max, torch.float32)
                    _same_bits(ours.static_blockwise_fp4_fake_quant(*args), fp4_kernel.static_blockwise_fp4_fake_quant(*args),
                               f"static {name} {label} global={global_amax is not None} fp8_max={fp8_max}")
                    n += 1
    return n


def main() -> int:
    torch.cuda.device = lambda _device: contextlib.nullcontext()  # see the module docstring
    from modelopt.torch.kernels.quantization.common import nvfp4_quant
    from modelopt.torch.kernels.quantization.gemm import fp4_kernel

    nvfp4_quant.libdevice = types.SimpleNamespace(isnan=lambda v: v != v)
    print(f"bit-exact: {check_static(fp4_kernel)} static-kernel cases")
    return 0


if __name__ == "__main__":
    sys.exit(main())
