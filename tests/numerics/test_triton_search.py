"""The fused Triton kernels (`numerics.methods.triton_search`) give the torch path's bytes.

On CUDA (the H200 run) the compiled kernels are checked, and the whole CUDA conversion against the CPU's. Where
Triton is installed without a GPU, its CPU interpreter checks the kernels' logic in a child process (the
interpreter is chosen when kernels are defined, so it cannot be switched on inside this process).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kimi_nvfp4.numerics.methods import ScaleMethod, quantize_int4_matrices
from kimi_nvfp4.numerics.methods.batch import _fused_kernels, quantize_int4_groups

from . import triton_checks

HAS_TRITON = importlib.util.find_spec("triton") is not None


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (it comes with CUDA builds of torch)")
def test_kernels_match_torch_under_the_triton_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    run = subprocess.run(
        [sys.executable, "-m", "tests.numerics.triton_checks"], env=env, capture_output=True, text=True, timeout=600,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert run.returncode == 0, run.stderr[-3000:]
    roundings, matrices = map(int, run.stdout.split()[-2:])
    assert roundings > 20000 and matrices == 8


def test_fused_kernels_serve_amax_and_int4_aware_on_cuda_only(monkeypatch):
    assert _fused_kernels(torch.device("cpu"), ScaleMethod.INT4_AWARE) is None
    assert _fused_kernels(torch.device("cpu"), ScaleMethod.AMAX) is None
    assert _fused_kernels(torch.device("cuda"), ScaleMethod.SWEEP) is None
    if HAS_TRITON:
        assert _fused_kernels(torch.device("cuda"), ScaleMethod.AMAX) is not None
    monkeypatch.setenv("KIMI_NVFP4_TRITON", "0")
    assert _fused_kernels(torch.device("cuda"), ScaleMethod.INT4_AWARE) is None


@pytest.mark.gpu
def test_compiled_kernels_match_torch_on_cuda():
    assert HAS_TRITON, "CUDA builds of torch ship Triton"
    assert triton_checks.check_e4m3_rounding("cuda") > 20000
    assert triton_checks.check_search_and_encode("cuda") == 8


@pytest.mark.gpu
@pytest.mark.parametrize("method", [ScaleMethod.AMAX, ScaleMethod.INT4_AWARE], ids=lambda m: m.value)
def test_cuda_conversion_with_kernels_matches_cpu(monkeypatch, method):
    assert _fused_kernels(torch.device("cuda"), method) is not None
    mats = triton_checks.edge_matrices()
    groups = [[mats[0], mats[0]], [mats[1]], [mats[2]], [mats[3]]]
    cpu = [quantize_int4_matrices(g, method) for g in groups]
    cuda = quantize_int4_groups([[m.to("cuda") for m in g] for g in groups], method, record_stats=True)
    cpu_stats = quantize_int4_groups(groups, method, record_stats=True).stats
    for got, want in zip(cuda.stats.cpu(), cpu_stats):
        triton_checks.check_stats(got, want)
    monkeypatch.setenv("KIMI_NVFP4_TRITON", "0")
    torch_path = quantize_int4_groups([[m.to("cuda") for m in g] for g in groups], method)
    for expected, got, other in zip(cpu, cuda.tensors, torch_path.tensors):
        for a, b, c in zip(expected, got, other):
            for x, y, z in ((a.weight, b.weight, c.weight), (a.weight_scale.view(torch.uint8),
                            b.weight_scale.view(torch.uint8), c.weight_scale.view(torch.uint8)),
                            (a.weight_scale_2, b.weight_scale_2, c.weight_scale_2)):
                assert torch.equal(x, y.cpu()) and torch.equal(x, z.cpu())
