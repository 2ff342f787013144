"""`gptq-w4a4` and `gptq-w4a4-diag` (`catalog/gptq_w4a4*.py`, `output_aware/served_target.py`): the Wiener target
and the GPTQ loop against a straightforward fp64 reference written here, the W4A4 output error they are guarded
with against a direct mean over rows, and on random matrices with outlier channels and NVFP4-quantized inputs a
held-out W4A4 error never larger than gptq's."""

from __future__ import annotations

import pytest
import torch

from kimi_nvfp4.calibrate.policy import input_scale_from_amax
from kimi_nvfp4.numerics.e2m1 import pack_e2m1
from kimi_nvfp4.numerics.methods import (
    ExpertMatrices,
    InputStatsAccumulator,
    StatisticsSource,
    quantize_int4_matrices,
    requantize_experts,
)
from kimi_nvfp4.numerics.methods.catalog.gptq_w4a4 import refine_served
from kimi_nvfp4.numerics.methods.output_aware.gptq_solver import HESSIAN_DAMPING
from kimi_nvfp4.numerics.methods.output_aware.output_error import output_error
from kimi_nvfp4.numerics.methods.output_aware.refine import RefineInput
from kimi_nvfp4.numerics.methods.output_aware.served_target import served_target
from kimi_nvfp4.numerics.nvfp4 import dequantize_nvfp4, fake_quantize_activation_nvfp4

from .conftest import heavy_tailed_rows, realistic_int4
from .test_gptq import reference_gptq


def _served(rows: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """What the W4A4 kernel multiplies by: the rows fake-quantized with the static input scale (fp64 copy)."""
    return fake_quantize_activation_nvfp4(rows.float(), input_scale).double()


def _scale_of(rows: torch.Tensor) -> torch.Tensor:
    """calibrate's static input scale for these rows (their amax / (6 * 448))."""
    return input_scale_from_amax(float(rows.abs().max()))


def _stats(rows: torch.Tensor, input_scale: torch.Tensor, dense: bool = True):
    acc = InputStatsAccumulator(rows.shape[1], dense=dense, quantized=True)
    acc.add(rows, _served(rows, input_scale))
    return acc.stats()


def _dampened(h: torch.Tensor) -> torch.Tensor:
    h = h.clone()
    h.diagonal()[h.diagonal() == 0] = 1.0
    return h + HESSIAN_DAMPING * float(h.diagonal().mean()) * torch.eye(h.shape[0], dtype=torch.float64)


def test_the_accumulator_keeps_the_served_moments():
    rows = heavy_tailed_rows(300, 64, seed=1).double()
    served = _served(rows, _scale_of(rows))
    stats = _stats(rows, _scale_of(rows))
    n = rows.shape[0]
    torch.testing.assert_close(stats.hessian, rows.T @ rows / n)
    torch.testing.assert_close(stats.quantized.hessian, served.T @ served / n)
    torch.testing.assert_close(stats.quantized.cross, rows.T @ served / n)
    torch.testing.assert_close(stats.quantized.energy, served.square().mean(0))
    torch.testing.assert_close(stats.quantized.cross_energy, (rows * served).mean(0))
    assert stats.diagonal().quantized.hessian is None and stats.diagonal().quantized.energy is stats.quantized.energy
    with pytest.raises(ValueError, match="quantized rows"):
        InputStatsAccumulator(64, dense=True, quantized=True).add(rows)
    with pytest.raises(ValueError, match="quantized rows"):
        InputStatsAccumulator(64, dense=True).add(rows, served)


def test_the_guard_error_is_the_mean_served_error_over_the_rows():
    m = realistic_int4(6, 64, seed=2)
    rows = heavy_tailed_rows(400, 64, seed=3).double()
    served = _served(rows, _scale_of(rows))
    (q,) = quantize_int4_matrices([m], "int4-aware")
    w, d = m.values().double(), dequantize_nvfp4(q).double()
    direct = ((rows @ w.T - served @ d.T) ** 2).sum(1).mean()
    stats = _stats(rows, _scale_of(rows))
    assert float(output_error(m, q, stats)) == pytest.approx(float(direct), rel=1e-9)
    per_channel = ((rows * w.unsqueeze(1) - served * d.unsqueeze(1)) ** 2).mean(1).sum()  # channels independent
    assert float(output_error(m, q, stats.diagonal())) == pytest.approx(float(per_channel), rel=1e-9)


def test_served_target_is_the_closed_form_wiener_filter():
    w = realistic_int4(3, 32, seed=4).values().double()
    rows = heavy_tailed_rows(200, 32, seed=5).double()
    served = _served(rows, _scale_of(rows))
    h_q, cross = served.T @ served / 200, rows.T @ served / 200
    dampened = _dampened(h_q)
    want = w + w @ (cross - h_q) @ torch.linalg.inv(dampened)
    got = served_target(w.unsqueeze(0), cross.unsqueeze(0), h_q.unsqueeze(0))[0]
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    # undamped it is W C H~^-1 itself; damping pulls only the correction (toward W, not toward 0)
    exact = served_target(w.unsqueeze(0), cross.unsqueeze(0), h_q.unsqueeze(0), damping=0.0)[0]
    torch.testing.assert_close(exact, w @ cross @ torch.linalg.inv(h_q), rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(served_target(w.unsqueeze(0), h_q.unsqueeze(0), h_q.unsqueeze(0))[0], w)
    # diagonal statistics: each column scaled by (C_jj + d) / (H~_jj + d)
    diagonal = torch.diag(h_q.diagonal())
    got = served_target(w.unsqueeze(0), torch.diag(cross.diagonal()).unsqueeze(0), diagonal.unsqueeze(0))[0]
    d = _dampened(diagonal).diagonal() - h_q.diagonal()
    torch.testing.assert_close(got, w * (cross.diagonal() + d) / (h_q.diagonal() + d))


@pytest.mark.parametrize("dense_target", [True, False], ids=["gptq-w4a4", "gptq-w4a4-diag"])
def test_gptq_w4a4_equals_the_reference_on_the_wiener_target(dense_target):
    m = realistic_int4(5, 64, seed=6, row_spread=1.0)
    rows = heavy_tailed_rows(300, 64, seed=7).double()
    stats = _stats(rows, _scale_of(rows))
    (search,) = quantize_int4_matrices([m], "int4-aware")
    # the reference: H~ and C shrunk toward their diagonals by H's own noise, W' = W + W (C - H~)(H~ + dI)^-1 in
    # closed form, then GPTQ column by column (test_gptq.reference_gptq) with Hessian H~
    shrink = stats.hessian_shrinkage()
    assert 0.0 < shrink < 1.0
    h_q, cross = (((1 - shrink) * t + shrink * torch.diag(t.diagonal())) for t in (stats.quantized.hessian,
                                                                                   stats.quantized.cross))
    w = m.values().double()
    if dense_target:
        target = w + w @ (cross - h_q) @ torch.linalg.inv(_dampened(h_q))
    else:  # each channel's own gain (C_jj + d) / (H~_jj + d), d the damping of diag(H~)
        d = HESSIAN_DAMPING * float(h_q.diagonal().mean())
        target = w * (cross.diagonal() + d) / (h_q.diagonal() + d)
    want_codes, want_bits = reference_gptq(target, h_q, search.weight_scale_2, search.weight_scale.view(torch.uint8))
    (got,) = refine_served([RefineInput([m], [search], stats)], dense_target=dense_target)[0]
    assert torch.equal(got.weight_scale.view(torch.uint8), want_bits)
    assert torch.equal(got.weight, pack_e2m1(want_codes))
    assert torch.equal(got.weight_scale_2, search.weight_scale_2)


def test_gptq_w4a4_refuses_statistics_without_the_quantized_inputs():
    m = realistic_int4(4, 32, seed=8)
    acc = InputStatsAccumulator(32, dense=True)
    acc.add(heavy_tailed_rows(100, 32, seed=9))
    expert = ExpertMatrices("experts.0.down", [m], acc.stats())
    with pytest.raises(ValueError, match="--expert-stats w4a4"):
        requantize_experts("gptq-w4a4", [expert])


@pytest.mark.parametrize("method", ["gptq-w4a4", "gptq-w4a4-diag"])
@pytest.mark.parametrize("seed", [10, 20, 30])
def test_held_out_w4a4_error_is_not_larger_than_gptqs(seed, method):
    """Random gate/up-like matrices, inputs with outlier channels quantized as the kernel does with a static
    scale from the calibration rows; calibration and held-out rows from one distribution (one draw, split)."""
    gate, up = realistic_int4(32, 256, seed=seed), realistic_int4(32, 256, seed=seed + 1, row_spread=1.0)
    rows = heavy_tailed_rows(6000, 256, seed=seed + 2, outliers=6, rank=16).double()
    calibration, held_out = rows[:3000], rows[3000:]
    scale = _scale_of(calibration)
    stats = _stats(calibration, scale)
    plain = InputStatsAccumulator(256, dense=True)
    plain.add(calibration)
    served = requantize_experts(method, [ExpertMatrices("e.gate_up", [gate, up], stats)]).experts[0]
    gptq = requantize_experts("gptq", [ExpertMatrices("e.gate_up", [gate, up], plain.stats())]).experts[0]
    assert served.source is StatisticsSource.EXPERT_DENSE and served.kept_search == [False, False]
    x_q = _served(held_out, scale)

    def held_out_error(m, q):
        return float(((held_out @ m.values().double().T - x_q @ dequantize_nvfp4(q).double().T) ** 2).sum(1).mean())

    (search_gate, search_up) = quantize_int4_matrices([gate, up], "int4-aware")
    for m, mine, theirs, search in zip((gate, up), served.tensors, gptq.tensors, (search_gate, search_up)):
        assert held_out_error(m, mine) <= held_out_error(m, theirs)
        assert held_out_error(m, mine) < held_out_error(m, search)
