"""The fused weight-check kernel (`numerics.compare_kernel`) gives `stats.error_sums`' figures, and validate's
weight check uses it on CUDA.

Where Triton is installed without a GPU, its CPU interpreter checks the kernel's logic in a child process; on CUDA
(the H200 run) the compiled kernel is checked.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from . import compare_checks

HAS_TRITON = importlib.util.find_spec("triton") is not None
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (it comes with CUDA builds of torch)")
def test_fused_weight_check_matches_error_sums_under_the_triton_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, "-m", "tests.numerics.compare_checks"], env=env, capture_output=True, text=True,
        timeout=600, cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert int(run.stdout.split()[-1]) == 9


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_weight_check_matches_error_sums_on_cuda():
    assert compare_checks.check_compare_kernel("cuda") == 9
