"""The fast paths calibration relies on, each against the plain computation it replaces:
quantize-once MoE activations, switching a loaded layer W4A16 -> W4A4, attend/feed_forward, auto materialize."""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import pytest
import torch

from kimi_nvfp4.checkpoint.k2_config import K2Config
from kimi_nvfp4.model import LayerStreamRunner, NullObserver, NVFP4Weights, open_weights
from kimi_nvfp4.model import linear as linear_module
from kimi_nvfp4.model import moe as moe_module
from kimi_nvfp4.model.layer_weights import MLPWeights, MoEWeights
from kimi_nvfp4.model.linear import ActivationMode, NVFP4Linear
from kimi_nvfp4.numerics.nvfp4 import quantize_nvfp4
from kimi_nvfp4.synth.configs import deepseek_v3_text_config

H, WIDTH, E, TOP_K = 64, 32, 8, 3


def _config() -> K2Config:
    base = deepseek_v3_text_config("tiny", experts=E, overrides={"hidden_size": H, "moe_intermediate_size": WIDTH})
    return dataclasses.replace(K2Config.from_dict(base), num_experts_per_tok=TOP_K, n_group=1, topk_group=1)


def _nvfp4_moe(w13_scale, w2_scale, seed=0) -> MoEWeights:
    """W4A4 experts; `w13_scale(e)` / `w2_scale(e)` give each expert's input-scale tensors."""
    g = torch.Generator().manual_seed(seed)

    def lin(name, o, i, scale):
        q = quantize_nvfp4(torch.randn(o, i, generator=g) * 0.3)
        return NVFP4Linear(name, q, torch.float32, input_scale=scale, mode=ActivationMode.W4A4)

    experts = []
    for e in range(E):
        s13 = w13_scale(e)
        experts.append(MLPWeights(
            lin(f"mlp.experts.{e}.gate_proj", WIDTH, H, s13),
            lin(f"mlp.experts.{e}.up_proj", WIDTH, H, s13),
            lin(f"mlp.experts.{e}.down_proj", H, WIDTH, w2_scale(e)),
        ))
    return MoEWeights(torch.randn(E, H, generator=g), torch.rand(E, generator=g) * 0.1, experts, None)


def _count_quantizations(monkeypatch) -> dict:
    calls = {"n": 0, "rows": 0}
    original = linear_module.fake_quantize_activation_nvfp4

    def counting(x, scale):
        calls["n"] += 1
        calls["rows"] += x.shape[0]
        return original(x, scale)

    monkeypatch.setattr(linear_module, "fake_quantize_activation_nvfp4", counting)
    return calls


@pytest.mark.parametrize("how", ["same tensor", "equal values"])
def test_quantize_once_is_bit_identical_to_per_expert(monkeypatch, how):
    """layer_max: one shared w13 input scale -> the chunk is quantized once, rows gathered from it."""
    one = torch.tensor(0.004)
    w13 = (lambda e: one) if how == "same tensor" else (lambda e: torch.tensor(0.004))
    w = _nvfp4_moe(w13, lambda e: torch.tensor(0.002))
    cfg = _config()
    x = torch.randn(50, H, generator=torch.Generator().manual_seed(3)) * 2
    calls = _count_quantizations(monkeypatch)
    fast = moe_module.moe(cfg, w, x, layer=1, expert_path="loop")
    experts_used = int((torch.bincount(moe_module.route(cfg, w, x)[0].reshape(-1), minlength=E) > 0).sum())
    assert calls["n"] == 1 + experts_used  # the chunk once, then each expert's down_proj input
    assert calls["rows"] == 50 + 50 * TOP_K

    calls.update(n=0, rows=0)
    # the expert-sorted path: the chunk once, and down_proj's inputs (one shared value) once for all experts
    assert torch.equal(moe_module.moe(cfg, w, x, layer=1, expert_path="sorted"), fast)
    assert calls["n"] == 2 and calls["rows"] == 50 + 50 * TOP_K

    calls.update(n=0, rows=0)
    monkeypatch.setattr(moe_module, "shared_input_quantizer", lambda linears: None)  # the per-expert path
    slow = moe_module.moe(cfg, w, x, layer=1, expert_path="loop")
    assert torch.equal(fast, slow)
    # per expert, gate and up (one scale tensor, as the builder gives them) still share one quantization
    assert calls["n"] == 2 * experts_used


def test_different_expert_scales_quantize_per_expert(monkeypatch):
    w = _nvfp4_moe(lambda e: torch.tensor(0.001 * (e + 1)), lambda e: torch.tensor(0.002))
    assert moe_module.shared_input_quantizer([lin for ex in w.experts for lin in (ex.gate_proj, ex.up_proj)]) is None
    cfg = _config()
    x = torch.randn(30, H, generator=torch.Generator().manual_seed(4))
    calls = _count_quantizations(monkeypatch)
    moe_module.moe(cfg, w, x, layer=1)
    assert calls["rows"] == 2 * 30 * TOP_K  # gate/up rows + down rows, all per expert


class Rows(NullObserver):
    needs_outputs = True

    def __init__(self):
        self.stats = defaultdict(list)

    def on_linear(self, layer, module, x, y, expert=None, routed=True):
        self.stats[(layer, module)].append((x.clone(), None if y is None else y.clone()))


class InputsOnly(Rows):
    needs_outputs = False


def test_statistics_only_pass_sees_the_same_inputs(tiny_nvfp4_calibrated):
    """feed_forward(output=False) leaves the states alone; observers get the same inputs, and
    down_proj outputs only when they ask for them."""
    runner = LayerStreamRunner(open_weights(tiny_nvfp4_calibrated), progress=False, max_chunk_tokens=16)
    seqs = [torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(n)) for n in (20, 9)]
    w = runner.load_layer(1)
    h = runner.attend(1, runner.embed(seqs), w)
    before = [s.clone() for s in h.sequences]
    full, stats_only, lean = Rows(), Rows(), InputsOnly()
    runner.feed_forward(HiddenCopy(h), w, full)
    assert runner.feed_forward(h, w, stats_only, output=False) is None
    runner.feed_forward(h, w, lean, output=False)
    assert all(torch.equal(a, b) for a, b in zip(before, h.sequences))
    assert full.stats.keys() == stats_only.stats.keys() == lean.stats.keys()
    for key, seen in full.stats.items():
        for (x, y), (x2, y2), (x3, y3) in zip(seen, stats_only.stats[key], lean.stats[key]):
            assert torch.equal(x, x2) and torch.equal(x, x3) and torch.equal(y, y2)
            assert (y3 is None) == key[1].endswith("down_proj")


def HiddenCopy(h):
    from kimi_nvfp4.model import HiddenStates

    return HiddenStates([s.clone() for s in h.sequences])


def test_attend_then_feed_forward_equals_apply_layer(tiny_nvfp4_calibrated):
    source = open_weights(tiny_nvfp4_calibrated)
    seqs = [torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(n)) for n in (12, 7)]
    runner = LayerStreamRunner(source, progress=False, max_chunk_tokens=8)
    a = runner.embed(seqs)
    b = runner.embed(seqs)
    for i in range(runner.num_layers):
        a = runner.apply_layer(i, a)
        w = runner.load_layer(i)
        b = runner.feed_forward(runner.attend(i, b, w), w)
    assert all(torch.equal(x, y) for x, y in zip(a.sequences, b.sequences))
    with pytest.raises(ValueError, match="weights of layer 1 passed for layer 2"):
        runner.attend(2, a, runner.load_layer(1))


@pytest.mark.parametrize("reduction", ["layer_max", "per_expert"])
def test_set_activations_equals_loading_in_that_mode(tiny_nvfp4, reduction):
    """A W4A16 layer switched to W4A4 with scales == the layer loaded W4A4 with those scales."""
    scales = {
        f"language_model.model.layers.1.mlp.experts.{e}.{p}.input_scale": 0.001 * (e + 1) + 0.0002 * i
        for e in range(8) for i, p in enumerate(("gate_proj", "up_proj", "down_proj"))
    }
    loaded = NVFP4Weights(tiny_nvfp4, input_scales=scales, input_scale_reduction=reduction).layer(1, "cpu")
    source = NVFP4Weights(tiny_nvfp4, activations="w4a16", input_scale_reduction=reduction)
    switched = source.layer(1, "cpu")
    switched.materialize()
    cached = [lin.weight() for lin in switched.linears()]
    source.set_activations(switched, "w4a4", input_scales=scales)
    for a, b, c in zip(loaded.linears(), switched.linears(), cached):
        assert a.module == b.module and type(a) is type(b)
        if isinstance(a, NVFP4Linear):
            assert a.mode is b.mode is ActivationMode.W4A4
            assert torch.equal(a.input_scale, b.input_scale)
            assert torch.equal(a.tensor.weight_scale_2, b.tensor.weight_scale_2)
        assert b.weight() is c  # the dequantized copy survived the switch
    x = torch.randn(10, 64, generator=torch.Generator().manual_seed(0))
    e = loaded.mlp.experts[2]
    assert torch.equal(e.gate_proj(x), switched.mlp.experts[2].gate_proj(x))
    source.set_activations(switched, "w4a16")
    assert all(lin.mode is ActivationMode.W4A16 for lin in switched.linears() if isinstance(lin, NVFP4Linear))


def test_auto_materialize_decision(tiny_nvfp4_calibrated):
    runner = LayerStreamRunner(open_weights(tiny_nvfp4_calibrated), progress=False, materialize_layers="auto",
                               max_chunk_tokens=1024)
    w = runner.load_layer(1)
    need = sum(lin.dequantized_bytes() for lin in w.linears())
    assert need > 0
    work = runner.chunk_bytes(10**6)
    assert runner.chunk_bytes(100) < work  # a small input is one small chunk
    assert runner.materialize_fits(w, 10**6, free_bytes=need + work + 2**33)
    assert not runner.materialize_fits(w, 10**6, free_bytes=need)
    runner.feed_forward(runner.attend(1, runner.embed([torch.arange(5)]), w), w)
    assert not any(lin.materialized for lin in w.linears() if isinstance(lin, NVFP4Linear))  # CPU: never auto
    with pytest.raises(ValueError, match="materialize_layers"):
        LayerStreamRunner(open_weights(tiny_nvfp4_calibrated), materialize_layers="yes")


def test_bf16_states_quantize_and_route_as_their_exact_fp32_values(tiny_nvfp4_calibrated):
    """bf16 -> fp32 is exact, so W4A4 block scales/codes and routing see exactly the bf16 values; the
    only extra step is rounding the dequantized activation back to bf16 (half an ulp: <= 2^-8 relative)."""
    from kimi_nvfp4.numerics.nvfp4 import fake_quantize_activation_nvfp4

    source = open_weights(tiny_nvfp4_calibrated)
    layer = source.layer(1, "cpu", torch.bfloat16)
    x = (torch.randn(40, H, generator=torch.Generator().manual_seed(5)) * 3).to(torch.bfloat16)
    lin = layer.mlp.experts[0].gate_proj
    q = lin.quantize_input(x)
    ref = fake_quantize_activation_nvfp4(x.to(torch.float32), lin.input_scale)
    assert q.dtype == torch.bfloat16 and torch.equal(q, ref.to(torch.bfloat16))
    assert bool(((q.to(torch.float32) - ref).abs() <= ref.abs() * 2**-8).all())
    ids, weights = moe_module.route(source.config, layer.mlp, x)
    ids32, weights32 = moe_module.route(source.config, layer.mlp, x.to(torch.float32))
    assert weights.dtype == torch.float32 and torch.equal(ids, ids32) and torch.equal(weights, weights32)
    # the routed sum is accumulated in fp32 and rounded once
    y = moe_module.moe(source.config, layer.mlp, x, layer=1)
    assert y.dtype == torch.bfloat16
