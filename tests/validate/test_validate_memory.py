"""What validate keeps alive, as the memory plan counts it (stage_kit/memory_estimate.py `estimate`): checked on the CPU
through weak references, so that a change here that frees something earlier (or later) shows up beside the plan's
term that counts it."""

from __future__ import annotations

import weakref

import torch

from kimi_nvfp4.checkpoint.reader import CheckpointReader
from kimi_nvfp4.model import Int4SourceWeights, NVFP4Weights
from kimi_nvfp4.model import runner as model_runner
from kimi_nvfp4.model import weights as model_weights
from kimi_nvfp4.model.linear import ActivationMode
from kimi_nvfp4.model.nvfp4_linears import InputScaleReduction
from kimi_nvfp4.numerics.methods import Int4Matrix
from kimi_nvfp4.validate import streams as validate_streams
from kimi_nvfp4.validate.baseline import baseline_layer


def test_a_layers_nvfp4_experts_go_with_the_layer(calibrated_pair, monkeypatch):
    """The plan counts no previous layer's experts: once a MoE layer is done, its NVFP4 experts are freed before the
    next MoE layer's INT4 stream (the loop that drops their dequantized copies is a function of its own, so its last
    `lin`, which holds `lin.group` -- every routed expert's tensors -- goes with it; 8.9 GiB at K2.6)."""
    src, out = calibrated_pair
    alive: set[int] = set()  # layers whose NVFP4 experts are alive
    original = model_weights._CheckpointWeights.layer

    def layer(source, i, *args, **kwargs):
        w = original(source, i, *args, **kwargs)
        if isinstance(source, NVFP4Weights) and hasattr(w.mlp, "experts"):
            alive.add(i)
            weakref.finalize(w.mlp.experts[0].gate_proj.tensor.weight, alive.discard, i)
        return w

    seen: list[tuple[str, int, set[int]]] = []
    feed_forward = model_runner.LayerStreamRunner.feed_forward

    def observed(runner, states, w, *args, **kwargs):
        seen.append((type(runner.source).__name__, w.index, set(alive)))
        return feed_forward(runner, states, w, *args, **kwargs)

    monkeypatch.setattr(model_weights._CheckpointWeights, "layer", layer)
    monkeypatch.setattr(model_runner.LayerStreamRunner, "feed_forward", observed)
    cfg = CheckpointReader(out).layout.text
    first, second = cfg.moe_layers[:2]
    seqs = [torch.randint(0, 200, (32,), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    validate_streams.compare_streams(
        CheckpointReader(src), CheckpointReader(out), seqs, modes=[ActivationMode.W4A4, ActivationMode.W4A16],
        reduction=InputScaleReduction.LAYER_MAX, device=torch.device("cpu"), flag_rel_mse=1e9, progress=False,
        prefetch=False, baseline=True)
    second_layer = [live for kind, i, live in seen if i == second]
    int4_stream, baseline_stream = second_layer[0], second_layer[-1]
    assert [kind for kind, i, _ in seen if i == second][0] == "Int4SourceWeights"
    assert int4_stream == {second}  # not the previous MoE layer's
    assert baseline_stream == {second}
    assert not alive  # compare_streams has returned


def test_baseline_conversion_unpacks_one_expert_at_a_time(calibrated_pair, monkeypatch):
    """The plan's `baseline_build`: `baseline_layer` holds one routed expert's three `Int4Matrix`es (int8 codes, fp32
    group scales) at a time, not the layer's."""
    src, out = calibrated_pair
    reader = CheckpointReader(out)
    layer = reader.layout.text.moe_layers[0]
    live, peak = [0], [0]
    original = Int4Matrix.from_packed.__func__

    def from_packed(cls, *args, **kwargs):
        m = original(cls, *args, **kwargs)
        live[0] += 1
        peak[0] = max(peak[0], live[0])
        weakref.finalize(m, lambda: live.__setitem__(0, live[0] - 1))
        return m

    monkeypatch.setattr(Int4Matrix, "from_packed", classmethod(from_packed))
    w_ref = Int4SourceWeights(CheckpointReader(src)).layer(layer, "cpu")
    w_nv = NVFP4Weights(reader, activations="w4a16").layer(layer, "cpu")
    base = baseline_layer(w_ref, w_nv)
    assert len(base.mlp.experts) > 1 and peak[0] == 3 and live[0] == 0
