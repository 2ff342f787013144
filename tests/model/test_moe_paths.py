"""The expert-sorted MoE path (the default) against the per-expert reference loop: same bytes.

Both run the same arithmetic per expert on the same rows, so outputs and every observer statistic
must be bit-identical, for INT4, NVFP4 W4A16 and NVFP4 W4A4 (shared and per-expert input scales),
in fp32 and bf16, and in the statistics-only pass.
"""

from __future__ import annotations

import pytest
import torch

from kimi_nvfp4.calibrate.stats import ActivationCollector
from kimi_nvfp4.checkpoint.reader import CheckpointReader
from kimi_nvfp4.model import Int4SourceWeights, NVFP4Weights
from kimi_nvfp4.model.attention import rms_norm
from kimi_nvfp4.model.moe import EXPERT_PATHS, moe


def _layer(source, dtype):
    cfg = source.config
    layer = next(i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i))
    w = source.layer(layer, "cpu", dtype)
    x = torch.randn(96, cfg.hidden_size, generator=torch.Generator().manual_seed(3)).to(dtype)
    return cfg, layer, w, rms_norm(x, w.post_attention_layernorm, cfg.rms_norm_eps)


def _run(cfg, layer, w, x, path, need_output=True):
    obs = ActivationCollector()
    obs.start_layer(layer)
    y = moe(cfg, w.mlp, x, layer=layer, observer=obs, expert_path=path, need_output=need_output)
    return y, obs


def _same_stats(a: ActivationCollector, b: ActivationCollector) -> None:
    assert a.routed.keys() == b.routed.keys()
    for key in a.routed:
        sa, sb = a.routed[key], b.routed[key]
        assert sa.tokens == sb.tokens, key
        assert torch.equal(sa.amax, sb.amax), key
        assert torch.equal(sa.sum_sq, sb.sum_sq), key
    assert torch.equal(a.expert_tokens, b.expert_tokens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "kind", ["int4", "nvfp4-w4a16", "nvfp4-w4a4-shared", "nvfp4-w4a4-per-expert"]
)
def test_sorted_path_equals_reference_loop(kind, dtype, tiny_src, tiny_nvfp4_calibrated):
    if kind == "int4":
        source = Int4SourceWeights(CheckpointReader(tiny_src))
    elif kind == "nvfp4-w4a16":
        source = NVFP4Weights(CheckpointReader(tiny_nvfp4_calibrated), activations="w4a16")
    else:
        reduction = "layer_max" if kind.endswith("shared") else "per_expert"
        source = NVFP4Weights(
            CheckpointReader(tiny_nvfp4_calibrated), activations="w4a4", input_scale_reduction=reduction
        )
    cfg, layer, w, x = _layer(source, dtype)
    y_ref, obs_ref = _run(cfg, layer, w, x, "loop")
    y_new, obs_new = _run(cfg, layer, w, x, "sorted")
    assert y_ref.dtype == y_new.dtype == dtype
    assert torch.equal(y_ref, y_new)
    _same_stats(obs_ref, obs_new)


def test_statistics_only_pass_matches(tiny_nvfp4_calibrated):
    source = NVFP4Weights(CheckpointReader(tiny_nvfp4_calibrated), activations="w4a16")
    cfg, layer, w, x = _layer(source, torch.float32)
    y_ref, obs_ref = _run(cfg, layer, w, x, "loop", need_output=False)
    y_new, obs_new = _run(cfg, layer, w, x, "sorted", need_output=False)
    assert y_ref is None and y_new is None
    _same_stats(obs_ref, obs_new)


def test_unknown_path_is_refused(tiny_src):
    cfg, layer, w, x = _layer(Int4SourceWeights(CheckpointReader(tiny_src)), torch.float32)
    assert "sorted" in EXPERT_PATHS
    with pytest.raises(ValueError, match="expert_path"):
        moe(cfg, w.mlp, x, layer=layer, expert_path="dense")


@pytest.mark.parametrize("experts_per_group", [1, 3])
def test_sorted_path_gives_the_same_bytes_whatever_the_decoded_group(experts_per_group, monkeypatch, tiny_src):
    """Experts decoded per chunk run in groups of at most DEQUANTIZED_GROUP_BYTES (moe._expert_products): groups of
    one expert, or of three (the layer's experts then split unevenly), give what the reference loop gives."""
    from kimi_nvfp4.model import moe as moe_module

    source = Int4SourceWeights(CheckpointReader(tiny_src))
    cfg, layer, w, x = _layer(source, torch.float32)
    expert_bytes = w.mlp.experts[0].gate_proj.dequantized_bytes()
    assert expert_bytes > 0 and len(w.mlp.experts) > 3  # decoded per call, more experts than a group
    y_ref, _ = _run(cfg, layer, w, x, "loop")
    monkeypatch.setattr(moe_module, "DEQUANTIZED_GROUP_BYTES", experts_per_group * expert_bytes)
    y_new, _ = _run(cfg, layer, w, x, "sorted")
    assert torch.equal(y_ref, y_new)
