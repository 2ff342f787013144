"""The fused per-expert statistics kernel (`numerics.segment_stats_kernel`) gives `segment_stats_reference`'s figures:
amax exactly (NaN included), sums of squares up to float64 addition order.

Where Triton is installed without a GPU, its CPU interpreter checks the kernel's logic in a child process; on CUDA
(the H200 run) the compiled kernel is checked.
"""

from __future__ import annotations

import pytest
import torch

from . import segment_stats_checks
from .interpreter import requires_triton, run_under_interpreter

CASES = 10


@requires_triton
def test_segment_stats_kernel_matches_reference_under_the_triton_interpreter():
    out = run_under_interpreter("tests.numerics.segment_stats_checks")
    assert int(out.split()[-1]) == CASES


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_segment_stats_kernel_matches_reference_on_cuda():
    assert segment_stats_checks.check_segment_stats("cuda") == CASES
