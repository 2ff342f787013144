"""The K2 MLPs: dense SwiGLU (layer 0, shared expert) and the sigmoid-routed MoE.

Routing (`noaux_tc`, DeepSeek-V3; transformers DeepseekV3TopkRouter, SGLang `biased_grouped_topk`):
scores = sigmoid(x @ gate.T) in fp32; `e_score_correction_bias` is added for SELECTION only
(groups ranked by the sum of their top-2 biased scores, keep `topk_group` of `n_group`, then top-k
experts); the combine weights are the unbiased scores of the chosen experts, normalised to sum 1
(`norm_topk_prob`) and multiplied by `routed_scaling_factor`.

Experts run per expert on a gather of their routed tokens (no dense [T, E, ...] tensors); each
token's routed outputs are summed in ascending expert order (as transformers' loop does) by a
gather-add-scatter over unique token indices: no atomics, same bytes run to run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..checkpoint.k2_config import K2Config
from .layer_weights import MLPWeights, MoEWeights
from .observer import Observer, notify_linear

# transformers DeepseekV3TopkRouter: `denominator = topk_weights.sum(...) + 1e-20`
_NORM_EPS = 1e-20
# Groups are ranked by the sum of their best two biased scores (DeepSeek-V3 noaux_tc).
_GROUP_SCORE_TOP = 2


def swiglu_mlp(
    w: MLPWeights, x: torch.Tensor, *, layer: int, observer: Observer | None = None,
    expert: int | None = None, routed: bool = True,
) -> torch.Tensor:
    """`down(silu(gate(x)) * up(x))`, reporting each linear to the observer."""
    gate = w.gate_proj(x)
    notify_linear(observer, layer, w.gate_proj.module, x, gate, expert, routed)
    up = w.up_proj(x)
    notify_linear(observer, layer, w.up_proj.module, x, up, expert, routed)
    h = F.silu(gate) * up
    out = w.down_proj(h)
    notify_linear(observer, layer, w.down_proj.module, h, out, expert, routed)
    return out


def route(cfg: K2Config, w: MoEWeights, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(topk_ids [T, k] long, topk_weights [T, k] fp32)`, ids in descending biased-score order."""
    scores = F.linear(x.to(torch.float32), w.router_weight.to(torch.float32)).sigmoid()
    choice = scores if w.e_score_correction_bias is None else scores + w.e_score_correction_bias.to(torch.float32)
    n_experts = scores.shape[-1]
    if cfg.n_group > 1 and cfg.topk_group < cfg.n_group:
        grouped = choice.view(-1, cfg.n_group, n_experts // cfg.n_group)
        group_scores = grouped.topk(_GROUP_SCORE_TOP, dim=-1).values.sum(dim=-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(cfg.topk_group, dim=-1).indices, True)
        choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(-1, n_experts)
    topk_ids = choice.topk(cfg.num_experts_per_tok, dim=-1, sorted=True).indices
    weights = scores.gather(1, topk_ids)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + _NORM_EPS)
    return topk_ids, weights * cfg.routed_scaling_factor


def moe(
    cfg: K2Config, w: MoEWeights, x: torch.Tensor, *, layer: int, observer: Observer | None = None
) -> torch.Tensor:
    """Routed experts + shared expert for `x [T, hidden]` (already post_attention_layernorm'ed)."""
    T, hidden = x.shape
    topk_ids, topk_weights = route(cfg, w, x)
    if observer is not None:
        observer.on_router(layer, topk_ids, topk_weights)
    k = topk_ids.shape[1]
    n_experts = len(w.experts)

    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
    counts = torch.bincount(flat, minlength=n_experts).tolist()  # one host sync per chunk
    out = x.new_zeros(T, hidden)
    start = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start : start + count]
        start += count
        tokens, slots = pairs // k, pairs % k  # a token meets an expert at most once: `tokens` is unique
        y = swiglu_mlp(w.experts[e], x[tokens], layer=layer, observer=observer, expert=e)
        out[tokens] = out[tokens] + y * topk_weights[tokens, slots, None].to(y.dtype)

    if observer is not None and getattr(observer, "route_all", False):
        # statistics only: every token through every expert; the result is discarded
        for e in range(n_experts):
            swiglu_mlp(w.experts[e], x, layer=layer, observer=observer, expert=e, routed=False)

    if w.shared_experts is not None:
        out = out + swiglu_mlp(w.shared_experts, x, layer=layer, observer=observer)
    return out
