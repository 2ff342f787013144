"""The fused GPTQ block kernel (`numerics.gptq_block_kernel`) equals the torch block step bit for bit (codes, scales and
errors), and the whole solver gives the same codes and block scales with and without it.

Where Triton is installed without a GPU, its CPU interpreter checks the kernel's logic in a child process; on CUDA
(the H200 run) the compiled kernel is checked.
"""

from __future__ import annotations

import pytest
import torch

from . import gptq_block_checks
from .interpreter import requires_triton, run_under_interpreter

BLOCK_CASES = 4
SOLVER_CASES = 2


@requires_triton
def test_gptq_block_kernel_matches_the_torch_loop_under_the_triton_interpreter():
    out = run_under_interpreter("tests.numerics.gptq_block_checks")
    assert int(out.split()[-1]) == BLOCK_CASES


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_gptq_block_kernel_matches_the_torch_loop_on_cuda():
    assert gptq_block_checks.check_blocks("cuda") == BLOCK_CASES


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gptq_on_cuda_gives_the_same_codes_with_and_without_the_fused_kernel():
    assert gptq_block_checks.check_gptq_quantize("cuda") == SOLVER_CASES
