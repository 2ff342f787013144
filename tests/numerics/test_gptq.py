"""`gptq` (`catalog/gptq.py`, `output_aware/gptq_solver.py`) against a straightforward reference written here."""

from __future__ import annotations

import pytest
import torch

from kimi_nvfp4.numerics.constants import E2M1_MAX
from kimi_nvfp4.numerics.e2m1 import decode_e2m1, encode_e2m1, pack_e2m1
from kimi_nvfp4.numerics.e4m3 import e4m3_bits_to_fp32
from kimi_nvfp4.numerics.methods import (
    ExpertInputStats,
    ExpertMatrices,
    InputStatsAccumulator,
    StatisticsSource,
    quantize_int4_matrices,
    requantize_experts,
)
from kimi_nvfp4.numerics.methods.output_aware.gptq_solver import (
    HESSIAN_DAMPING,
    SCALE_WINDOW,
    gptq_quantize,
    hessian_factor,
)
from kimi_nvfp4.numerics.methods.output_aware.output_error import output_error

from .conftest import heavy_tailed_rows, realistic_int4


def _e4m3_bits(x: float) -> int:
    return int(torch.tensor(x, dtype=torch.float32).clamp(2.0**-9, 448.0).to(torch.float8_e4m3fn).view(torch.uint8))


def _quantize(w: float, bits: int, scale_2: torch.Tensor) -> tuple[int, float]:
    d = e4m3_bits_to_fp32(torch.tensor([bits], dtype=torch.uint8)) * scale_2
    code = encode_e2m1((torch.tensor([w], dtype=torch.float64) / d.double()).float())
    return int(code), float((decode_e2m1(code) * d).double())


def reference_gptq(weight, hessian, scale_2, search_bits, damping=HESSIAN_DAMPING, window=SCALE_WINDOW):
    """Column by column in float64, one row at a time for the scales: GPTQ as the paper writes it (no lazy batches),
    the NVFP4 block scale of each row chosen at the block's first column among the search's scale and the window
    around the updated block's amax/6, by sum_j (w_j - q_j)^2 / U_jj^2."""
    rows, columns = weight.shape
    h = hessian.clone()
    h.diagonal()[h.diagonal() == 0] = 1.0
    h += damping * float(h.diagonal().mean()) * torch.eye(columns, dtype=torch.float64)
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    w = weight.clone()
    codes = torch.zeros(rows, columns, dtype=torch.uint8)
    bits = torch.zeros(rows, columns // 16, dtype=torch.uint8)
    for j in range(columns):
        if j % 16 == 0:
            for r in range(rows):
                block = w[r, j : j + 16].tolist()
                amax = torch.tensor(max(abs(v) for v in block), dtype=torch.float32)
                centre = _e4m3_bits(float(amax / (E2M1_MAX * scale_2)))  # fp32 division, as the solver
                candidates = [int(search_bits[r, j // 16])]
                candidates += [min(126, max(1, centre + o)) for o in range(window[0], window[1] + 1)]
                costs = []
                for b in candidates:
                    cost = 0.0
                    for t, v in enumerate(block):
                        cost += (v - _quantize(v, b, scale_2)[1]) ** 2 / float(u[j + t, j + t]) ** 2
                    costs.append(cost)
                bits[r, j // 16] = candidates[costs.index(min(costs))]
        error = torch.zeros(rows, dtype=torch.float64)
        for r in range(rows):
            code, q = _quantize(float(w[r, j]), int(bits[r, j // 16]), scale_2)
            codes[r, j] = code
            error[r] = (w[r, j] - q) / u[j, j]
        w[:, j:] -= torch.outer(error, u[j, j:])
    return codes, bits


def _stats(rows: torch.Tensor):
    acc = InputStatsAccumulator(rows.shape[1], dense=True)
    acc.add(rows)
    return acc.stats()


def test_batched_gptq_equals_the_column_by_column_reference():
    m = realistic_int4(5, 64, seed=1, row_spread=1.0)
    stats = _stats(heavy_tailed_rows(200, 64, seed=2))
    (search,) = quantize_int4_matrices([m], "int4-aware")
    scale_2 = search.weight_scale_2
    want_codes, want_bits = reference_gptq(m.values().double(), stats.hessian, scale_2, search.weight_scale.view(torch.uint8))
    for block_columns in (32, 128):  # lazy batches of 2 blocks, and the whole width in one batch
        codes, bits, ok = gptq_quantize(
            m.values().double().unsqueeze(0), stats.hessian.unsqueeze(0), scale_2.view(1),
            search.weight_scale.view(torch.uint8).unsqueeze(0), block_columns=block_columns,
        )
        assert bool(ok.all())
        assert torch.equal(bits[0], want_bits) and torch.equal(codes[0], want_codes)


def test_gptq_options_reach_the_solver():
    """`--method-option damping=... scale_window=...` change what the solver computes, as the reference says; the
    defaults are the solver's constants, so no options is the shipped method."""
    from kimi_nvfp4.numerics.methods.catalog.gptq import GptqOptions

    m = realistic_int4(5, 64, seed=1, row_spread=1.0)
    stats = _stats(heavy_tailed_rows(200, 64, seed=2))
    stats = ExpertInputStats(stats.tokens, stats.channel_energy, stats.hessian)  # no fourth moments: no shrinkage
    (search,) = quantize_int4_matrices([m], "int4-aware")
    scale_2, search_bits = search.weight_scale_2, search.weight_scale.view(torch.uint8)
    options = GptqOptions(damping=0.3, scale_window=(-1, 2), block_columns=32)
    want_codes, want_bits = reference_gptq(m.values().double(), stats.hessian, scale_2, search_bits, 0.3, (-1, 2))
    codes, bits, _ = gptq_quantize(m.values().double().unsqueeze(0), stats.hessian.unsqueeze(0), scale_2.view(1),
                                   search_bits.unsqueeze(0), **options.solver_keywords())
    assert torch.equal(bits[0], want_bits) and torch.equal(codes[0], want_codes)
    default_codes, _ = reference_gptq(m.values().double(), stats.hessian, scale_2, search_bits)
    assert not torch.equal(default_codes, want_codes)  # the options changed the result
    expert = [ExpertMatrices("x", [m], stats)]
    assert requantize_experts("gptq", expert, options={}).experts[0].final_error == \
        requantize_experts("gptq", expert).experts[0].final_error
    tuned = requantize_experts("gptq", expert, options=options).experts[0]
    if not tuned.kept_search[0]:
        assert torch.equal(tuned.tensors[0].weight, pack_e2m1(want_codes))


def test_experts_in_one_batch_get_what_they_get_alone():
    mats = [realistic_int4(8, 64, seed=s) for s in (3, 4, 5)]
    stats = [_stats(heavy_tailed_rows(150, 64, seed=s)) for s in (6, 7, 8)]
    searched = [quantize_int4_matrices([m], "int4-aware")[0] for m in mats]
    inputs = (
        torch.stack([m.values().double() for m in mats]), torch.stack([s.hessian for s in stats]),
        torch.stack([q.weight_scale_2 for q in searched]), torch.stack([q.weight_scale.view(torch.uint8) for q in searched]),
    )
    together = gptq_quantize(*inputs)
    for e in range(3):
        alone = gptq_quantize(*(t[e : e + 1] for t in inputs))
        assert torch.equal(together[0][e], alone[0][0]) and torch.equal(together[1][e], alone[1][0])


def test_gptq_beats_int4_aware_and_act_diag_on_correlated_inputs():
    gate, up = realistic_int4(48, 256, seed=9), realistic_int4(48, 256, seed=10, row_spread=1.0)
    stats = _stats(heavy_tailed_rows(3000, 256, seed=11, rank=16))
    expert = ExpertMatrices("experts.0.gate_up", [gate, up], stats)
    gptq = requantize_experts("gptq", [expert]).experts[0]
    act_diag = requantize_experts("act-diag", [expert]).experts[0]
    assert gptq.source is StatisticsSource.EXPERT_DENSE and gptq.kept_search == [False, False]
    for m, q, d, before in zip((gate, up), gptq.tensors, act_diag.tensors, gptq.search_error):
        after = float(output_error(m, q, stats))
        assert after < 0.7 * before and after < float(output_error(m, d, stats))
    assert torch.equal(gptq.tensors[0].weight_scale_2, gptq.tensors[1].weight_scale_2)
    packed = gptq.tensors[0]
    assert packed.weight.dtype == torch.uint8 and packed.weight.shape == (48, 128)


def test_the_hessian_is_shrunk_toward_its_diagonal_by_its_noise():
    """With fewer tokens than channels the shrunk H generalises; GPTQ gets it, not the raw one."""
    from kimi_nvfp4.numerics.methods.catalog.gptq import _shrunk_hessian
    from kimi_nvfp4.numerics.methods.output_aware.refine import RefineInput

    m = realistic_int4(4, 64, seed=18)
    stats = _stats(heavy_tailed_rows(40, 64, seed=19))
    weight = stats.hessian_shrinkage()
    assert 0.0 < weight < 1.0
    shrunk = _shrunk_hessian(RefineInput([m], quantize_int4_matrices([m], "int4-aware"), stats))
    assert torch.allclose(shrunk.diagonal(), stats.hessian.diagonal())
    off = ~torch.eye(64, dtype=torch.bool)
    assert torch.allclose(shrunk[off], (1 - weight) * stats.hessian[off])


def test_the_factor_survives_singular_and_dead_hessians():
    x = heavy_tailed_rows(10, 64, seed=12)  # rank 10 < 64
    hessian = x.double().t() @ x.double() / 10
    hessian[5, :] = 0
    hessian[:, 5] = 0  # a channel calibration never excited
    upper, ok = hessian_factor(torch.stack([hessian, torch.zeros(64, 64, dtype=torch.float64)]))
    assert bool(ok.all()) and bool(torch.isfinite(upper).all())
    assert torch.allclose(torch.triu(upper[0]), upper[0])
    assert float(upper[0, 5, 6:].abs().max()) == 0.0  # nothing propagates from a dead channel
    assert float(upper[0, :5, 5].abs().max()) == 0.0  # nor onto it


def test_a_pack_of_the_codes_is_the_stored_weight():
    m = realistic_int4(4, 64, seed=13)
    sampled = _stats(heavy_tailed_rows(100, 64, seed=14))
    stats = ExpertInputStats(sampled.tokens, sampled.channel_energy, sampled.hessian)  # no fourth moments: no shrinkage
    (search,) = quantize_int4_matrices([m], "int4-aware")
    codes, bits, _ = gptq_quantize(
        m.values().double().unsqueeze(0), stats.hessian.unsqueeze(0), search.weight_scale_2.view(1),
        search.weight_scale.view(torch.uint8).unsqueeze(0),
    )
    result = requantize_experts("gptq", [ExpertMatrices("x", [m], stats)]).experts[0]
    if not result.kept_search[0]:
        assert torch.equal(result.tensors[0].weight, pack_e2m1(codes[0]))
        assert torch.equal(result.tensors[0].weight_scale.view(torch.uint8), bits[0])


@pytest.mark.gpu
def test_gptq_on_cuda_is_close_to_the_cpu_reference():
    """GPTQ's products and factorisations order their sums per library: CUDA may flip rare codes. Tolerance: at
    most 0.1% of codes differ and the weighted output error is within 1%."""
    gate, up = realistic_int4(128, 512, seed=15), realistic_int4(128, 512, seed=16)
    stats = _stats(heavy_tailed_rows(2000, 512, seed=17))
    cpu = requantize_experts("gptq", [ExpertMatrices("e", [gate, up], stats)]).experts[0]
    cuda = requantize_experts("gptq", [ExpertMatrices("e", [gate.to("cuda"), up.to("cuda")], stats)]).experts[0]
    for a, b, e_cpu, e_cuda in zip(cpu.tensors, cuda.tensors, cpu.final_error, cuda.final_error):
        assert float((a.weight != b.weight.cpu()).float().mean()) <= 1e-3
        assert e_cuda == pytest.approx(e_cpu, rel=1e-2)
