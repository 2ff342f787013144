"""The batched, no-read-back conversion path (used on CUDA) against the per-matrix path (used on CPU)."""

from __future__ import annotations

import math

import pytest
import torch

from kimi_nvfp4.numerics.constants import E4M3_MAX
from kimi_nvfp4.numerics.methods import (
    Int4Matrix,
    ScaleMethod,
    error_stats,
    quantize_int4_matrices,
)
from kimi_nvfp4.numerics.methods.batch import quantize_int4_groups
from kimi_nvfp4.numerics.methods.quantize import (
    INT4_AWARE_HEADROOM,
    power_of_two_tensor_scale,
)
from kimi_nvfp4.numerics.methods.stats import stats_from_sums

from .conftest import realistic_int4


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


@pytest.mark.parametrize("method", list(ScaleMethod), ids=lambda m: m.value)
def test_deferred_path_gives_the_per_matrix_bytes(method):
    groups = _groups()
    batch = quantize_int4_groups(groups, method, record_stats=True, deferred=True)
    assert batch.tensors is not None and not bool(batch.checks.any())
    for g, qs in zip(groups, batch.tensors):
        for a, b in zip(quantize_int4_matrices(g, method), qs):
            _assert_same(a, b)
        assert len({float(q.weight_scale_2) for q in qs}) == 1  # the group shares one tensor scale
    flat = [(m, q) for g, qs in zip(groups, batch.tensors) for m, q in zip(g, qs)]
    for (m, q), row in zip(flat, batch.stats.tolist()):
        assert stats_from_sums(row, m.codes.numel()) == error_stats(m, q)


@pytest.mark.parametrize("deferred", [False, True])
def test_both_paths_flag_bad_group_scales(deferred):
    good = realistic_int4(8, 64, seed=5)
    bad_scale = good.group_scale.clone()
    bad_scale[0, 0] = float("nan")
    bad_scale[1, 1] = 0.0
    bad_scale[2, 0] = -1.0
    batch = quantize_int4_groups([[good], [Int4Matrix(good.codes, bad_scale)]], "int4-aware", deferred=deferred)
    assert batch.checks.tolist() == [[0, 0], [1, 2]]
    if not deferred:
        assert batch.tensors is None  # nothing is computed for bad input on the CPU path


def test_power_of_two_scale_is_the_ceiling_power_for_every_input():
    amax = torch.tensor([1e-30, 3.0e-3, 0.1, 1.0, 1568.0, 1568.0 * 4, 1568.0 * 4 * (1 + 2**-23), 7.0e5, 0.0, -1.0])
    got = power_of_two_tensor_scale(amax)
    for a, t in zip(amax.tolist(), got.tolist()):
        if a <= 0:
            assert t == pytest.approx(1 / 2688)
            continue
        exponent = math.ceil(math.log2(a / (E4M3_MAX * INT4_AWARE_HEADROOM)))
        assert t == 2.0**exponent, a


def test_histogram_by_compare_equals_scatter_histogram():
    from kimi_nvfp4.numerics.methods.block_search import magnitude_histogram, magnitude_histogram_packed

    codes = torch.randint(-8, 8, (1000, 16), generator=torch.Generator().manual_seed(0), dtype=torch.int8)
    codes[0] = -8
    codes[1] = 0
    assert torch.equal(magnitude_histogram_packed(codes), magnitude_histogram(codes))
