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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_prefill_is_as_close_to_exact_attention_as_the_blocked_path():
    from kimi_nvfp4.model.attention import _fused_causal_attention

    g = torch.Generator().manual_seed(2)
    T, heads, d_qk, d_v, scale = 1024, 8, 192, 128, 192**-0.5
    q = (torch.randn(T, heads, d_qk, generator=g) * 2).to("cuda", torch.bfloat16)
    k = (torch.randn(T, heads, d_qk, generator=g) * 2).to("cuda", torch.bfloat16)
    v = torch.randn(T, heads, d_v, generator=g).to("cuda", torch.bfloat16)
    causal = torch.ones(T, T, dtype=torch.bool, device="cuda").tril()
    # exact (fp64) attention of the bf16 operands
    s64 = torch.einsum("thd,shd->hts", q.double(), k.double()) * scale
    exact = torch.einsum("hts,shd->thd", torch.softmax(s64.masked_fill(~causal, float("-inf")), -1), v.double())
    # the blocked path's arithmetic: fp32 scores and softmax, P rounded to bf16 for P.V
    s32 = _fp32_scores(q, _key_operand(k)) * scale
    probs = torch.softmax(s32.masked_fill(~causal, float("-inf")), dim=-1).to(torch.bfloat16)
    blocked = torch.einsum("hts,shd->thd", probs, v)
    fused = _fused_causal_attention(q, k, v, scale)
    assert fused.shape == (T, heads, d_v) and fused.dtype == torch.bfloat16

    def err(x):
        return float((x.double() - exact).square().sum() / exact.square().sum())

    assert err(fused) <= 1.5 * err(blocked) + 1e-7, (err(fused), err(blocked))
    assert err(fused) < 1e-4
