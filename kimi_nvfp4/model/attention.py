"""Multi-head latent attention (MLA) of K2 / DeepSeek-V3, causal, one sequence at a time.

The KV cache holds what SGLang's MLA cache holds: the normalised latent `c_kv [S, kv_lora_rank]`
and the roped shared key `k_pe [S, qk_rope_head_dim]` (576 numbers per token per layer for K2);
`kv_b_proj` expands them to per-head keys/values on every call (the "naive" MLA form; numerically the
same as the absorbed form up to fp32 summation order).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..checkpoint.k2_config import K2Config
from .batch_invariant import batched_rows
from .layer_weights import AttentionWeights
from .observer import Observer, notify_kv_cache, notify_linear
from .rope import RotaryEmbedding, apply_rope_interleaved

# Largest attention score block materialised at once (heads x queries x keys, fp32): 1 GiB.
ATTENTION_SCORE_BUDGET = 2**28
# Prefill of a whole sequence in bf16/fp16 on CUDA runs as one fused causal attention
# (`F.scaled_dot_product_attention`, a flash kernel): scores stay in fp32 registers through the online
# softmax and P is rounded to bf16 for P.V -- the arithmetic of the serving prefill kernels -- instead of
# ~8 GB of fp32 score traffic per 2048-token sequence. Equal to the blocked path up to fp32 summation
# order and the online softmax's rescaling (tests/model/test_attention_scores.py). False: the blocked path.
USE_FUSED_PREFILL = True


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in fp32 (transformers DeepseekV3RMSNorm / SGLang RMSNorm), result in x's dtype."""
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.to(torch.float32) * xf).to(x.dtype)


@dataclass
class LatentKV:
    """One layer's MLA cache for one sequence."""

    latent: torch.Tensor  # [S, kv_lora_rank], after kv_a_layernorm
    k_pe: torch.Tensor  # [S, qk_rope_head_dim], after rope (half-split layout, see rope.py)

    @property
    def seq_len(self) -> int:
        return self.latent.shape[0]

    def truncate(self, n: int) -> LatentKV:
        return LatentKV(self.latent[:n], self.k_pe[:n])

    def clone(self) -> LatentKV:
        return LatentKV(self.latent.clone(), self.k_pe.clone())


def _half_precision_on_cuda(t: torch.Tensor) -> bool:
    return t.is_cuda and t.dtype in (torch.bfloat16, torch.float16)


def _key_operand(k: torch.Tensor) -> torch.Tensor:
    """Keys `[S, heads, d]` as `_fp32_scores` takes them: `[heads, d, S]` in the compute dtype on CUDA
    (tensor cores), fp32 `[S, heads, d]` elsewhere."""
    return k.permute(1, 2, 0) if _half_precision_on_cuda(k) else k.to(torch.float32)


def _fp32_scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """`Q.K^T` per head `[heads, T, S]` in fp32. On CUDA with bf16 operands, a tensor-core product with
    fp32 accumulation and fp32 output (`out_dtype`), which is what FlashMLA computes: bf16 x bf16 products
    are exact in fp32, so this equals the fp32 product of the upcast operands up to the order of the
    fp32 additions (tests/model/test_attention_scores.py). Elsewhere the upcast fp32 product (reference), its
    reduction cut as batch_invariant.batched_rows cuts it."""
    if k.dim() == 3 and _half_precision_on_cuda(q) and k.shape[0] == q.shape[1]:
        return torch.bmm(q.transpose(0, 1), k, out_dtype=torch.float32)
    return batched_rows(q.to(torch.float32).transpose(0, 1), k.permute(1, 2, 0))


def _fused_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of a whole sequence from position 0: q, k `[T, heads, d_qk]`, v `[T, heads, d_v]` ->
    `[T, heads, d_v]`. v is zero-padded to d_qk (K2: 128 -> 192) so the flash kernel, which takes one head
    size, serves it; the padding's outputs are zeros and are dropped."""
    d_qk, d_v = q.shape[-1], v.shape[-1]
    if d_v < d_qk:
        v = F.pad(v, (0, d_qk - d_v))
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=True, scale=scale
    )[0]
    return out[..., :d_v].transpose(0, 1)


def mla_attention(
    cfg: K2Config,
    rope: RotaryEmbedding,
    w: AttentionWeights,
    x: torch.Tensor,
    *,
    layer: int,
    past: LatentKV | None = None,
    observer: Observer | None = None,
) -> tuple[torch.Tensor, LatentKV]:
    """Attention of `x [T, hidden]` (already input_layernorm'ed) at positions `past_len .. past_len+T-1`.

    Returns the o_proj output `[T, hidden]` and the layer cache extended by these T tokens.
    """
    n_heads, nope, rope_dim, v_dim = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    T = x.shape[0]
    past_len = past.seq_len if past is not None else 0
    # SGLang's DeepseekV2AttentionMLA builds q_a_layernorm/kv_a_layernorm with eps=config.rms_norm_eps
    # (python/sglang/srt/models/deepseek_v2.py); transformers uses its 1e-6 default there. We follow the engine.
    eps = cfg.rms_norm_eps

    if w.q_a_proj is not None:
        q_a = w.q_a_proj(x)
        notify_linear(observer, layer, w.q_a_proj.module, x, q_a)
        q_a_normed = rms_norm(q_a, w.q_a_layernorm, eps)
        q = w.q_b_proj(q_a_normed)
        notify_linear(observer, layer, w.q_b_proj.module, q_a_normed, q)
    else:
        q = w.q_proj(x)
        notify_linear(observer, layer, w.q_proj.module, x, q)
    q = q.view(T, n_heads, nope + rope_dim)

    kv_a = w.kv_a_proj_with_mqa(x)
    notify_linear(observer, layer, w.kv_a_proj_with_mqa.module, x, kv_a)
    latent = rms_norm(kv_a[:, : cfg.kv_lora_rank], w.kv_a_layernorm, eps)

    positions = torch.arange(past_len, past_len + T, device=x.device)
    cos, sin = rope.cos_sin(positions, x.device, x.dtype)
    k_pe = apply_rope_interleaved(kv_a[:, None, cfg.kv_lora_rank :], cos, sin)[:, 0]
    q_pe = apply_rope_interleaved(q[..., nope:], cos, sin)
    q = torch.cat([q[..., :nope], q_pe], dim=-1)

    notify_kv_cache(observer, layer, latent, k_pe)  # the new rows only: each token is cached once
    cache = LatentKV(latent, k_pe)
    if past is not None:
        cache = LatentKV(torch.cat([past.latent, latent]), torch.cat([past.k_pe, k_pe]))
    S = cache.seq_len

    kv = w.kv_b_proj(cache.latent)
    notify_linear(observer, layer, w.kv_b_proj.module, cache.latent, kv)
    kv = kv.view(S, n_heads, nope + v_dim)
    k = torch.cat([kv[..., :nope], cache.k_pe[:, None, :].expand(S, n_heads, rope_dim)], dim=-1)
    v = kv[..., nope:]

    if past is None and T and USE_FUSED_PREFILL and _half_precision_on_cuda(q):
        attn = _fused_causal_attention(q, k, v, rope.softmax_scale).reshape(T, n_heads * v_dim)
        o = w.o_proj(attn)
        notify_linear(observer, layer, w.o_proj.module, attn, o)
        return o, cache

    out = torch.empty(T, n_heads, v_dim, dtype=x.dtype, device=x.device)
    # Query blocks depend on the sequence alone (not on `max_chunk_tokens`, which the memory plan chooses): the
    # products below then see the same shapes however the work is cut (batch_invariant.py).
    rows = max(1, ATTENTION_SCORE_BUDGET // max(1, n_heads * S))
    key_pos = torch.arange(S, device=x.device)
    # Scores in fp32 whatever the compute dtype: FlashMLA (SGLang's MLA decode/prefill kernels) keeps
    # Q.K^T in fp32 accumulators through the softmax and rounds only P to bf16 for P.V; a bf16 einsum
    # would round every score first.
    k_scores = _key_operand(k)
    for start in range(0, T, rows):
        end = min(T, start + rows)
        scores = _fp32_scores(q[start:end], k_scores) * rope.softmax_scale
        # causal: query at absolute position p sees keys 0..p
        allowed = key_pos[None, :] <= positions[start:end, None]
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(x.dtype)
        out[start:end] = batched_rows(probs, v.transpose(0, 1)).transpose(0, 1)

    attn = out.reshape(T, n_heads * v_dim)
    o = w.o_proj(attn)
    notify_linear(observer, layer, w.o_proj.module, attn, o)
    return o, cache
