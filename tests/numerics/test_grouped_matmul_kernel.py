"""The row-span product kernel (`numerics.grouped_matmul_kernel`, the CUDA path of model/batch_invariant.py): each
span's rows are their product with the span's weight, rows outside every span are untouched, and a row's bits do not
depend on the spans around it.

Where Triton is installed without a GPU, its CPU interpreter checks the kernel's logic in a child process (float16);
on CUDA (the H200 run) the compiled kernel is checked in float16 and bfloat16.
"""

from __future__ import annotations

import pytest
import torch

from . import grouped_matmul_checks
from .interpreter import requires_triton, run_under_interpreter

INVARIANCE_CASES = 22  # the rows of check_invariance's layouts that lie in a span


@requires_triton
def test_grouped_matmul_under_the_triton_interpreter():
    out = run_under_interpreter("tests.numerics.grouped_matmul_checks")
    assert int(out.split()[-1]) == len(grouped_matmul_checks.CASES) + INVARIANCE_CASES


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_grouped_matmul_products_on_cuda():
    assert grouped_matmul_checks.check_products("cuda") == 2 * len(grouped_matmul_checks.CASES)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_compiled_grouped_matmul_rows_do_not_depend_on_their_spans(dtype):
    assert grouped_matmul_checks.check_invariance("cuda", dtype) == INVARIANCE_CASES


@requires_triton
def test_mismatched_weights_are_refused():
    from kimi_nvfp4.numerics.grouped_matmul_kernel import grouped_matmul

    x = torch.zeros(4, 8, dtype=torch.float16)
    with pytest.raises(ValueError, match="one shape"):
        grouped_matmul(x, [(0, 2), (2, 4)], [torch.zeros(3, 8, dtype=torch.float16),
                                             torch.zeros(5, 8, dtype=torch.float16)], torch.zeros(4, 3))
    with pytest.raises(ValueError, match="spans for"):
        grouped_matmul(x, [(0, 2)], [], torch.zeros(4, 3))
