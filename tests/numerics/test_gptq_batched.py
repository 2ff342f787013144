"""The batched GPTQ solver (`gptq_solver.gptq_quantize`: one batched dampened Cholesky and batched column steps
over an expert dimension, no per-expert Python loop, no inverse) against the per-expert float64 oracle
(`reference_gptq` in test_gptq.py: column by column, GPTQ's own form with the Cholesky factor U of an explicit
inverse Hessian, one expert at a time).

Tolerance, stated: on the CPU in float64 the batch gives the oracle's E2M1 codes and E4M3 block-scale bits exactly
(0 differing codes); the solver's factor R is the inverse of the oracle's U to 1e-9 relative (the two compute
it by different factorisations, so only rounding separates them)."""

from __future__ import annotations

import torch

from kimi_nvfp4.numerics.methods import InputStatsAccumulator, quantize_int4_matrices
from kimi_nvfp4.numerics.methods.catalog.gptq import GptqOptions
from kimi_nvfp4.numerics.methods.output_aware.gptq_solver import gptq_quantize, hessian_factor

from .conftest import heavy_tailed_rows, realistic_int4
from .test_gptq import reference_gptq

EXPERTS = 6
FACTOR_RTOL = 1e-9


def _hessian(tokens: int, width: int, seed: int) -> torch.Tensor:
    acc = InputStatsAccumulator(width, dense=True)
    acc.add(heavy_tailed_rows(tokens, width, seed=seed))
    return acc.stats().hessian


def _batch(width: int = 64, rows: int = 6):
    mats = [realistic_int4(rows, width, seed=40 + e, row_spread=0.3 + 0.2 * e) for e in range(EXPERTS)]
    # different token counts per expert: well-conditioned, rank-deficient (fewer tokens than channels), one
    # channel never excited (GPTQ's dead-channel rule)
    hessians = [_hessian(t, width, seed=60 + e) for e, t in enumerate((400, 200, 90, 40, 30, 300))]
    hessians[2][7, :] = 0
    hessians[2][:, 7] = 0
    searched = [quantize_int4_matrices([m], "int4-aware")[0] for m in mats]
    return (torch.stack([m.values().double() for m in mats]), torch.stack(hessians),
            torch.stack([q.weight_scale_2 for q in searched]),
            torch.stack([q.weight_scale.view(torch.uint8) for q in searched]))


def _oracle_factor(hessian: torch.Tensor, damping: float) -> torch.Tensor:
    h = hessian.clone()
    h.diagonal()[h.diagonal() == 0] = 1.0
    h += damping * float(h.diagonal().mean()) * torch.eye(h.shape[0], dtype=torch.float64)
    return torch.linalg.cholesky(torch.linalg.inv(h), upper=True)


def test_the_batched_factor_is_the_inverse_of_the_per_expert_oracle():
    """R R^T is the dampened H, and R = U^-1 for GPTQ's U = chol(H^-1) upper: the identity the solver rests on."""
    _, hessians, _, _ = _batch()
    upper, ok = hessian_factor(hessians, 0.01)
    assert bool(ok.all())
    assert torch.equal(torch.triu(upper), upper)
    for e in range(EXPERTS):
        want = torch.linalg.inv(_oracle_factor(hessians[e], 0.01))
        assert torch.allclose(upper[e], want, rtol=FACTOR_RTOL, atol=FACTOR_RTOL * float(want.abs().max())), e


def test_the_batched_solver_equals_the_per_expert_float64_oracle():
    weight, hessians, scale_2, search_bits = _batch()
    for options in (GptqOptions(), GptqOptions(damping=0.1, block_columns=32, scale_window=(-1, 3))):
        codes, bits, ok = gptq_quantize(weight, hessians, scale_2, search_bits, **options.solver_keywords())
        assert bool(ok.all())
        for e in range(EXPERTS):
            want_codes, want_bits = reference_gptq(weight[e], hessians[e], scale_2[e], search_bits[e],
                                                   options.damping, options.scale_window)
            assert int((codes[e] != want_codes).sum()) == 0, (options, e)
            assert torch.equal(bits[e], want_bits), (options, e)


def test_an_expert_whose_hessian_never_factorises_does_not_disturb_the_others():
    """A NaN Hessian fails every damping retry: that expert alone falls back to U = I (no error propagation)."""
    weight, hessians, scale_2, search_bits = _batch()
    broken = hessians.clone()
    broken[3] = float("nan")
    codes, bits, ok = gptq_quantize(weight, broken, scale_2, search_bits)
    assert ok.tolist() == [True, True, True, False, True, True]
    alone = gptq_quantize(weight[:3], hessians[:3], scale_2[:3], search_bits[:3])
    assert torch.equal(codes[:3], alone[0]) and torch.equal(bits[:3], alone[1])
