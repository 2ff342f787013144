"""BF16-source NVFP4 (shared experts): Model Optimizer's bytes for a lone matrix, one weight_scale_2 per group,
and the MSE block-scale rule never worse than amax."""

from __future__ import annotations

import pytest
import torch
from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

from kimi_nvfp4.numerics.bf16_source import (
    Bf16ScaleRule,
    group_tensor_scale,
    mse_block_scales,
    quantize_bf16_group,
    weight_mse,
)
from kimi_nvfp4.numerics.nvfp4 import NVFP4Tensor, amax_block_scales, dequantize_nvfp4, tensor_scale_from_amax


def _bf16(rows: int, cols: int, seed: int, outliers: bool = False) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=gen) * 0.02
    if outliers:  # a few large weights per row, as trained MLPs have
        idx = torch.randint(0, cols, (rows, 2), generator=gen)
        w.scatter_(1, idx, torch.randn(rows, 2, generator=gen) * 0.5)
    return w.to(torch.bfloat16)


def _modelopt_bytes(w: torch.Tensor, weight_scale_2: torch.Tensor | None = None):
    q, scale, scale_2 = NVFP4QTensor.quantize(w.float().clone(), 16, weights_scaling_factor_2=weight_scale_2)
    return q._quantized_data, scale.view(torch.uint8), scale_2.float().reshape(())


def _block_errors(w: torch.Tensor, q: NVFP4Tensor) -> torch.Tensor:
    return (dequantize_nvfp4(q) - w.float()).square().reshape(w.shape[0], -1, 16).sum(-1)


@pytest.mark.parametrize("outliers", [False, True], ids=["gaussian", "outliers"])
def test_a_lone_matrix_is_model_optimizers_bytes(outliers):
    w = _bf16(48, 96, seed=1, outliers=outliers)
    (ours,) = quantize_bf16_group([w])
    packed, scale, scale_2 = _modelopt_bytes(w)
    assert torch.equal(ours.weight, packed)
    assert torch.equal(ours.weight_scale.view(torch.uint8), scale)
    assert torch.equal(ours.weight_scale_2.view(torch.int32), scale_2.view(torch.int32))


def test_gate_and_up_share_the_larger_amax_and_match_model_optimizer_with_it():
    gate, up = _bf16(32, 64, seed=2), _bf16(32, 64, seed=3) * 4  # up has the larger amax
    q_gate, q_up = quantize_bf16_group([gate, up])
    expected = tensor_scale_from_amax(up.float().abs().amax())
    assert torch.equal(q_gate.weight_scale_2, expected) and torch.equal(q_up.weight_scale_2, expected)
    assert torch.equal(group_tensor_scale([gate, up]), expected)
    for w, q in ((gate, q_gate), (up, q_up)):
        packed, scale, _ = _modelopt_bytes(w, expected)
        assert torch.equal(q.weight, packed) and torch.equal(q.weight_scale.view(torch.uint8), scale)


def test_an_all_zero_matrix_gets_zero_codes_and_unit_block_scales():
    (q,) = quantize_bf16_group([torch.zeros(16, 32, dtype=torch.bfloat16)])
    assert not q.weight.any()
    assert torch.equal(q.weight_scale.float(), torch.ones(16, 2))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("outliers", [False, True], ids=["gaussian", "outliers"])
def test_mse_rule_is_never_worse_than_amax_per_block_and_overall(seed, outliers):
    w = _bf16(64, 128, seed=10 + seed, outliers=outliers)
    (amax,) = quantize_bf16_group([w], Bf16ScaleRule.AMAX)
    (mse,) = quantize_bf16_group([w], Bf16ScaleRule.MSE)
    assert torch.equal(mse.weight_scale_2, amax.weight_scale_2)
    assert (_block_errors(w, mse) <= _block_errors(w, amax)).all()
    assert weight_mse(w, mse) < weight_mse(w, amax)  # strictly better on trained-like weights


def test_mse_scales_keep_the_amax_scale_where_nothing_is_better():
    # a block whose values sit exactly on the amax grid: the amax scale has zero error and must be kept
    w = torch.tensor([[0.0, 0.5, 1, 1.5, 2, 3, 4, 6] * 2], dtype=torch.float32)
    scale_2 = tensor_scale_from_amax(torch.tensor(6.0))
    assert torch.equal(mse_block_scales(w, scale_2).view(torch.uint8), amax_block_scales(w, scale_2).view(torch.uint8))


def test_bad_weights_are_refused():
    with pytest.raises(ValueError, match="2-d floating-point"):
        quantize_bf16_group([torch.zeros(4, 16, dtype=torch.int32)])
    with pytest.raises(ValueError, match="at least one"):
        group_tensor_scale([])
