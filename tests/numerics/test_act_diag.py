"""`act-diag` (`catalog/act_diag.py`, `output_aware/weighted_search.py`) and the refinement driver's guard and
statistics fallback (`output_aware/refine.py`)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kimi_nvfp4.numerics.methods import (
    ExpertInputStats,
    ExpertMatrices,
    InputStatsAccumulator,
    Int4Matrix,
    StatisticsSource,
    quantize_int4_matrices,
    requantize_experts,
)
from kimi_nvfp4.numerics.methods.output_aware import refine as refine_module
from kimi_nvfp4.numerics.methods.output_aware.output_error import output_error
from kimi_nvfp4.numerics.methods.output_aware.weighted_search import energy_histogram, weighted_block_bits
from kimi_nvfp4.numerics.nvfp4 import dequantize_nvfp4, quantize_nvfp4

from .conftest import heavy_tailed_rows, realistic_int4


def _stats(rows: torch.Tensor, dense: bool = False) -> ExpertInputStats:
    acc = InputStatsAccumulator(rows.shape[1], dense=dense)
    acc.add(rows)
    return acc.stats()


def test_energy_histogram_sums_each_magnitudes_energy():
    m = realistic_int4(3, 64, seed=1)
    energy = torch.rand(64, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    got = energy_histogram(m.codes, energy).view(3, 4, 8)
    for r in range(3):
        for b in range(4):
            codes = m.codes[r, 16 * b : 16 * b + 16].abs()
            for k in range(1, 9):
                assert float(got[r, b, k - 1]) == pytest.approx(float(energy[16 * b : 16 * b + 16][codes == k].sum()))


def test_with_a_full_window_each_block_gets_the_least_weighted_error_of_all_126_scales():
    """Brute force: quantize the whole matrix under every E4M3 block scale, weight the errors, compare per block."""
    m = realistic_int4(6, 64, seed=3, row_spread=1.0)
    energy = torch.exp(torch.randn(64, generator=torch.Generator().manual_seed(4)) * 2).double()
    (search,) = quantize_int4_matrices([m], "int4-aware")
    scale_2 = search.weight_scale_2
    chosen = weighted_block_bits(m, search.weight_scale.view(torch.uint8), scale_2, energy, window=(-125, 125))
    values = m.values()
    per_scale = []
    for bits in range(1, 127):
        scale = torch.full((6, 4), bits, dtype=torch.uint8).view(torch.float8_e4m3fn)
        diff = dequantize_nvfp4(quantize_nvfp4(values, scale_2, scale)).double() - values.double()
        per_scale.append((diff.square() * energy).view(6, 4, 16).sum(-1))
    errors = torch.stack(per_scale)  # [126, 6, 4]
    got = torch.gather(errors, 0, (chosen.long() - 1).unsqueeze(0)).squeeze(0)
    assert torch.allclose(got, errors.amin(dim=0), rtol=1e-12, atol=0)


def test_blocks_without_energy_keep_the_searchs_scale():
    m = realistic_int4(4, 64, seed=5)
    (search,) = quantize_int4_matrices([m], "int4-aware")
    bits = search.weight_scale.view(torch.uint8)
    chosen = weighted_block_bits(m, bits, search.weight_scale_2, torch.zeros(64, dtype=torch.float64))
    assert torch.equal(chosen, bits)


def test_act_diag_lowers_the_weighted_output_error_and_the_guard_reports_it():
    gate, up = realistic_int4(64, 256, seed=6), realistic_int4(64, 256, seed=7)
    stats = _stats(heavy_tailed_rows(2000, 256, seed=8))
    summary = requantize_experts("act-diag", [ExpertMatrices("experts.0.gate_up", [gate, up], stats)])
    (expert,) = summary.experts
    assert expert.source is StatisticsSource.EXPERT_DIAGONAL and expert.kept_search == [False, False]
    searched = quantize_int4_matrices([gate, up], "int4-aware")
    for m, q, before, after, s in zip((gate, up), expert.tensors, expert.search_error, expert.final_error, searched):
        assert before == float(output_error(m, s, stats.diagonal()))
        assert after == float(output_error(m, q, stats.diagonal())) and after < 0.9 * before
        assert torch.equal(q.weight_scale_2, s.weight_scale_2)  # gate and up keep the shared tensor scale


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    outliers=st.integers(0, 8),
    outlier_gain=st.floats(1.0, 300.0),
    row_spread=st.floats(0.0, 2.0),
    tokens=st.integers(64, 400),
)
def test_output_aware_methods_never_increase_the_weighted_output_error(seed, outliers, outlier_gain, row_spread, tokens):
    """Property: for random matrices and activations with outlier channels, act-diag's and gptq's result has a
    calibration-weighted output error no larger than int4-aware's for every matrix."""
    gate, up = realistic_int4(16, 64, seed=seed, row_spread=row_spread), realistic_int4(16, 64, seed=seed + 1)
    down = realistic_int4(64, 32, seed=seed + 2, row_spread=row_spread)
    rows = heavy_tailed_rows(tokens, 64, seed=seed, outliers=outliers, outlier_gain=outlier_gain)
    hidden = heavy_tailed_rows(tokens, 32, seed=seed + 3, outliers=outliers, outlier_gain=outlier_gain)
    experts = [
        ExpertMatrices("gate_up", [gate, up], _stats(rows, dense=True)),
        ExpertMatrices("down", [down], _stats(hidden, dense=True)),
    ]
    for method in ("act-diag", "gptq"):
        summary = requantize_experts(method, experts)
        for expert, given_expert in zip(summary.experts, experts):
            searched = quantize_int4_matrices(given_expert.matrices, "int4-aware")
            stats = given_expert.stats if expert.source is StatisticsSource.EXPERT_DENSE else given_expert.stats.diagonal()
            for m, q, s in zip(given_expert.matrices, expert.tensors, searched):
                assert output_error(m, q, stats) <= output_error(m, s, stats)


def test_statistics_fallback_and_counts(monkeypatch):
    monkeypatch.setattr(refine_module, "DIAGONAL_MIN_TOKENS", 50)
    m = realistic_int4(8, 64, seed=9)
    dense = _stats(heavy_tailed_rows(200, 64, seed=10), dense=True)  # 200 >= 64 tokens per channel x 1
    few = _stats(heavy_tailed_rows(20, 64, seed=11), dense=True)
    shared = _stats(heavy_tailed_rows(400, 64, seed=12), dense=True)
    experts = [
        ExpertMatrices("a", [m], dense),
        ExpertMatrices("b", [m], few, shared_stats=shared),
        ExpertMatrices("c", [m], few),
        ExpertMatrices("d", [m], None, shared_stats=shared.diagonal()),
        ExpertMatrices("e", [m], ExpertInputStats(0, torch.zeros(64))),
    ]
    summary = requantize_experts("gptq", experts)
    sources = [e.source for e in summary.experts]
    assert sources == [
        StatisticsSource.EXPERT_DENSE, StatisticsSource.SHARED_DENSE, StatisticsSource.NONE,
        StatisticsSource.SHARED_DIAGONAL, StatisticsSource.NONE,
    ]
    counts = summary.counts()
    assert counts["expert-dense"] == 1 and counts["none"] == 2 and counts["shared-dense"] == 1
    (searched,) = quantize_int4_matrices([m], "int4-aware")
    for e in summary.experts:
        if e.source is StatisticsSource.NONE:
            assert torch.equal(e.tensors[0].weight, searched.weight) and e.kept_search == [True]
    diag = requantize_experts("act-diag", experts[:1])
    assert diag.experts[0].source is StatisticsSource.EXPERT_DIAGONAL  # act-diag never asks for the dense one


def test_requantize_refuses_weight_only_methods_and_mismatched_statistics():
    m = realistic_int4(8, 64, seed=13)
    with pytest.raises(ValueError, match="convert runs it"):
        requantize_experts("int4-aware", [ExpertMatrices("x", [m], None)])
    with pytest.raises(ValueError, match="width"):
        requantize_experts("act-diag", [ExpertMatrices("x", [m], _stats(heavy_tailed_rows(100, 32)))])
    with pytest.raises(ValueError, match="one input width"):
        requantize_experts("act-diag", [ExpertMatrices("x", [m, Int4Matrix(m.codes[:, :32], m.group_scale[:, :1])], None)])


@pytest.mark.gpu
def test_act_diag_bytes_are_identical_on_cuda():
    gate, up = realistic_int4(128, 512, seed=14), realistic_int4(128, 512, seed=15, row_spread=1.0)
    stats = _stats(heavy_tailed_rows(1000, 512, seed=16))
    cpu = requantize_experts("act-diag", [ExpertMatrices("e", [gate, up], stats)]).experts[0]
    cuda = requantize_experts("act-diag", [ExpertMatrices("e", [gate.to("cuda"), up.to("cuda")], stats)]).experts[0]
    for a, b in zip(cpu.tensors, cuda.tensors):
        assert torch.equal(a.weight, b.weight.cpu()) and torch.equal(a.weight_scale.view(torch.uint8), b.weight_scale.view(torch.uint8).cpu())
    assert cpu.final_error == cuda.final_error  # the diagonal error is a fixed-order sum on both devices
