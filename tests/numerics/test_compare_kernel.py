"""The fused weight-check kernel (`numerics.compare_kernel`) gives `stats.error_sums`' figures, and validate's
weight check uses it on CUDA.

Where Triton is installed without a GPU, its CPU interpreter checks the kernel's logic in a child process; on CUDA
(the H200 run) the compiled kernel is checked.
"""

from __future__ import annotations

import pytest
import torch

from . import compare_checks
from .interpreter import requires_triton, run_under_interpreter


@requires_triton
def test_fused_weight_check_matches_error_sums_under_the_triton_interpreter():
    out = run_under_interpreter("tests.numerics.compare_checks")
    assert int(out.split()[-1]) == 9


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_weight_check_matches_error_sums_on_cuda():
    assert compare_checks.check_compare_kernel("cuda") == 9
