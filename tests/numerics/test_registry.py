"""The method registry (`numerics/methods/registry.py`: entries of `plugins.Registry` with typed options and
execution paths) and the candidate rule as data (`search/rule.py`)."""

from __future__ import annotations

import pkgutil
from pathlib import Path

import pytest
import torch

import kimi_nvfp4.numerics.methods.catalog as catalog
from kimi_nvfp4.numerics.constants import E2M1_MAX
from kimi_nvfp4.numerics.methods import (
    DEFAULT_METHOD,
    METHODS,
    ExecutionPath,
    ScaleMethod,
    ScaleMethodSpec,
    StatisticsNeed,
    method_options,
    method_spec,
    weight_only_methods,
)
from kimi_nvfp4.numerics.methods.catalog.act_diag import ActDiagOptions
from kimi_nvfp4.numerics.methods.catalog.gptq import GptqOptions
from kimi_nvfp4.numerics.methods.catalog.int4_aware import INT4_AWARE_RULE
from kimi_nvfp4.numerics.methods.output_aware.gptq_solver import HESSIAN_DAMPING
from kimi_nvfp4.plugins import PluginError
from kimi_nvfp4.numerics.methods.search.group import BlockSearch
from kimi_nvfp4.numerics.methods.search.reference import block_max_code, flat_blocks
from kimi_nvfp4.numerics.methods.search.rule import EveryE4M3Scale, model_optimizer_bits

from .conftest import realistic_int4


def test_every_catalog_module_is_a_registered_method():
    modules = [info.name for info in pkgutil.iter_modules([str(Path(catalog.__file__).parent)])]
    names = {m.value for m in ScaleMethod}
    assert len(modules) == len(names)
    for module in modules:
        spec = __import__(f"kimi_nvfp4.numerics.methods.catalog.{module}", fromlist=["PLUGIN"]).PLUGIN
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
    assert method_spec("INT4_AWARE") is method_spec("int4-aware")  # the registry's spelling rule


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


def test_a_spec_without_a_triton_path_says_why():
    search = BlockSearch(None)
    torch_only = (ExecutionPath.CPU_REFERENCE, ExecutionPath.TORCH_CUDA)
    with pytest.raises(ValueError, match="no_triton"):
        ScaleMethodSpec("x", "no reason given", search, paths=torch_only)
    with pytest.raises(ValueError, match="no_triton"):
        ScaleMethodSpec("x", "a reason for a path it has", search, no_triton="because")
    assert ScaleMethodSpec("x", "ok", search, paths=torch_only, no_triton="because").no_triton == "because"


def test_the_registry_states_the_triton_path_the_kernels_take():
    """A weight-only method lists TRITON exactly when the search kernels hold its candidates."""
    kernels = pytest.importorskip("kimi_nvfp4.numerics.methods.search.triton_kernels")
    for spec in METHODS.entries():
        assert spec.paths and ExecutionPath.CPU_REFERENCE in spec.paths
        if spec.weight_only:
            assert (ExecutionPath.TRITON in spec.paths) == kernels.supports(spec.search.candidates), spec.name
    assert ExecutionPath.TRITON not in method_spec("sweep").paths


def test_a_method_without_triton_says_once_that_it_runs_torch_on_cuda(capsys):
    from kimi_nvfp4.numerics.methods import registry

    registry._notice_once.cache_clear()
    method_spec("sweep").notice_path(torch.device("cpu"))
    method_spec("int4-aware").notice_path("cuda:1")
    assert capsys.readouterr().err == ""
    for _ in range(2):
        method_spec("sweep").notice_path("cuda:1")
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("note: scale method sweep has no Triton path (")
    assert "126 candidates" in err[0] and err[0].endswith("running its torch path on CUDA (slower)")


def test_methods_carry_typed_options():
    gptq = method_options("gptq", {"damping": "0.02", "scale_window": "-2,6", "fused_kernel": "false"})
    assert isinstance(gptq, GptqOptions)
    assert (gptq.damping, gptq.scale_window, gptq.fused_kernel) == (0.02, (-2, 6), False)
    assert gptq.solver_keywords()["damping"] == 0.02 and gptq.solver_keywords()["scale_window"] == (-2, 6)
    # the defaults are the solver's constants (one truth), and act-diag's options are gptq's fallback's
    assert method_options("gptq") == GptqOptions(damping=HESSIAN_DAMPING)
    assert isinstance(method_options("act-diag"), ActDiagOptions) and isinstance(gptq, ActDiagOptions)
    assert method_options("gptq-w4a4").__class__ is GptqOptions
    assert method_options("int4-aware").model_dump() == {}
    with pytest.raises(PluginError, match="gptq: option block_columns: .*multiple of 16|block_columns 24"):
        method_options("gptq", {"block_columns": 24})
    with pytest.raises(PluginError, match="int4-aware: option damping"):
        method_options("int4-aware", {"damping": 0.02})
    with pytest.raises(PluginError, match="its options: energy_damping, window_steps"):
        method_options("act-diag", {"damping": "0.1"})


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


def test_the_docs_list_the_registered_methods_from_the_registry():
    """docs/numerics.md's method table is the registry's rendering (`python -m kimi_nvfp4.numerics.methods.docs
    docs/numerics.md` rewrites it), never a hand-kept copy."""
    from kimi_nvfp4.numerics.methods.docs import generated_block

    page = (Path(__file__).resolve().parents[2] / "docs" / "numerics.md").read_text()
    assert generated_block() in page
    for spec in METHODS.entries():
        assert f"| `{spec.name}` |" in generated_block()
