"""The fused dequantization kernels (`numerics.dequant_kernels`) give the reference's bits, and the model's linears use
them on CUDA.

Where Triton is installed without a GPU, its CPU interpreter checks the kernels' logic in a child process; on CUDA
(the H200 run) the compiled kernels are checked.
"""

from __future__ import annotations

import pytest
import torch

from . import dequant_checks
from .interpreter import requires_triton, run_under_interpreter


@requires_triton
def test_fused_dequantization_matches_the_reference_under_the_triton_interpreter():
    out = run_under_interpreter("tests.numerics.dequant_checks")
    assert int(out.split()[-1]) == 54


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_dequantization_matches_the_reference_on_cuda():
    assert dequant_checks.check_dequant_kernels("cuda") == 54


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_linears_dequantize_with_the_fused_kernels_on_cuda(monkeypatch):
    from kimi_nvfp4.model import linear as linear_module
    from kimi_nvfp4.model.linear import Int4Linear, NVFP4Linear
    from kimi_nvfp4.numerics import dequant_kernels

    name, packed, scale, q = dequant_checks.cases("cuda")[2]
    calls = []
    for fn in ("dequantize_int4_fused", "dequantize_nvfp4_fused"):
        original = getattr(dequant_kernels, fn)
        monkeypatch.setattr(dequant_kernels, fn, lambda *a, _f=original, **k: calls.append(1) or _f(*a, **k))
    nv = NVFP4Linear("mlp.experts.0.gate_proj", q, torch.bfloat16, mode="w4a16")
    i4 = Int4Linear("mlp.experts.0.gate_proj", packed, scale, packed.shape[1] * 8, torch.bfloat16)
    fused = (nv.weight(), i4.weight())
    assert len(calls) == 2
    monkeypatch.setattr(linear_module, "USE_FUSED_DEQUANTIZATION", False)
    assert torch.equal(fused[0], nv.weight()) and torch.equal(fused[1], i4.weight())
