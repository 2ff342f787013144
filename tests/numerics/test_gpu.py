"""CPU and CUDA produce identical bytes for every method (run by the lead on the H200)."""

from __future__ import annotations

import pytest
import torch

from kimi_nvfp4.numerics.constants import NVFP4_TENSOR_SCALE_DENOMINATOR
from kimi_nvfp4.numerics.methods import quantize_int4_matrices, weight_only_methods
from kimi_nvfp4.numerics.nvfp4 import divide_exactly, fake_quantize_activation_nvfp4

from .conftest import realistic_int4

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("method", weight_only_methods(), ids=lambda m: m.value)
def test_cpu_and_cuda_bytes_identical(method):
    mats = [realistic_int4(256, 1024, seed=1), realistic_int4(256, 1024, seed=2, row_spread=1.0)]
    cpu = quantize_int4_matrices(mats, method)
    gpu = quantize_int4_matrices([m.to("cuda") for m in mats], method)
    for a, b in zip(cpu, gpu):
        assert torch.equal(a.weight, b.weight.cpu())
        assert torch.equal(a.weight_scale.view(torch.uint8), b.weight_scale.view(torch.uint8).cpu())
        assert torch.equal(a.weight_scale_2, b.weight_scale_2.cpu())


@pytest.mark.gpu
@requires_cuda
def test_activation_fake_quant_identical_on_cuda():
    x = torch.randn(64, 512, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    scale = torch.tensor(float(x.float().abs().amax()) / 2688)
    assert torch.equal(fake_quantize_activation_nvfp4(x, scale), fake_quantize_activation_nvfp4(x.cuda(), scale).cpu())


@pytest.mark.gpu
@requires_cuda
def test_tensor_scale_division_identical_on_cuda():
    """CUDA turns `tensor / python_float` into a reciprocal multiply; divide_exactly must not."""
    amax = torch.rand(100_000, generator=torch.Generator().manual_seed(3)) * 10
    assert torch.equal(divide_exactly(amax, NVFP4_TENSOR_SCALE_DENOMINATOR),
                       divide_exactly(amax.cuda(), NVFP4_TENSOR_SCALE_DENOMINATOR).cpu())
