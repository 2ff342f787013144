"""bench/harness/modelopt_cpu: the pure-torch NVFP4 fake quantization is Model Optimizer's, bit for bit, and the CPU
patch lets Model Optimizer's own recipes run (and restores everything afterwards)."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # bench/ lives beside the package, not inside it
    sys.path.insert(0, str(REPO_ROOT))

pytest.importorskip("triton")
mtq = pytest.importorskip("modelopt.torch.quantization")

from bench.harness.modelopt_cpu.fake_quant import fp4_fake_quant_block  # noqa: E402
from bench.harness.modelopt_cpu.patch import modelopt_on_cpu  # noqa: E402

CHECKS = Path(__file__).with_name("modelopt_triton_checks.py")
INTERPRETER_TIMEOUT_S = 600


def _interpret() -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.run([sys.executable, str(CHECKS)], env=env, capture_output=True, text=True,
                          timeout=INTERPRETER_TIMEOUT_S)


def test_static_kernel_bit_exact_under_the_triton_interpreter():
    """static_blockwise_fp4_fake_quant (MSE / local-Hessian / four-over-six weights): fp32 and bf16 inputs, zero,
    tiny and huge block amaxes, E2M1 ties, both E4M3 normalisations."""
    run = _interpret()
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert "bit-exact" in run.stdout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dynamic_fake_quant_equals_nvfp4qtensor_round_trip(dtype):
    """Per 16-block dynamic scales with a global amax = Model Optimizer's exporter (NVFP4QTensor.quantize, then
    E2M1 x E4M3 x scale_2), rounded once to the input dtype. (The oracle for `fp4_fake_quant_block`: Model
    Optimizer's Triton kernel for it uses `tl.make_block_ptr`, which the pinned Triton's interpreter cannot run,
    so the kernel itself is not checked on CPU.)"""
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    from kimi_nvfp4.numerics.nvfp4 import NVFP4Tensor, dequantize_nvfp4

    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(128, 256, generator=gen) * torch.exp(torch.randn(128, 1, generator=gen) * 2.0)).to(dtype)
    x[0] = 0.0
    global_amax = x.float().abs().amax()
    packed, scale, scale_2 = NVFP4QTensor.quantize(x.float(), 16, weights_scaling_factor_2=global_amax / (6 * 448))
    ref = dequantize_nvfp4(NVFP4Tensor(packed._quantized_data, scale, scale_2.float().reshape(())), dtype=torch.float32)
    assert torch.equal(fp4_fake_quant_block(x, global_amax), ref.to(dtype))


def _tiny_linear() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False)), torch.randn(8, 64)


@pytest.mark.parametrize("recipe", ["NVFP4_FOUR_OVER_SIX_CFG", "NVFP4_AWQ_LITE_CFG"])
def test_recipes_refuse_cpu_without_the_patch_and_run_with_it(recipe):
    """Four-over-six stops at the static kernel ("requires triton"), AWQ-lite at the dynamic op's CUDA assert."""
    model, x = _tiny_linear()
    with pytest.raises((RuntimeError, AssertionError)):
        mtq.quantize(copy.deepcopy(model), copy.deepcopy(getattr(mtq, recipe)), forward_loop=lambda m: m(x))
    with modelopt_on_cpu():
        quantized = mtq.quantize(model, copy.deepcopy(getattr(mtq, recipe)), forward_loop=lambda m: m(x))
        y = quantized(x)
    assert torch.isfinite(y).all() and not torch.equal(y, x @ quantized[0].weight.T)


def test_patch_is_undone_on_exit():
    import modelopt.torch.kernels.quantization.gemm as kernels
    import modelopt.torch.quantization.tensor_quant as tensor_quant

    before = (kernels.IS_AVAILABLE, tensor_quant.dynamic_block_quantize_op, hasattr(kernels, "fp4_fake_quant_block"))
    with modelopt_on_cpu():
        assert kernels.IS_AVAILABLE
    assert (kernels.IS_AVAILABLE, tensor_quant.dynamic_block_quantize_op,
            hasattr(kernels, "fp4_fake_quant_block")) == before
