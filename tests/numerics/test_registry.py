"""The method registry (`numerics/methods/registry.py`) and the candidate rule as data (`search/rule.py`)."""

from __future__ import annotations

import pkgutil
from pathlib import Path

import pytest
import torch

import kimi_nvfp4.numerics.methods.catalog as catalog
from kimi_nvfp4.numerics.constants import E2M1_MAX
from kimi_nvfp4.numerics.methods import (
    DEFAULT_METHOD,
    ScaleMethod,
    ScaleMethodSpec,
    StatisticsNeed,
    method_spec,
    weight_only_methods,
)
from kimi_nvfp4.numerics.methods.catalog.int4_aware import INT4_AWARE_RULE
from kimi_nvfp4.numerics.methods.search.group import BlockSearch
from kimi_nvfp4.numerics.methods.search.reference import block_max_code, flat_blocks
from kimi_nvfp4.numerics.methods.search.rule import EveryE4M3Scale, model_optimizer_bits

from .conftest import realistic_int4


def test_every_catalog_module_is_a_registered_method():
    modules = [info.name for info in pkgutil.iter_modules([str(Path(catalog.__file__).parent)])]
    names = {m.value for m in ScaleMethod}
    assert len(modules) == len(names)
    for module in modules:
        spec = __import__(f"kimi_nvfp4.numerics.methods.catalog.{module}", fromlist=["METHOD"]).METHOD
        assert spec.name in names and method_spec(spec.name) is spec
        assert spec.description and spec.search is not None


def test_names_default_and_weight_only_methods():
    assert DEFAULT_METHOD is ScaleMethod.INT4_AWARE and ScaleMethod("amax") is ScaleMethod.AMAX
    weight_only = weight_only_methods()
    assert [m.value for m in weight_only][:3] == ["amax", "int4-aware", "sweep"]
    assert list(ScaleMethod)[: len(weight_only)] == weight_only  # the CLI lists weight-only methods first
    assert all(method_spec(m).statistics is StatisticsNeed.NONE and method_spec(m).refine is None for m in weight_only)
    assert method_spec("amax").search.candidates is None
    assert isinstance(method_spec("sweep").search.candidates, EveryE4M3Scale)
    assert method_spec(ScaleMethod.INT4_AWARE).search.candidates is INT4_AWARE_RULE
    with pytest.raises(ValueError, match="registered: amax, int4-aware"):
        method_spec("fp8-sweep")


def test_output_aware_methods_are_registered_with_their_statistics():
    act_diag, gptq = method_spec("act-diag"), method_spec("gptq")
    assert act_diag.statistics is StatisticsNeed.DIAGONAL and gptq.statistics is StatisticsNeed.HESSIAN
    for spec in (act_diag, gptq):
        assert spec.refine is not None and spec.search is method_spec("int4-aware").search
        assert ScaleMethod(spec.name) not in weight_only_methods()


def test_a_spec_pairs_statistics_with_a_refinement():
    search = BlockSearch(None)
    with pytest.raises(ValueError):
        ScaleMethodSpec("x", "needs statistics but refines nothing", search, statistics=StatisticsNeed.DIAGONAL)
    with pytest.raises(ValueError):
        ScaleMethodSpec("x", "refines without statistics", search, refine=lambda *a: None)


def test_the_int4_aware_rule_as_data():
    assert INT4_AWARE_RULE.count == 7
    assert INT4_AWARE_RULE.tensor_scale_headroom == 3.5  # |code| 7 at d = 2 * s_group: block_amax / 3.5
    first = INT4_AWARE_RULE.fractions[0]
    assert first.divisor == E2M1_MAX and first.lowest <= 0 <= first.highest
    assert method_spec("sweep").search.tensor_scale_headroom == INT4_AWARE_RULE.tensor_scale_headroom


def test_the_first_target_at_offset_zero_is_model_optimizers_block_scale():
    """What makes the search never worse than `amax` per block under the same tensor scale."""
    m = realistic_int4(32, 256, seed=3, row_spread=1.5)
    block_codes, block_scale = flat_blocks(m.codes, m.group_scale)
    max_code = block_max_code(block_codes)
    live = max_code > 0
    for weight_scale_2 in (torch.tensor(2.0**-12), torch.tensor(3.1e-4)):
        bits = INT4_AWARE_RULE.bits(max_code, block_scale, weight_scale_2)
        at_zero = -INT4_AWARE_RULE.fractions[0].lowest
        want = model_optimizer_bits(max_code, block_scale, weight_scale_2)
        assert torch.equal(bits[at_zero][live], want[live])


def test_rule_candidates_are_the_rounded_targets_and_their_neighbours():
    max_code = torch.tensor([7, 5], dtype=torch.int16)
    scale = torch.tensor([0.25, 0.25])
    bits = INT4_AWARE_RULE.bits(max_code, scale, torch.tensor(2.0**-8)).to(torch.int32)
    e4m3 = lambda x: int(torch.tensor(x).to(torch.float8_e4m3fn).view(torch.uint8))  # noqa: E731
    # |code| 7: amax 1.75 -> d targets 1.75/6, 1.75/4 and 2 * 0.25 (in units of 2**-8)
    expected_7 = [e4m3(1.75 / 6 * 256) + o for o in (0, 1)] + [e4m3(1.75 / 4 * 256) + o for o in (-1, 0, 1)]
    expected_7 += [e4m3(0.5 * 256) + o for o in (-1, 0)]
    expected_5 = [e4m3(1.25 / 6 * 256) + o for o in (0, 1)] + [e4m3(1.25 / 4 * 256) + o for o in (-1, 0, 1)]
    expected_5 += [e4m3(0.25 * 256) + o for o in (-1, 0)]  # |code| <= 6: s_group, not 2 * s_group
    assert bits[:, 0].tolist() == expected_7 and bits[:, 1].tolist() == expected_5
