"""Scale-selection methods: baseline identity with Model Optimizer, exactness where possible, dominance."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

from kimi_nvfp4.numerics.methods import (
    DEFAULT_METHOD,
    Int4Matrix,
    MatrixErrorStats,
    ScaleMethod,
    error_stats,
    method_spec,
    quantize_int4_matrices,
)
from kimi_nvfp4.numerics.methods.search.reference import (
    block_max_code,
    candidate_errors,
    flat_blocks,
    magnitude_histogram,
    search_reference,
)
from kimi_nvfp4.numerics.methods.search.rule import model_optimizer_bits, power_of_two_tensor_scale
from kimi_nvfp4.numerics.nvfp4 import (
    dequantize_nvfp4,
    quantize_nvfp4,
    tensor_scale_from_amax,
)

from .conftest import realistic_int4

WEIGHT_ONLY = [ScaleMethod.AMAX, ScaleMethod.INT4_AWARE, ScaleMethod.SWEEP]
SEARCHED = [ScaleMethod.INT4_AWARE, ScaleMethod.SWEEP]


def _search_bits(m: Int4Matrix, weight_scale_2: torch.Tensor, method: ScaleMethod) -> torch.Tensor:
    """The search's chosen bits under `weight_scale_2` (the reference path; Model Optimizer's beside it unused)."""
    return search_reference(m, weight_scale_2, weight_scale_2, method_spec(method).search.candidates).chosen_bits


def test_default_is_int4_aware():
    assert DEFAULT_METHOD is ScaleMethod.INT4_AWARE
    assert ScaleMethod("sweep") is ScaleMethod.SWEEP


def test_amax_method_is_model_optimizer_on_the_dequantized_values(int4_pair):
    gate, up = int4_pair
    ours = quantize_int4_matrices([gate, up], "amax")
    shared = tensor_scale_from_amax(torch.maximum(gate.values().abs().amax(), up.values().abs().amax()))
    for m, q in zip((gate, up), ours):
        packed, scale, scale_2 = NVFP4QTensor.quantize(m.values(), 16, weights_scaling_factor_2=shared)
        assert torch.equal(q.weight, packed._quantized_data)
        assert torch.equal(q.weight_scale.view(torch.uint8), scale.view(torch.uint8))
        assert torch.equal(q.weight_scale_2, scale_2)


@pytest.mark.parametrize("method", WEIGHT_ONLY, ids=lambda m: m.value)
def test_gate_up_share_weight_scale_2(int4_pair, method):
    gate_q, up_q = quantize_int4_matrices(list(int4_pair), method)
    assert gate_q.weight_scale_2.dtype == torch.float32 and gate_q.weight_scale_2.ndim == 0
    assert torch.equal(gate_q.weight_scale_2, up_q.weight_scale_2)


@pytest.mark.parametrize("method", WEIGHT_ONLY, ids=lambda m: m.value)
def test_round_trips_through_model_optimizer_dequantizer(int4_pair, method):
    for m, q in zip(int4_pair, quantize_int4_matrices(list(int4_pair), method)):
        packed = NVFP4QTensor(m.shape, torch.float32, q.weight)
        theirs = packed.dequantize(
            dtype=torch.float32, scale=q.weight_scale, double_scale=q.weight_scale_2, block_sizes={-1: 16}
        )
        assert torch.equal(theirs, dequantize_nvfp4(q))
        # and re-quantizing the dequantized tensor with the same scales gives the same bytes
        again = quantize_nvfp4(theirs, weight_scale_2=q.weight_scale_2, block_scale=q.weight_scale)
        assert torch.equal(again.weight, q.weight)


@pytest.mark.parametrize("method", SEARCHED, ids=lambda m: m.value)
def test_representable_blocks_decode_exactly(method):
    # Codes from {0, +-1..4, +-6, -8} with power-of-two group scales: d = 2 * s_group makes every one exact.
    gen = torch.Generator().manual_seed(0)
    allowed = torch.tensor([0, 1, 2, 3, 4, 6, -1, -2, -3, -4, -6, -8], dtype=torch.int8)
    codes = allowed[torch.randint(0, len(allowed), (16, 128), generator=gen)]
    scale = 2.0 ** torch.randint(-12, -4, (16, 4), generator=gen).float()
    m = Int4Matrix(codes, scale)
    (q,) = quantize_int4_matrices([m], method)
    stats = error_stats(m, q)
    assert stats.exact_fraction == 1.0 and stats.rel_mse == 0.0 and stats.max_abs_error == 0.0
    (baseline,) = quantize_int4_matrices([m], ScaleMethod.AMAX)
    assert error_stats(m, baseline).exact_fraction < 1.0


@pytest.mark.parametrize("seed", range(4))
def test_never_worse_than_amax_per_matrix_and_sweep_is_best(seed):
    mats = [realistic_int4(24, 256, seed=seed), realistic_int4(24, 256, seed=seed + 100, row_spread=1.0)]
    stats = {}
    for method in WEIGHT_ONLY:
        out = quantize_int4_matrices(mats, method)
        stats[method] = [error_stats(m, q) for m, q in zip(mats, out)]
    for i in range(len(mats)):
        amax, aware, sweep = (stats[m][i].sum_squared_error for m in WEIGHT_ONLY)
        assert aware <= amax and sweep <= aware * (1 + 1e-6)
    pooled = {m: MatrixErrorStats.pooled(s).rel_mse for m, s in stats.items()}
    assert pooled[ScaleMethod.INT4_AWARE] < 0.7 * pooled[ScaleMethod.AMAX]
    assert pooled[ScaleMethod.INT4_AWARE] < 1.05 * pooled[ScaleMethod.SWEEP]


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    tensor_scale_exponent=st.floats(-20, 0),
    max_code=st.integers(1, 8),
)
def test_never_worse_than_amax_on_any_block_under_the_same_tensor_scale(seed, tensor_scale_exponent, max_code):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-min(max_code, 8), min(max_code, 7) + 1, (4, 64), generator=gen, dtype=torch.int8)
    scale = torch.exp(torch.randn(4, 2, generator=gen) * 2 - 4).to(torch.bfloat16).float()
    m = Int4Matrix(codes, scale)
    t = torch.tensor(2.0**tensor_scale_exponent, dtype=torch.float32) * float(m.amax()) / 2688
    block_codes, block_scale = flat_blocks(m.codes, m.group_scale)
    histogram = magnitude_histogram(block_codes)
    amax_bits = model_optimizer_bits(block_max_code(block_codes), block_scale, t).unsqueeze(0)
    amax_err = candidate_errors(histogram, block_scale, amax_bits, t)
    for method in SEARCHED:
        chosen_err = candidate_errors(histogram, block_scale, _search_bits(m, t, method).reshape(1, -1), t)
        assert (chosen_err <= amax_err).all()


def test_int4_matrix_validation_and_amax():
    with pytest.raises(ValueError):
        Int4Matrix(torch.zeros(2, 48, dtype=torch.int8), torch.ones(2, 1))
    with pytest.raises(ValueError):
        Int4Matrix(torch.zeros(2, 32, dtype=torch.int16), torch.ones(2, 1))
    m = Int4Matrix(torch.tensor([[-8] + [1] * 31], dtype=torch.int8), torch.tensor([[0.5]]))
    assert float(m.amax()) == 4.0 and float(m.values()[0, 0]) == -4.0


def test_error_stats_fields():
    m = realistic_int4(8, 64, seed=3)
    (q,) = quantize_int4_matrices([m], "amax")
    s = error_stats(m, q)
    diff = dequantize_nvfp4(q).double() - m.values().double()
    assert s.numel == 512
    assert s.rel_mse == pytest.approx(float(diff.square().sum() / m.values().double().square().sum()))
    assert s.max_abs_error == pytest.approx(float(diff.abs().max()))
    assert 0 < s.exact_fraction < 1
    assert MatrixErrorStats.from_dict(s.to_dict()) == s


def test_zero_matrix_and_zero_blocks():
    codes = torch.zeros(4, 64, dtype=torch.int8)
    codes[0, 40] = 3
    m = Int4Matrix(codes, torch.ones(4, 2))
    for method in WEIGHT_ONLY:
        (q,) = quantize_int4_matrices([m], method)
        assert (q.weight_scale.float()[1:] == 1.0).all()
        assert error_stats(m, q).exact_fraction == 1.0
        (z,) = quantize_int4_matrices([Int4Matrix(torch.zeros(2, 32, dtype=torch.int8), torch.ones(2, 1))], method)
        assert (dequantize_nvfp4(z) == 0).all()


def test_sweep_matches_a_slow_elementwise_reference():
    """The fast path (histograms, error table) against quantize/dequantize of every candidate scale."""
    m = realistic_int4(4, 64, seed=11, row_spread=1.0)
    t = power_of_two_tensor_scale(m.amax(), method_spec("sweep").search.tensor_scale_headroom)
    values = m.values()
    chosen = _search_bits(m, t, ScaleMethod.SWEEP)
    per_candidate = []
    for bits in range(1, 127):
        scale = torch.full((4, 4), bits, dtype=torch.uint8).view(torch.float8_e4m3fn)
        deq = dequantize_nvfp4(quantize_nvfp4(values, weight_scale_2=t, block_scale=scale))
        per_candidate.append((deq - values).double().square().reshape(4, 4, 16).sum(-1))
    errors = torch.stack(per_candidate)  # [126, 4, 4]
    best = errors.amin(0)
    got = torch.gather(errors, 0, (chosen.long() - 1).unsqueeze(0)).squeeze(0)
    assert torch.allclose(got, best, rtol=1e-6, atol=0)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    scale_spread=st.floats(0.0, 6.0),
    max_code=st.integers(1, 8),
    zero_rows=st.integers(0, 3),
)
def test_never_worse_than_amax_on_random_matrices(seed, scale_spread, max_code, zero_rows):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-min(max_code, 8), min(max_code, 7) + 1, (6, 64), generator=gen, dtype=torch.int8)
    codes[:zero_rows] = 0
    scale = torch.exp(torch.randn(6, 2, generator=gen) * scale_spread - 3).to(torch.bfloat16).float()
    m = Int4Matrix(codes, scale)
    (amax,) = quantize_int4_matrices([m], ScaleMethod.AMAX)
    baseline = error_stats(m, amax).sum_squared_error
    for method in SEARCHED:
        (q,) = quantize_int4_matrices([m], method)
        assert error_stats(m, q).sum_squared_error <= baseline * (1 + 1e-6)


def test_error_stats_over_several_row_chunks_match_a_direct_computation():
    from kimi_nvfp4.numerics.methods import error_stats
    from kimi_nvfp4.numerics.methods.stats import _STATS_STEP_ELEMENTS
    from kimi_nvfp4.numerics.nvfp4 import dequantize_nvfp4

    m = realistic_int4(2 * _STATS_STEP_ELEMENTS["cpu"] // 64 + 3, 64, seed=5)
    q = quantize_int4_matrices([m], ScaleMethod.AMAX)[0]
    diff = (dequantize_nvfp4(q) - m.values()).double()
    s = error_stats(m, q)
    assert s.numel == m.codes.numel()
    assert s.exact_fraction == float((diff == 0).sum()) / diff.numel()
    assert s.max_abs_error == float(diff.abs().max())
    assert s.sum_squared_error == pytest.approx(float(diff.square().sum()), rel=1e-12)
    assert s.sum_squares == pytest.approx(float(m.values().double().square().sum()), rel=1e-12)
