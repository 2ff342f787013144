"""The per-expert output check's token cap (validate/experts.py) and the weight check's one read-back per layer
(validate/weights.py)."""

from __future__ import annotations

import pytest
import torch

from kimi_nvfp4.checkpoint.reader import CheckpointReader

from kimi_nvfp4.model.linear import ActivationMode
from kimi_nvfp4.model.nvfp4_linears import InputScaleReduction
from kimi_nvfp4.numerics.methods import Int4Matrix, error_stats
from kimi_nvfp4.numerics.nvfp4 import NVFP4Tensor
from kimi_nvfp4.validate.streams import compare_streams
from kimi_nvfp4.validate.weights import compare_expert, resolve_comparisons
from kimi_nvfp4.stage_kit.samples import DataPart, load_sample_set


def _streams(src, out, cap):
    reader = CheckpointReader(out)
    sequences = load_sample_set(out, "sample", part=DataPart.HELDOUT, samples=3, seq_len=48, seed=0).sequences
    return compare_streams(
        CheckpointReader(src), reader, sequences, modes=[ActivationMode.W4A16], reduction=InputScaleReduction.LAYER_MAX,
        device=torch.device("cpu"), flag_rel_mse=1.0, progress=False, expert_check_tokens=cap,
    )


def test_the_cap_limits_compared_tokens_and_changes_nothing_else(calibrated_pair):
    src, out = calibrated_pair
    full = _streams(src, out, 0)
    capped = _streams(src, out, 2)
    routed = {(e.layer, e.expert): e.tokens for e in full.expert_errors}
    assert max(routed.values()) > 2  # the cap bites
    assert {(e.layer, e.expert) for e in capped.expert_errors} == set(routed)
    for e in capped.expert_errors:
        assert e.tokens == min(2, routed[(e.layer, e.expert)])
    # an expert that got no more tokens than the cap is compared on the same tokens: the same figure
    for e in capped.expert_errors:
        if routed[(e.layer, e.expert)] <= 2:
            twin = next(f for f in full.expert_errors if (f.layer, f.expert, f.mode) == (e.layer, e.expert, e.mode))
            assert e.rel_mse == twin.rel_mse
    # the streams themselves are untouched by the cap
    assert [x.model_dump() for x in capped.end_to_end] == [x.model_dump() for x in full.end_to_end]
    assert capped.weights == full.weights


def test_one_read_back_per_layer_gives_the_per_matrix_figures(calibrated_pair):
    src, out = calibrated_pair
    source, output = CheckpointReader(src), CheckpointReader(out)
    cfg = source.layout.text
    layer = next(i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i))
    found = {e: compare_expert(source, output, layer, e, torch.device("cpu")) for e in range(cfg.n_routed_experts)}
    resolved = resolve_comparisons(found)
    for e, pairs in resolved.items():
        for comp, stats in pairs:
            module = comp.module
            m = Int4Matrix.from_packed(source.load(f"{module}.weight_packed"), source.load(f"{module}.weight_scale"),
                                       int(source.load(f"{module}.weight_shape")[1]))
            pending = next(p for p in found[e] if p.module == module)
            assert pending.numel == m.codes.numel() and comp.expert == e and comp.rel_mse == stats.rel_mse
            if comp.proj != "up_proj":  # up is served with gate's weight_scale_2 (weights.py)
                q = NVFP4Tensor(output.load(f"{module}.weight"), output.load(f"{module}.weight_scale"),
                                output.load(f"{module}.weight_scale_2").to(torch.float32).reshape(()))
                assert stats == error_stats(m, q)
    # an unreadable expert stays a message, the others resolve
    found[0] = "cannot read"
    assert resolve_comparisons(found)[0] == "cannot read"
    assert resolve_comparisons({}) == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_weight_check_on_cuda_gives_the_per_matrix_summary(calibrated_pair, monkeypatch):
    from kimi_nvfp4.validate import weights as weights_module

    src, out = calibrated_pair
    reader = CheckpointReader(out)
    sequences = load_sample_set(out, "sample", part=DataPart.HELDOUT, samples=2, seq_len=32, seed=0).sequences

    def summary(fused: bool):
        monkeypatch.setattr(weights_module, "USE_FUSED_WEIGHT_CHECK", fused)
        return compare_streams(
            CheckpointReader(src), reader, sequences, modes=[ActivationMode.W4A16],
            reduction=InputScaleReduction.LAYER_MAX, device=torch.device("cuda"), flag_rel_mse=1.0, progress=False,
        ).weights

    fused, reference = summary(True), summary(False)
    assert fused.matrices == reference.matrices > 0
    assert fused.exact_fraction == reference.exact_fraction
    assert fused.rel_mse == pytest.approx(reference.rel_mse, rel=1e-12)
    assert fused.rel_mse_max == pytest.approx(reference.rel_mse_max, rel=1e-12)
    assert [w.module for w in fused.worst] == [w.module for w in reference.worst]
