"""Router and expert dispatch on hand-made weights: bias for selection only, group limits, weights."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from kimi_nvfp4.checkpoint.k2_config import K2Config
from kimi_nvfp4.model.layer_weights import MLPWeights, MoEWeights
from kimi_nvfp4.model.linear import DenseLinear
from kimi_nvfp4.model.moe import moe, route
from kimi_nvfp4.synth.configs import deepseek_v3_text_config

H, WIDTH, E = 16, 8, 8


def config(**over) -> K2Config:
    base = deepseek_v3_text_config("tiny", experts=E, overrides={"hidden_size": H, "moe_intermediate_size": WIDTH})
    return dataclasses.replace(K2Config.from_dict(base), **over)


def expert(g, e) -> MLPWeights:
    def lin(name, o, i):
        return DenseLinear(f"mlp.experts.{e}.{name}", torch.randn(o, i, generator=g) * 0.3, torch.float32)

    return MLPWeights(lin("gate_proj", WIDTH, H), lin("up_proj", WIDTH, H), lin("down_proj", H, WIDTH))


def weights(bias=None, seed=0) -> MoEWeights:
    g = torch.Generator().manual_seed(seed)
    return MoEWeights(
        router_weight=torch.randn(E, H, generator=g),
        e_score_correction_bias=bias,
        experts=[expert(g, e) for e in range(E)],
        shared_experts=None,
    )


def test_bias_steers_selection_but_not_weights():
    cfg = config(num_experts_per_tok=2, routed_scaling_factor=2.5)
    x = torch.randn(6, H, generator=torch.Generator().manual_seed(1))
    bias = torch.zeros(E)
    bias[7] = 10.0  # expert 7 always chosen
    w = weights(bias)
    ids, topw = route(cfg, w, x)
    assert (ids[:, 0] == 7).all()
    scores = torch.sigmoid(x @ w.router_weight.T)
    chosen = scores.gather(1, ids)
    assert torch.allclose(topw, chosen / chosen.sum(-1, keepdim=True) * 2.5)
    # the second pick is the best unbiased score among the others
    others = scores.clone()
    others[:, 7] = -1
    assert torch.equal(ids[:, 1], others.argmax(-1))


def test_group_limited_selection():
    """n_group 4 x 2 experts, topk_group 1: both picks come from the group whose top-2 sum is best."""
    cfg = config(num_experts_per_tok=2, n_group=4, topk_group=1)
    x = torch.randn(32, H, generator=torch.Generator().manual_seed(2))
    w = weights(torch.zeros(E))
    ids, _ = route(cfg, w, x)
    scores = torch.sigmoid(x @ w.router_weight.T)
    best_group = scores.view(-1, 4, 2).sum(-1).argmax(-1)
    assert torch.equal(ids.sort(-1).values, torch.stack([best_group * 2, best_group * 2 + 1], -1))


def test_unnormalised_weights():
    cfg = config(num_experts_per_tok=3, norm_topk_prob=False, routed_scaling_factor=1.5)
    x = torch.randn(4, H, generator=torch.Generator().manual_seed(3))
    w = weights(torch.zeros(E))
    ids, topw = route(cfg, w, x)
    assert torch.allclose(topw, torch.sigmoid(x @ w.router_weight.T).gather(1, ids) * 1.5)


@pytest.mark.parametrize("seed", [0, 1])
def test_moe_equals_dense_reference(seed):
    """Gathered per-expert dispatch == every token through its k experts one by one."""
    cfg = config(num_experts_per_tok=3)
    x = torch.randn(20, H, generator=torch.Generator().manual_seed(10 + seed))
    w = weights(torch.rand(E, generator=torch.Generator().manual_seed(seed)) * 0.1, seed=seed)
    ids, topw = route(cfg, w, x)
    ref = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for slot in range(3):
            e = w.experts[int(ids[t, slot])]
            h = F.silu(e.gate_proj(x[t : t + 1])) * e.up_proj(x[t : t + 1])
            ref[t] += topw[t, slot] * e.down_proj(h)[0]
    assert torch.allclose(moe(cfg, w, x, layer=1), ref, rtol=1e-5, atol=1e-6)
