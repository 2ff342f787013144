"""The fused W4A4 activation kernel (`numerics.activation_kernel`) gives the reference's bits, and the model's
NVFP4 linears use it on CUDA.

Where Triton is installed without a GPU, its CPU interpreter checks the kernel's logic in a child process (the
interpreter is chosen when kernels are defined, so it cannot be switched on inside this process); on CUDA (the
H200 run) the compiled kernel is checked.
"""

from __future__ import annotations

import pytest
import torch

from . import activation_checks
from .interpreter import requires_triton, run_under_interpreter


@requires_triton
def test_fused_activation_matches_the_reference_under_the_triton_interpreter():
    out = run_under_interpreter("tests.numerics.activation_checks")
    assert int(out.split()[-1]) > 500_000


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_fused_activation_matches_the_reference_on_cuda():
    assert activation_checks.check_fused_activation("cuda") > 500_000


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_nvfp4_linear_uses_the_fused_kernel_on_cuda(monkeypatch):
    from kimi_nvfp4.model import linear as linear_module
    from kimi_nvfp4.model.linear import NVFP4Linear
    from kimi_nvfp4.numerics import activation_kernel
    from kimi_nvfp4.numerics.nvfp4 import NVFP4Tensor

    calls = []
    original = activation_kernel.fake_quantize_activation_fused
    monkeypatch.setattr(activation_kernel, "fake_quantize_activation_fused", lambda x, s: calls.append(1) or original(x, s))
    w = NVFP4Tensor(
        weight=torch.randint(0, 256, (32, 32), dtype=torch.uint8, device="cuda"),
        weight_scale=torch.ones(32, 4, device="cuda").to(torch.float8_e4m3fn),
        weight_scale_2=torch.tensor(0.01, device="cuda"),
    )
    lin = NVFP4Linear("mlp.experts.0.gate_proj", w, torch.bfloat16, input_scale=torch.tensor(0.003, device="cuda"))
    x = torch.randn(8, 64, device="cuda", dtype=torch.bfloat16)
    got = lin.quantize_input(x)
    assert calls and torch.equal(got, linear_module.fake_quantize_activation_nvfp4(x, lin.input_scale).to(x.dtype))
