"""gptq's `pool_tokens` (an expert's H blended with the layer's all-token H) and `block_order` (16-column blocks by
decreasing input energy): off by default (today's bits), and each changes the result as it says."""

from __future__ import annotations

import torch

from kimi_nvfp4.numerics.constants import NVFP4_BLOCK_SIZE
from kimi_nvfp4.numerics.methods import ExpertMatrices, InputStatsAccumulator, quantize_int4_matrices, requantize_experts
from kimi_nvfp4.numerics.methods.catalog.gptq import GptqOptions, _shrunk_hessian
from kimi_nvfp4.numerics.methods.output_aware.gptq_solver import block_energy_order, gptq_quantize
from kimi_nvfp4.numerics.methods.output_aware.refine import RefineInput

from .conftest import heavy_tailed_rows, realistic_int4


def _stats(rows: torch.Tensor):
    acc = InputStatsAccumulator(rows.shape[1], dense=True)
    acc.add(rows)
    return acc.stats()


def _case(seed: int = 1):
    m = realistic_int4(6, 64, seed=seed, row_spread=1.0)
    own = _stats(heavy_tailed_rows(80, 64, seed=seed + 1))
    shared = _stats(heavy_tailed_rows(2000, 64, seed=seed + 2) * torch.linspace(0.3, 3.0, 64))
    return m, own, shared


def _solve(m, search, hessian, **keywords):
    return gptq_quantize(m.values().double().unsqueeze(0), hessian.unsqueeze(0), search.weight_scale_2.view(1),
                         search.weight_scale.view(torch.uint8).unsqueeze(0), **keywords)


def test_the_defaults_are_todays_gptq():
    m, own, shared = _case()
    (search,) = quantize_int4_matrices([m], "int4-aware")
    item = RefineInput([m], [search], own, shared)
    assert torch.equal(_shrunk_hessian(item, GptqOptions()), _shrunk_hessian(RefineInput([m], [search], own)))
    assert GptqOptions().solver_keywords()["block_order"] is False
    plain, pooled_off = (requantize_experts("gptq", [ExpertMatrices("x", [m], own, s)]).experts[0] for s in (None, shared))
    assert torch.equal(plain.tensors[0].weight, pooled_off.tensors[0].weight)
    assert torch.equal(plain.tensors[0].weight_scale.view(torch.uint8), pooled_off.tensors[0].weight_scale.view(torch.uint8))


def test_pooling_blends_toward_the_layer_hessian_and_changes_the_result():
    m, own, shared = _case()
    (search,) = quantize_int4_matrices([m], "int4-aware")
    item = RefineInput([m], [search], own, shared)
    base = _shrunk_hessian(RefineInput([m], [search], own))
    pool = _shrunk_hessian(RefineInput([m], [search], shared))
    k = 240.0
    blended = _shrunk_hessian(item, GptqOptions(pool_tokens=k))
    assert torch.allclose(blended, (own.tokens * base + k * pool) / (own.tokens + k))
    assert not torch.equal(_solve(m, search, blended)[0], _solve(m, search, base)[0])
    # an expert with no layer statistics (down) is unchanged by the option
    assert torch.equal(_shrunk_hessian(RefineInput([m], [search], own), GptqOptions(pool_tokens=k)), base)


def test_pooling_with_unbounded_k_solves_with_the_layer_hessian():
    m, own, shared = _case(seed=5)
    (search,) = quantize_int4_matrices([m], "int4-aware")
    blended = _shrunk_hessian(RefineInput([m], [search], own, shared), GptqOptions(pool_tokens=1e15))
    pool = _shrunk_hessian(RefineInput([m], [search], shared))
    assert torch.allclose(blended, pool, rtol=1e-10, atol=1e-12 * float(pool.abs().max()))
    got, want = _solve(m, search, blended), _solve(m, search, pool)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # and through the method: the expert quantized as if its statistics were the layer's
    expert = ExpertMatrices("x", [m], own, shared)
    tensors = requantize_experts("gptq", [expert], options={"pool_tokens": 1e15}).experts[0]
    if not tensors.kept_search[0]:
        from kimi_nvfp4.numerics.e2m1 import pack_e2m1
        assert torch.equal(tensors.tensors[0].weight, pack_e2m1(want[0][0]))


def test_the_block_order_sorts_blocks_by_energy_and_keeps_them_whole():
    hessian = torch.diag(torch.tensor([1.0] * 16 + [5.0] * 16 + [3.0] * 16 + [5.0] * 16, dtype=torch.float64))
    assert block_energy_order(hessian.unsqueeze(0)).tolist() == [[1, 3, 2, 0]]  # ties keep input order


def test_block_order_equals_solving_the_permuted_problem_and_changes_the_result():
    m, own, _ = _case(seed=9)
    (search,) = quantize_int4_matrices([m], "int4-aware")
    hessian = own.hessian * torch.outer(*(torch.linspace(0.2, 4.0, 64, dtype=torch.float64),) * 2)
    codes, bits, ok = _solve(m, search, hessian, block_order=True, block_columns=32)
    order = block_energy_order(hessian.unsqueeze(0))[0]
    assert order.tolist() != [0, 1, 2, 3]
    columns = (order.unsqueeze(-1) * NVFP4_BLOCK_SIZE + torch.arange(NVFP4_BLOCK_SIZE)).reshape(-1)
    w = m.values().double()[:, columns]
    p_codes, p_bits, _ = gptq_quantize(w.unsqueeze(0), hessian[columns][:, columns].unsqueeze(0),
                                       search.weight_scale_2.view(1),
                                       search.weight_scale.view(torch.uint8)[:, order].unsqueeze(0), block_columns=32)
    assert bool(ok.all())
    assert torch.equal(codes[0][:, columns], p_codes[0]) and torch.equal(bits[0][:, order], p_bits[0])
    plain = _solve(m, search, hessian, block_columns=32)
    assert not torch.equal(plain[0], codes)
    # batched: each expert its own order, as alone
    m2, own2, _ = _case(seed=11)
    (search2,) = quantize_int4_matrices([m2], "int4-aware")
    both = gptq_quantize(torch.stack([m.values().double(), m2.values().double()]),
                         torch.stack([hessian, own2.hessian]),
                         torch.stack([search.weight_scale_2, search2.weight_scale_2]),
                         torch.stack([search.weight_scale.view(torch.uint8), search2.weight_scale.view(torch.uint8)]),
                         block_order=True)
    alone = _solve(m2, search2, own2.hessian, block_order=True)
    assert torch.equal(both[0][0], _solve(m, search, hessian, block_order=True)[0][0])
    assert torch.equal(both[0][1], alone[0][0]) and torch.equal(both[1][1], alone[1][0])
    tuned = requantize_experts("gptq", [ExpertMatrices("x", [m], own)], options={"block_order": True}).experts[0]
    assert tuned.final_error[0] <= tuned.search_error[0]
