"""The fused Triton kernels (`numerics.methods.search.triton_kernels`) give the reference's bytes.

On CUDA (the H200 run) the compiled kernels are checked, and the whole CUDA conversion against the CPU's. Where
Triton is installed without a GPU, its CPU interpreter checks the kernels' logic in a child process (the
interpreter is chosen when kernels are defined, so it cannot be switched on inside this process).
"""

from __future__ import annotations

import pytest
import torch

from kimi_nvfp4.numerics.methods import ScaleMethod, SearchPath, method_spec, quantize_int4_groups, quantize_int4_matrices
from kimi_nvfp4.numerics.methods.catalog.int4_aware import INT4_AWARE_RULE
from kimi_nvfp4.numerics.methods.search.group import choose_path
from kimi_nvfp4.numerics.methods.search.rule import AmaxFractionTarget, CandidateRule, EveryE4M3Scale

from . import triton_checks
from .interpreter import HAS_TRITON, requires_triton, run_under_interpreter


@requires_triton
def test_kernels_match_the_reference_under_the_triton_interpreter():
    out = run_under_interpreter("tests.numerics.triton_checks")
    roundings, matrices = map(int, out.split()[-2:])
    assert roundings > 20000 and matrices == 8


@requires_triton
def test_kernel_constants_come_from_the_rule():
    from kimi_nvfp4.numerics.methods.search import triton_kernels as kernels

    constants = kernels.kernel_constants(INT4_AWARE_RULE)
    first, second = INT4_AWARE_RULE.fractions
    assert (constants["FIRST_DIVISOR"], constants["FIRST_LOWEST"], constants["FIRST_HIGHEST"]) == (6.0, 0, 1)
    assert (constants["SECOND_DIVISOR"], constants["SECOND_LOWEST"], constants["SECOND_HIGHEST"]) == (4.0, -1, 1)
    assert (constants["WIDE_FROM_CODE"], constants["WIDE_MULTIPLE"]) == (7, 2.0)
    assert (constants["ALIGNED_LOWEST"], constants["ALIGNED_HIGHEST"]) == (-1, 0)
    assert kernels.supports(None) and kernels.supports(INT4_AWARE_RULE) and kernels.supports(triton_checks.OTHER_RULE)
    three = CandidateRule(INT4_AWARE_RULE.fractions + (AmaxFractionTarget(5.0, 0, 0),), INT4_AWARE_RULE.aligned)
    assert not kernels.supports(EveryE4M3Scale()) and not kernels.supports(three)
    with pytest.raises(ValueError):
        kernels.kernel_constants(three)


@pytest.mark.gpu
def test_compiled_kernels_match_the_reference_on_cuda():
    assert HAS_TRITON, "CUDA builds of torch ship Triton"
    assert triton_checks.check_e4m3_rounding("cuda") > 20000
    assert triton_checks.check_search_and_encode("cuda") == 8


@pytest.mark.gpu
@pytest.mark.parametrize("method", [ScaleMethod.AMAX, ScaleMethod.INT4_AWARE], ids=lambda m: m.value)
def test_cuda_conversion_with_kernels_matches_cpu(method):
    mats = triton_checks.edge_matrices()
    groups = [[mats[0], mats[0]], [mats[1]], [mats[2]], [mats[3]]]
    on_cuda = [[m.to("cuda") for m in g] for g in groups]
    assert choose_path(on_cuda[0], method_spec(method).search) is SearchPath.TRITON
    cpu = [quantize_int4_matrices(g, method) for g in groups]
    cuda = quantize_int4_groups(on_cuda, method, record_stats=True)
    cpu_stats = quantize_int4_groups(groups, method, record_stats=True).stats
    for got, want in zip(cuda.stats.cpu(), cpu_stats):
        triton_checks.check_stats(got, want)
    torch_path = quantize_int4_groups(on_cuda, method, path=SearchPath.REFERENCE)
    for expected, got, other in zip(cpu, cuda.tensors, torch_path.tensors):
        for a, b, c in zip(expected, got, other):
            for x, y, z in ((a.weight, b.weight, c.weight), (a.weight_scale.view(torch.uint8),
                            b.weight_scale.view(torch.uint8), c.weight_scale.view(torch.uint8)),
                            (a.weight_scale_2, b.weight_scale_2, c.weight_scale_2)):
                assert torch.equal(x, y.cpu()) and torch.equal(x, z.cpu())
