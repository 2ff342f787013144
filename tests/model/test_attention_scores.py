"""Attention scores: the CUDA bf16 tensor-core path (fp32 accumulation and output) against the fp32 reference."""

from __future__ import annotations

import pytest
import torch

from kimi_nvfp4.model.attention import _fp32_scores, _key_operand


def test_cpu_scores_are_the_fp32_einsum():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(5, 4, 24, generator=g), torch.randn(7, 4, 24, generator=g)
    ref = torch.einsum("thd,shd->hts", q, k)
    assert torch.equal(_fp32_scores(q, _key_operand(k)), ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_scores_match_upcast_fp32_product():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(300, 8, 192, generator=g).to("cuda", torch.bfloat16)
    k = torch.randn(500, 8, 192, generator=g).to("cuda", torch.bfloat16)
    got = _fp32_scores(q, _key_operand(k))
    assert got.dtype == torch.float32 and got.shape == (8, 300, 500)
    torch.backends.cuda.matmul.allow_tf32 = False
    ref = torch.einsum("thd,shd->hts", q.double(), k.double())
    # exact products, fp32 sums of 192 terms: relative error of a dot product ~ 192 * 2^-24
    assert torch.allclose(got.double(), ref, rtol=0, atol=2e-5 * float(ref.abs().max()))
