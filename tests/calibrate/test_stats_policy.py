"""Activation statistics accumulate exactly over chunks; the expert policies pick the right amax."""

from __future__ import annotations

import pytest
import torch

from kimi_nvfp4.calibrate.policy import (
    FALLBACK_AMAX,
    ExpertPolicy,
    choose_expert_amax,
    expert_module,
    input_scale_from_amax,
)
from kimi_nvfp4.calibrate.stats import ActivationCollector, ActivationStats
from kimi_nvfp4.numerics.constants import NVFP4_TENSOR_SCALE_DENOMINATOR


def test_stats_over_chunks_equal_one_pass():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(100, 16, generator=g) * 3
    whole, chunked = ActivationStats(16), ActivationStats(16)
    whole.update(x)
    for part in x.split(7):
        chunked.update(part)
    assert chunked.tokens == whole.tokens == 100
    assert float(chunked.amax) == float(x.abs().max())
    torch.testing.assert_close(chunked.mean_square(), (x.double() ** 2).mean(0).float())
    torch.testing.assert_close(chunked.sum_sq, whole.sum_sq)


def test_stats_reject_wrong_width_and_ignore_empty():
    s = ActivationStats(8)
    s.update(torch.zeros(0, 8))
    assert s.tokens == 0 and float(s.amax) == 0.0
    with pytest.raises(ValueError, match="8 features"):
        s.update(torch.zeros(3, 9))


def test_collector_separates_routed_and_route_all_and_counts_tokens():
    c = ActivationCollector(route_all=True)
    c.start_layer(1)
    x = torch.tensor([[1.0, -4.0], [2.0, 0.5]])
    c.on_linear(1, "mlp.experts.0.gate_proj", x[:1], x[:1], expert=0)
    c.on_linear(1, "mlp.experts.0.gate_proj", x, x, expert=0, routed=False)
    c.on_router(1, torch.tensor([[0, 2], [2, 3]]), torch.ones(2, 2))
    assert c.routed[("mlp.experts.0.gate_proj", 0)].amax_value == 4.0
    assert c.all_tokens[("mlp.experts.0.gate_proj", 0)].tokens == 2
    assert c.tokens_per_expert(5) == [1, 0, 2, 1, 0]
    with pytest.raises(RuntimeError, match="layer 1"):
        c.on_linear(2, "self_attn.o_proj", x, x)


def test_input_scale_is_amax_over_6_times_448_and_never_zero():
    assert float(input_scale_from_amax(2688.0)) == pytest.approx(1.0)
    assert float(input_scale_from_amax(12.5)) == pytest.approx(12.5 / NVFP4_TENSOR_SCALE_DENOMINATOR)
    assert input_scale_from_amax(1.0).dtype == torch.float32 and input_scale_from_amax(1.0).ndim == 0
    assert float(input_scale_from_amax(0.0)) == pytest.approx(FALLBACK_AMAX / NVFP4_TENSOR_SCALE_DENOMINATOR)


def _stats(amax: float, tokens: int, width: int = 4) -> ActivationStats:
    s = ActivationStats(width)
    x = torch.zeros(tokens, width)
    if tokens:
        x[0, 0] = amax
    s.update(x)
    return s


def _layer_stats(amaxes: list[tuple[float, int]]):
    table = {}
    for e, (amax, tokens) in enumerate(amaxes):
        if tokens == 0:
            continue
        for proj in ("gate_proj", "up_proj", "down_proj"):
            table[(expert_module(e, proj), e)] = _stats(amax, tokens)
    return table


@pytest.mark.parametrize("policy", list(ExpertPolicy), ids=lambda p: p.value)
def test_policies_on_a_layer_with_covered_sparse_and_unseen_experts(policy):
    routed = _layer_stats([(3.0, 100), (5.0, 50), (0.5, 2), (0.0, 0)])
    route_all = _layer_stats([(7.0, 160), (6.0, 160), (9.0, 160), (4.0, 160)])
    chosen = choose_expert_amax(routed, route_all, [100, 50, 2, 0], policy=policy, min_expert_tokens=10)
    by = {(c.expert, c.group): c for c in chosen}
    assert len(chosen) == 8
    assert by[(0, "gate_up")].amax == 3.0 and by[(0, "gate_up")].source == "routed"
    assert by[(1, "down")].amax == 5.0
    if policy is ExpertPolicy.PEER_MAX:
        assert (by[(2, "gate_up")].amax, by[(2, "gate_up")].source) == (5.0, "peer-max")
        assert (by[(3, "down")].amax, by[(3, "down")].source) == (5.0, "peer-max")
    else:
        assert (by[(2, "gate_up")].amax, by[(2, "gate_up")].source) == (9.0, "route-all")
        assert (by[(3, "down")].amax, by[(3, "down")].source) == (4.0, "route-all")


def test_route_all_without_statistics_falls_back_to_peers_then_constant():
    routed = _layer_stats([(3.0, 100), (0.0, 0)])
    chosen = choose_expert_amax(routed, {}, [100, 0], policy=ExpertPolicy.ROUTE_ALL, min_expert_tokens=10)
    assert {(c.expert, c.source) for c in chosen} == {(0, "routed"), (1, "peer-max")}
    nothing = choose_expert_amax({}, {}, [0, 0], policy=ExpertPolicy.PEER_MAX, min_expert_tokens=10)
    assert all(c.source == "fallback" and c.amax == FALLBACK_AMAX for c in nothing)


def _per_expert(collector, rows, spans, modules):
    for (e, a, b), names in zip(spans, modules):
        for name in names:
            collector.on_linear(1, name, rows[a:b], None, expert=e)


def test_expert_rows_buffer_gives_the_per_expert_statistics_over_chunks():
    """`on_expert_rows` (one call per buffer) and one `on_linear` per expert and linear give the same entries,
    bit for bit, over several chunks; gate and up entries do not share storage."""
    g = torch.Generator().manual_seed(4)
    batched, single = ActivationCollector(), ActivationCollector()
    for c in (batched, single):
        c.start_layer(1)
    for chunk in range(3):
        rows = torch.randn(60, 24, generator=g).to(torch.bfloat16)
        spans = [(0, 0, 10), (2, 10, 11), (5, 11, 60)] if chunk != 1 else [(2, 0, 30), (6, 30, 60)]
        modules = [(expert_module(e, "gate_proj"), expert_module(e, "up_proj")) for e, _, _ in spans]
        batched.on_expert_rows(1, rows, spans, modules, n_experts=8)
        _per_expert(single, rows, spans, modules)
        h = torch.randn(60, 12, generator=g)
        downs = [(expert_module(e, "down_proj"),) for e, _, _ in spans]
        batched.on_expert_rows(1, h, spans, downs, n_experts=8)
        _per_expert(single, h, spans, downs)
    assert batched.routed.keys() == single.routed.keys()
    assert {e for _, e in batched.routed} == {0, 2, 5, 6}
    for key, s in single.routed.items():
        b = batched.routed[key]
        assert b.tokens == s.tokens and torch.equal(b.amax, s.amax) and torch.equal(b.sum_sq, s.sum_sq), key
    gate, up = batched.routed[(expert_module(2, "gate_proj"), 2)], batched.routed[(expert_module(2, "up_proj"), 2)]
    before = up.sum_sq.clone()
    gate.update(torch.ones(4, 24))
    assert torch.equal(up.sum_sq, before) and gate.tokens == up.tokens + 4


def test_expert_rows_buffer_refuses_a_changed_width():
    c = ActivationCollector()
    c.start_layer(0)
    mods = [(expert_module(0, "gate_proj"),)]
    c.on_expert_rows(0, torch.ones(4, 8), [(0, 0, 4)], mods, n_experts=2)
    with pytest.raises(ValueError, match="changed shape"):
        c.on_expert_rows(0, torch.ones(4, 9), [(0, 0, 4)], mods, n_experts=2)
