"""Calibration statistics of expert inputs (`output_aware/input_stats.py`) and the weighted output error."""

from __future__ import annotations

import pytest
import torch

from kimi_nvfp4.numerics.methods import ExpertInputStats, InputStatsAccumulator, quantize_int4_matrices
from kimi_nvfp4.numerics.methods.output_aware.output_error import fixed_order_sum, output_error
from kimi_nvfp4.numerics.nvfp4 import dequantize_nvfp4

from .conftest import heavy_tailed_rows, realistic_int4


def test_accumulating_batches_equals_the_statistics_of_all_rows():
    rows = heavy_tailed_rows(300, 64, seed=1)
    acc = InputStatsAccumulator(64, dense=True)
    for part in rows.split(77):
        acc.add(part.to(torch.bfloat16))  # calibration hands over the serving dtype
    stats = acc.stats()
    x = rows.to(torch.bfloat16).double()
    assert stats.tokens == 300
    assert torch.allclose(stats.channel_energy, (x * x).mean(dim=0), rtol=1e-12, atol=0)
    assert torch.allclose(stats.hessian, x.t() @ x / 300, rtol=1e-12, atol=1e-300)
    diagonal_only = InputStatsAccumulator(64, dense=False)
    diagonal_only.add(rows.view(3, 100, 64))  # any leading shape
    assert diagonal_only.stats().hessian is None and diagonal_only.stats().tokens == 300


def test_empty_and_bad_statistics():
    empty = InputStatsAccumulator(32, dense=True).stats()
    assert empty.tokens == 0 and empty.hessian is None and not bool(empty.channel_energy.any())
    with pytest.raises(ValueError, match="width"):
        InputStatsAccumulator(32, dense=False).add(torch.zeros(4, 16))
    with pytest.raises(ValueError, match="tokens"):
        ExpertInputStats(-1, torch.ones(4))
    with pytest.raises(ValueError, match="finite"):
        ExpertInputStats(3, torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match="shape"):
        ExpertInputStats(3, torch.ones(4), torch.ones(4, 3))


def test_pooled_statistics_are_token_weighted():
    a, b = heavy_tailed_rows(100, 32, seed=2), heavy_tailed_rows(300, 32, seed=3)
    stats = []
    for rows in (a, b):
        acc = InputStatsAccumulator(32, dense=True)
        acc.add(rows)
        stats.append(acc.stats())
    whole = InputStatsAccumulator(32, dense=True)
    whole.add(torch.cat([a, b]))
    pooled = ExpertInputStats.pooled(stats)
    assert pooled.tokens == 400
    assert torch.allclose(pooled.channel_energy, whole.stats().channel_energy, rtol=1e-12)
    assert torch.allclose(pooled.hessian, whole.stats().hessian, rtol=1e-10, atol=1e-14)


def test_fixed_order_sum_is_a_sum():
    x = torch.arange(1000, dtype=torch.float64).view(10, 100)
    assert torch.equal(fixed_order_sum(x), x.sum(dim=1))
    assert float(fixed_order_sum(torch.zeros(0, dtype=torch.float64))) == 0.0
    assert torch.equal(fixed_order_sum(x, dim=0), x.sum(dim=0))


def test_output_error_is_the_output_difference_on_the_calibration_rows():
    m = realistic_int4(24, 128, seed=4)
    (q,) = quantize_int4_matrices([m], "int4-aware")
    rows = heavy_tailed_rows(500, 128, seed=5)
    acc = InputStatsAccumulator(128, dense=True)
    acc.add(rows)
    stats = acc.stats()
    x = rows.double()
    direct = (x @ (m.values().double() - dequantize_nvfp4(q).double()).t()).square().sum() / 500
    assert float(output_error(m, q, stats)) == pytest.approx(float(direct), rel=1e-9)
    diff = m.values().double() - dequantize_nvfp4(q).double()
    diagonal = (diff.square().sum(dim=0) * stats.channel_energy).sum()
    assert float(output_error(m, q, stats.diagonal())) == pytest.approx(float(diagonal), rel=1e-12)
    with pytest.raises(ValueError, match="width"):
        output_error(m, q, ExpertInputStats(1, torch.ones(64)))


def test_hessian_shrinkage_tracks_the_sampling_noise_of_the_off_diagonal():
    def shrinkage(rows: torch.Tensor) -> float:
        acc = InputStatsAccumulator(rows.shape[1], dense=True)
        acc.add(rows)
        return acc.stats().hessian_shrinkage()

    gen = torch.Generator().manual_seed(6)
    independent = torch.randn(2000, 128, generator=gen)
    assert shrinkage(independent) > 0.9  # no structure beyond the diagonal: pull all the way
    correlated = [shrinkage(heavy_tailed_rows(n, 128, seed=7)) for n in (60, 600, 6000)]
    assert correlated[0] > correlated[1] > correlated[2] and correlated[2] < 0.05  # less noise, less pull
    acc = InputStatsAccumulator(128, dense=True)
    acc.add(heavy_tailed_rows(600, 128, seed=7))
    stats = acc.stats()
    assert stats.diagonal().hessian_shrinkage() == 0.0  # nothing dense to shrink
    assert ExpertInputStats(stats.tokens, stats.channel_energy, stats.hessian).hessian_shrinkage() == 0.0
    assert ExpertInputStats.pooled([stats, stats]).hessian_shrinkage() == pytest.approx(
        ExpertInputStats(1200, stats.channel_energy, stats.hessian, stats.mean_norm_fourth, stats.mean_fourth_power)
        .hessian_shrinkage()
    )


@pytest.mark.gpu
def test_bf16_rows_on_a_gpu_sum_their_outer_products_on_tensor_cores_in_float32():
    """16-bit rows with float32 sums on a GPU take the tensor-core X^T X (float32 accumulation and output): equal to
    the float64 reference to float32 accuracy, and not the bf16-rounded product a plain bf16 matmul would give."""
    g = torch.Generator().manual_seed(0)
    rows = (torch.randn(3000, 256, generator=g) * torch.linspace(0.1, 4.0, 256)).to(torch.bfloat16)
    acc = InputStatsAccumulator(256, dense=True, device="cuda", dtype=torch.float32)
    for part in rows.split(700):
        acc.add(part.cuda())
    want = rows.double().t() @ rows.double()
    got = acc.sum_outer.double().cpu()
    assert acc.sum_outer.dtype == torch.float32
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-3 * float(want.diagonal().max()) * 1e-3)
    rounded = (rows.cuda().t() @ rows.cuda()).double().cpu()  # bf16 output: ~3 significant digits
    assert (got - want).abs().max() < (rounded - want).abs().max() / 10
