"""The execution paths of the search (`search/group.py`) give the same bytes and statistics; the path choice and
the group rule (tensor scales, fallback) are made in one place."""

from __future__ import annotations

import math

import pytest
import torch

from kimi_nvfp4.numerics.constants import E4M3_MAX
from kimi_nvfp4.numerics.methods import (
    Int4Matrix,
    ScaleMethod,
    SearchPath,
    error_stats,
    method_spec,
    quantize_int4_groups,
    quantize_int4_matrices,
    stats_from_sums,
)
from kimi_nvfp4.numerics.methods.catalog.int4_aware import INT4_AWARE_SEARCH
from kimi_nvfp4.numerics.methods.search.group import choose_path, search_group
from kimi_nvfp4.numerics.methods.search.reference import magnitude_histogram
from kimi_nvfp4.numerics.methods.search.rule import power_of_two_tensor_scale

from .conftest import realistic_int4

WEIGHT_ONLY = [ScaleMethod.AMAX, ScaleMethod.INT4_AWARE, ScaleMethod.SWEEP]


def _groups() -> list[list[Int4Matrix]]:
    gate, up = realistic_int4(64, 256, seed=1), realistic_int4(64, 256, seed=2, row_spread=1.0)
    down = realistic_int4(256, 64, seed=3)
    zero = Int4Matrix(torch.zeros(16, 64, dtype=torch.int8), torch.ones(16, 2))
    sparse = realistic_int4(32, 128, seed=4)
    sparse.codes[::3] = 0  # all-zero blocks next to ordinary ones
    return [[gate, up], [down], [zero], [sparse]]


def _assert_same(a, b) -> None:
    assert torch.equal(a.weight, b.weight)
    assert torch.equal(a.weight_scale.view(torch.uint8), b.weight_scale.view(torch.uint8))
    assert torch.equal(a.weight_scale_2, b.weight_scale_2)


@pytest.mark.parametrize("method", WEIGHT_ONLY, ids=lambda m: m.value)
def test_reference_path_gives_the_cpu_tables_bytes_and_stats(method):
    groups = _groups()
    tables = quantize_int4_groups(groups, method, record_stats=True)
    reference = quantize_int4_groups(groups, method, record_stats=True, path=SearchPath.REFERENCE)
    assert not bool(reference.checks.any())
    for g, qs, ref in zip(groups, tables.tensors, reference.tensors):
        for a, b in zip(qs, ref):
            _assert_same(a, b)
        assert len({float(q.weight_scale_2) for q in ref}) == 1  # the group shares one tensor scale
    flat = [(m, q) for g, qs in zip(groups, reference.tensors) for m, q in zip(g, qs)]
    for (m, q), row in zip(flat, reference.stats.tolist()):
        assert stats_from_sums(row, m.codes.numel()) == error_stats(m, q)
    assert torch.equal(tables.stats, reference.stats)


@pytest.mark.parametrize("path", [None, SearchPath.REFERENCE], ids=["default-path", "reference"])
def test_bad_group_scales_are_flagged(path):
    good = realistic_int4(8, 64, seed=5)
    bad_scale = good.group_scale.clone()
    bad_scale[0, 0] = float("nan")
    bad_scale[1, 1] = 0.0
    bad_scale[2, 0] = -1.0
    batch = quantize_int4_groups([[good], [Int4Matrix(good.codes, bad_scale)]], "int4-aware", path=path)
    assert batch.checks.tolist() == [[0, 0], [1, 2]]
    assert len(batch.tensors) == 2  # computed anyway (nothing is read back); the caller refuses the batch


def test_path_choice_is_explicit_and_checked():
    m = realistic_int4(8, 64, seed=6)
    assert choose_path([m], INT4_AWARE_SEARCH) is SearchPath.CPU_TABLES
    nan_scale = m.group_scale.clone()
    nan_scale[0, 0] = float("nan")
    assert choose_path([m, Int4Matrix(m.codes, nan_scale)], INT4_AWARE_SEARCH) is SearchPath.REFERENCE
    assert choose_path([m], INT4_AWARE_SEARCH, SearchPath.REFERENCE) is SearchPath.REFERENCE
    with pytest.raises(ValueError, match="triton"):
        choose_path([m], INT4_AWARE_SEARCH, SearchPath.TRITON)  # CPU matrices: never the kernels
    with pytest.raises(ValueError, match="cpu-tables"):
        choose_path([Int4Matrix(m.codes, nan_scale)], INT4_AWARE_SEARCH, SearchPath.CPU_TABLES)


@pytest.mark.parametrize("path", [SearchPath.CPU_TABLES, SearchPath.REFERENCE], ids=lambda p: p.value)
def test_the_group_keeps_model_optimizers_result_when_the_search_loses(path, monkeypatch):
    """Force the search's error totals above Model Optimizer's: the whole group takes amax's bytes."""
    import kimi_nvfp4.numerics.methods.search.group as group_module

    gate, up = _groups()[0]
    real_search = group_module._search

    def losing_search(*args):
        result = real_search(*args)
        result.chosen_error = result.baseline_error + 1.0
        return result

    monkeypatch.setattr(group_module, "_search", losing_search)
    choice = search_group([gate, up], INT4_AWARE_SEARCH, path, [None, None] if path is SearchPath.REFERENCE else
                          [group_module.BlockKeys.of(gate), group_module.BlockKeys.of(up)])
    assert bool(choice.fell_back)
    for got, want in zip(quantize_int4_matrices([gate, up], "int4-aware", path=path),
                         quantize_int4_matrices([gate, up], "amax", path=path)):
        _assert_same(got, want)


def test_power_of_two_scale_is_the_ceiling_power_for_every_input():
    headroom = method_spec("int4-aware").search.tensor_scale_headroom
    amax = torch.tensor([1e-30, 3.0e-3, 0.1, 1.0, 1568.0, 1568.0 * 4, 1568.0 * 4 * (1 + 2**-23), 7.0e5, 0.0, -1.0])
    got = power_of_two_tensor_scale(amax, headroom)
    for a, t in zip(amax.tolist(), got.tolist()):
        if a <= 0:
            assert t == pytest.approx(1 / 2688)
            continue
        exponent = math.ceil(math.log2(a / (E4M3_MAX * headroom)))
        assert t == 2.0**exponent, a


def test_magnitude_histogram_counts_each_magnitude():
    codes = torch.randint(-8, 8, (1000, 16), generator=torch.Generator().manual_seed(0), dtype=torch.int8)
    codes[0] = -8
    codes[1] = 0
    expected = torch.stack([(codes.abs() == k).sum(dim=1) for k in range(1, 9)]).to(torch.float32)
    assert torch.equal(magnitude_histogram(codes), expected)


def test_methods_that_need_statistics_are_refused_by_the_weight_only_api():
    from kimi_nvfp4.numerics.methods import StatisticsNeed, weight_only_methods

    needing = [m for m in ScaleMethod if m not in weight_only_methods()]
    assert all(method_spec(m).statistics is not StatisticsNeed.NONE for m in needing)
    for m in needing:
        with pytest.raises(ValueError, match="calibration statistics"):
            quantize_int4_matrices([realistic_int4(4, 64)], m)
